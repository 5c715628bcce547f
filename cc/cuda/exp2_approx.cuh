// 2^x on the MUFU unit: ex2.approx.ftz (2 ulp; -inf -> +0, results below 2^-126 flushed to 0). exp2f wraps the same
// instruction in a subnormal fix-up of three to four more instructions a value. The softmaxes take 2^x of s - m <=
// kRescaleThreshold (the sm80 kernels' lazy rescale; <= 0 up to the rounding of m in the sm90 prefill), or of
// m_old - m_new < 0, into a bf16 / f16 P and an fp32 row sum of at least 1, where a flushed subnormal is below any
// rounding error.
#pragma once

namespace jax_msa {

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace jax_msa
