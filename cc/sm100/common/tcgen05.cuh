// tcgen05 (sm_100a) kernels, UNVERIFIED: ordering fences around thread synchronization and tensor-memory loads.
// Defined only when compiling for an architecture with tcgen05 (JAX_MSA_SM100_TCGEN05); the kernels' bodies are
// empty elsewhere.
#pragma once
#include <cstdint>

#include <cute/arch/copy_sm100.hpp>
#include <cute/arch/config.hpp>
#include <cutlass/arch/barrier.h>

namespace jax_msa::sm100 {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

#if defined(CUTE_ARCH_TCGEN05_F16F32_MMA_ENABLED) && defined(CUTE_ARCH_TCGEN05_TMEM_ENABLED)
#define JAX_MSA_SM100_TCGEN05 1

// Ordering of tcgen05 operations around thread synchronization (PTX: tcgen05.fence).
__device__ __forceinline__ void tcgen05_before_thread_sync() {
  asm volatile("tcgen05.fence::before_thread_sync;" ::: "memory");
}
__device__ __forceinline__ void tcgen05_after_thread_sync() {
  asm volatile("tcgen05.fence::after_thread_sync;" ::: "memory");
}

// 32 consecutive fp32 columns of this thread's TMEM lane (the warp's lane quarter), waited for.
__device__ __forceinline__ void tmem_load_row32(uint32_t taddr, float (&x)[32]) {
  uint32_t r[32];
  cute::SM100_TMEM_LOAD_32dp32b32x::copy(taddr, r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9], r[10],
                                         r[11], r[12], r[13], r[14], r[15], r[16], r[17], r[18], r[19], r[20], r[21],
                                         r[22], r[23], r[24], r[25], r[26], r[27], r[28], r[29], r[30], r[31]);
  cutlass::arch::fence_view_async_tmem_load();
#pragma unroll
  for (int j = 0; j < 32; ++j) x[j] = __uint_as_float(r[j]);
}

// 16 consecutive fp32 columns of this thread's TMEM lane, waited for.
__device__ __forceinline__ void tmem_load_row16(uint32_t taddr, float (&x)[16]) {
  uint32_t r[16];
  cute::SM100_TMEM_LOAD_32dp32b16x::copy(taddr, r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9], r[10],
                                         r[11], r[12], r[13], r[14], r[15]);
  cutlass::arch::fence_view_async_tmem_load();
#pragma unroll
  for (int j = 0; j < 16; ++j) x[j] = __uint_as_float(r[j]);
}
#endif

}  // namespace jax_msa::sm100
