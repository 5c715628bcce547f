// Warp-level MMA building blocks shared by the warp-MMA (sm_80+) decode and prefill kernels: ldmatrix (plain and
// transposed) from shared memory, movmatrix (an 8x8 transpose in registers) and the m16n8k16 MMA with fp32
// accumulation on bf16 or f16 operands (CuTe's SM75/SM80 atoms), and the log2 / ln constants of their online softmax.
#pragma once
#include <cstdint>

#include <cute/arch/copy_sm75.hpp>
#include <cute/arch/mma_sm80.hpp>

#include "sm80/common/register_pack.cuh"

namespace jax_msa::sm80 {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// The 16-bit type both MMA operands (Q and K; P and V) are converted to. bf16 holds any bf16 query and the
// dequantized bf16 / NVFP4 cache; f16 holds FP8 E4M3 values exactly (hardware conversion on sm_89+) and a query
// scaled by a power of two per row (see decode_kernel.cuh), with 3 more mantissa bits than bf16.
enum class MmaOperand { kBf16, kF16 };

__device__ __forceinline__ void ldsm_x4(const uint8_t* p, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  cute::SM75_U32x4_LDSM_N::copy(*reinterpret_cast<const cute::uint128_t*>(p), r0, r1, r2, r3);
}
__device__ __forceinline__ void ldsm_x4_t(const uint8_t* p, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  cute::SM75_U16x8_LDSM_T::copy(*reinterpret_cast<const cute::uint128_t*>(p), r0, r1, r2, r3);
}
// The 8x8 16-bit matrix whose fragment a warp holds (lane: row lane / 4, columns 2 (lane % 4), +1) transposed, in the
// same fragment layout: the register path's V tiles become the B operand of P V.
__device__ __forceinline__ uint32_t movmatrix_t(uint32_t a) {
  uint32_t d;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(d) : "r"(a));
  return d;
}
// d += a * b for one 16x8x16 tile: a = 4 x2 registers (row major), b = 2 (column major)
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  cute::SM80_16x8x16_F32BF16BF16F32_TN::fma(d[0], d[1], d[2], d[3], a[0], a[1], a[2], a[3], b0, b1, d[0], d[1], d[2],
                                            d[3]);
}
__device__ __forceinline__ void mma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  cute::SM80_16x8x16_F32F16F16F32_TN::fma(d[0], d[1], d[2], d[3], a[0], a[1], a[2], a[3], b0, b1, d[0], d[1], d[2],
                                          d[3]);
}
template <MmaOperand Op>
__device__ __forceinline__ void mma_16x8x16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (Op == MmaOperand::kF16) mma_f16(d, a, b0, b1);
  else mma_bf16(d, a, b0, b1);
}
template <MmaOperand Op>
__device__ __forceinline__ uint32_t pack_operand_x2(float lo, float hi) {
  if constexpr (Op == MmaOperand::kF16) return pack_f16x2(lo, hi);
  else return pack_bf16x2(lo, hi);
}

}  // namespace jax_msa::sm80
