// The decode kernel's query (sm80/decode/decode_kernel.cuh): staged once a CTA in shared memory, read into the MMA's
// A-operand fragments (bf16, or f16 with a power-of-two scale per row), and kept where the main loop reads them at
// every k-step (registers, or one shared copy a CTA).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/params.h"
#include "sm80/common/warp_mma.cuh"
#include "sm80/decode/chunk_io.cuh"
#include "sm80/decode/config.h"

namespace jax_msa::sm80::decode {

// The query of (token, KV head) staged in shared memory, as stored: bf16 rows of 256 B in the swizzled layout of the
// K tiles (swizzled_offset), or FP8 rows of 128 B; rows past the group are zero (0 in both encodings). One
// coalesced cp.async pass of the CTA replaces 32 scattered 4-byte global loads per lane and warp (kQTileBytes,
// config.h).

template <bool kQFp8>
__device__ __forceinline__ int q_tile_offset(int row, int d) {
  if constexpr (kQFp8) return row * kHeadDim + d;
  return swizzled_offset(row, d >> 3) + (d & 7) * 2;
}

// Issues the query tile's loads (the caller commits them as one group): 16-byte units, zero-filled past the group;
// kCtaThreads threads share them.
template <int kCtaThreads>
__device__ __forceinline__ void load_q_tile(uint8_t* q_tile, const DecodeParams& p, int64_t row_base, int group) {
  const int units_per_row = p.q_is_fp8 ? kHeadDim / 16 : kHeadDim * 2 / 16;
  const uint8_t* q = static_cast<const uint8_t*>(p.q) + row_base * kHeadDim * (p.q_is_fp8 ? 1 : 2);
  for (int u = threadIdx.x; u < kRows * units_per_row; u += kCtaThreads) {
    const int row = u / units_per_row, unit = u % units_per_row;
    const bool live = row < group;
    const uint8_t* src = q + (live ? u * 16 : 0);  // rows < group of (t, g) are contiguous
    const int offset = p.q_is_fp8 ? q_tile_offset<true>(row, unit * 16) : q_tile_offset<false>(row, unit * 8);
    cp_async_16(q_tile + offset, src, live);
  }
}

// Two consecutive query elements (row, d..d+1) from the tile: bf16x2 bits, or the two e4m3 bytes (low half).
template <bool kQFp8>
__device__ __forceinline__ uint32_t q_pair_raw(const uint8_t* q_tile, int row, int d) {
  if constexpr (kQFp8) return *reinterpret_cast<const uint16_t*>(q_tile + q_tile_offset<true>(row, d));
  return *reinterpret_cast<const uint32_t*>(q_tile + q_tile_offset<false>(row, d));
}

// A raw pair as two floats (exact; q_scale is folded into the softmax scale). e4m3 goes through f16 (exact), by the
// hardware conversion on sm_89+.
template <bool kQFp8>
__device__ __forceinline__ float2 q_pair_to_float2(uint32_t raw) {
  if constexpr (kQFp8) {
    const uint32_t h = e4m3x2_to_f16x2(raw);
    return make_float2(__half2float(__ushort_as_half(uint16_t(h & 0xffffu))),
                       __half2float(__ushort_as_half(uint16_t(h >> 16))));
  }
  return make_float2(__uint_as_float(raw << 16), __uint_as_float(raw & 0xffff0000u));
}

// One query element (row, d) from the tile: bf16 bits or the e4m3 byte.
template <bool kQFp8>
__device__ __forceinline__ uint32_t q_element_raw(const uint8_t* q_tile, int row, int d) {
  if constexpr (kQFp8) return q_tile[q_tile_offset<true>(row, d)];
  return *reinterpret_cast<const uint16_t*>(q_tile + q_tile_offset<false>(row, d));
}

// Q as stored, in the A-operand places of 8 k-steps: rows lane/4 (registers 0, 2) and lane/4 + 8 (1, 3). A register
// j of k-step ks pairs with B register 2 ks + j / 2 of K, so it holds the dims that K register holds (kDims,
// config.h); the ldmatrix path's are the MMA's own, dims 16 ks + 2 (lane % 4) + 8 (j / 2), +1.
template <RegisterDims kDims, bool kQFp8>
__device__ __forceinline__ void read_q_raw(const uint8_t* q_tile, int lane, uint32_t (&raw)[8][4]) {
  const int r0 = lane >> 2;
#pragma unroll
  for (int ks = 0; ks < 8; ++ks) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int row = r0 + 8 * (j & 1);
      if constexpr (kDims == RegisterDims::kLaneSplitPairs) {
        const int i = 2 * ks + (j >> 1);
        raw[ks][j] = q_element_raw<kQFp8>(q_tile, row, register_dim<kDims>(lane, i, 0)) |
                     (q_element_raw<kQFp8>(q_tile, row, register_dim<kDims>(lane, i, 1)) << (kQFp8 ? 8 : 16));
      } else if constexpr (kDims == RegisterDims::kLanePairs) {
        raw[ks][j] = q_pair_raw<kQFp8>(q_tile, row, register_dim<kDims>(lane, 2 * ks + (j >> 1), 0));
      } else {
        raw[ks][j] = q_pair_raw<kQFp8>(q_tile, row, 16 * ks + 2 * (lane & 3) + 8 * (j >> 1));
      }
    }
  }
}

// Q fragments of the MMA operand type from the raw pairs. bf16: the values as they are (row_factor 1). f16: each
// row times 2^s with s chosen from the row's largest magnitude so that it lands in [2^14, 2^15) (f16's top binade;
// every bf16 value then keeps its 8 significant bits unless it is 2^-38 times smaller than that largest one), and
// row_factor = 2^-s undoes it on the scores.
template <MmaOperand Op, bool kQFp8>
__device__ __forceinline__ void q_fragments_from_raw(const uint32_t (&raw)[8][4], uint32_t (&qf)[8][4],
                                                     float (&row_factor)[2]) {
  row_factor[0] = row_factor[1] = 1.0f;
  if constexpr (Op == MmaOperand::kBf16) {
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if constexpr (kQFp8) {
          const float2 v = q_pair_to_float2<true>(raw[ks][j]);
          qf[ks][j] = pack_bf16x2(v.x, v.y);  // exact
        } else {
          qf[ks][j] = raw[ks][j];
        }
      }
    }
  } else {
    float2 v[8][4];
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
#pragma unroll
      for (int j = 0; j < 4; ++j) v[ks][j] = q_pair_to_float2<kQFp8>(raw[ks][j]);
    }
    float mul[2];
    {
      float amax[2] = {0.0f, 0.0f};
#pragma unroll
      for (int ks = 0; ks < 8; ++ks) {
#pragma unroll
        for (int j = 0; j < 4; ++j) amax[j & 1] = fmaxf(amax[j & 1], fmaxf(fabsf(v[ks][j].x), fabsf(v[ks][j].y)));
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        amax[r] = fmaxf(amax[r], __shfl_xor_sync(0xffffffffu, amax[r], 1));
        amax[r] = fmaxf(amax[r], __shfl_xor_sync(0xffffffffu, amax[r], 2));
        const int biased = int(__float_as_uint(amax[r]) >> 23) & 0xff;  // 0: zero or subnormal; 255: inf / nan
        const int s = biased == 0 || biased == 255 ? 0 : 14 - (biased - 127);  // in [-113, 140]
        const int s_mul = min(s, 126);  // 2^s and 2^-s both normal floats (a tinier row stays below 2^14)
        mul[r] = __uint_as_float(uint32_t(s_mul + 127) << 23);
        row_factor[r] = __uint_as_float(uint32_t(127 - s_mul) << 23);
      }
    }
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
#pragma unroll
      for (int j = 0; j < 4; ++j) qf[ks][j] = pack_operand_x2<Op>(v[ks][j].x * mul[j & 1], v[ks][j].y * mul[j & 1]);
    }
  }
}

// Where the main loop reads the Q fragments of each k-step from: registers (32 a thread), or shared memory where the
// register budget of kCtasPerSm CTAs an SM has no room for them (kQFragmentsInShared, config.h). Every warp holds
// the same fragments (the 16 rows of (token, KV head) against its own keys), so the shared copy is one a CTA, written
// by warp 0: 16-byte units [k-step][lane], each warp's read of a k-step one conflict-free LDS.128.
template <bool kInShared>
class QFragmentSource;

template <>
class QFragmentSource<false> {
 public:
  __device__ __forceinline__ QFragmentSource(uint8_t* /*shared*/, int /*lane*/) {}
  __device__ __forceinline__ void keep(const uint32_t (&qf)[8][4], int /*warp*/) {
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
#pragma unroll
      for (int j = 0; j < 4; ++j) qf_[ks][j] = qf[ks][j];
    }
  }
  __device__ __forceinline__ void fetch(int ks, uint32_t (&a)[4]) const {
#pragma unroll
    for (int j = 0; j < 4; ++j) a[j] = qf_[ks][j];
  }

 private:
  uint32_t qf_[8][4];
};

template <>
class QFragmentSource<true> {
 public:
  __device__ __forceinline__ QFragmentSource(uint8_t* shared, int lane)
      : units_(reinterpret_cast<uint4*>(shared)), lane_(lane) {}
  // The caller's next __syncthreads makes warp 0's stores visible to every warp.
  __device__ __forceinline__ void keep(const uint32_t (&qf)[8][4], int warp) {
    if (warp != 0) return;
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) units_[ks * 32 + lane_] = make_uint4(qf[ks][0], qf[ks][1], qf[ks][2], qf[ks][3]);
  }
  __device__ __forceinline__ void fetch(int ks, uint32_t (&a)[4]) const {
    const uint4 u = units_[ks * 32 + lane_];
    a[0] = u.x;
    a[1] = u.y;
    a[2] = u.z;
    a[3] = u.w;
  }

 private:
  uint4* units_;
  int lane_;
};

}  // namespace jax_msa::sm80::decode
