// SM90 decode: moving one 64-key chunk of K and V from the paged cache into shared memory (cp.async,
// zero-filled past the visible keys) and, for FP8 / NVFP4, dequantizing it into the swizzled bf16 tile
// that the MMA warps read with ldmatrix. Scales: FP8 values are the raw e4m3 numbers (the per-layer
// k_scale / v_scale are folded into the softmax scale and the output); NVFP4 values are e2m1 x e4m3
// block scale, exact in bf16 (the global scales are folded likewise).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cute/arch/copy_sm80.hpp>
#include <cute/numeric/numeric_types.hpp>

#include "common/kv_format.h"
#include "common/numeric.h"
#include "sm90/decode/config.h"

namespace jax_msa::sm90::decode {

// Byte offset of 16-byte unit `unit` (0..15) of row `key` in a swizzled [64][128] bf16 tile: the unit
// index is XORed with key % 8 so that ldmatrix's 8 row addresses hit 8 different bank groups.
__device__ __forceinline__ int swizzled_offset(int key, int unit) { return key * kBf16RowBytes + ((unit ^ (key & 7)) << 4); }

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool pred) {
  cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>::copy(
      *reinterpret_cast<const cute::uint128_t*>(gmem), *reinterpret_cast<cute::uint128_t*>(smem), pred);
}

// One chunk to load: keys [64 * half, 64 * half + 64) of page `page`; keys >= visible are zero-filled.
struct ChunkRef {
  int64_t page;
  int half;
  int visible;  // 1..64 keys of this chunk are attended
};

template <KvFormat F>
struct ChunkIO;

// ---- bf16: K and V rows of 256 B straight into the swizzled tiles ------------------------------------------
template <>
struct ChunkIO<KvFormat::kBf16> {
  static __device__ __forceinline__ void load(uint8_t* stage, const void* cache, int num_kv_heads, int g,
                                              const ChunkRef& c) {
    const uint8_t* base = static_cast<const uint8_t*>(cache) +
                          ((c.page * num_kv_heads + g) * kPageSize + c.half * kChunkKeys) * int64_t(2 * kBf16RowBytes);
#pragma unroll
    for (int i = 0; i < 2 * kChunkKeys * 16 / kThreads; ++i) {  // 2048 units of 16 B
      const int idx = i * kThreads + threadIdx.x;
      const int kv = idx >> 10, key = (idx >> 4) & 63, unit = idx & 15;
      const bool pred = key < c.visible;
      const uint8_t* src = pred ? base + key * (2 * kBf16RowBytes) + kv * kBf16RowBytes + unit * 16 : base;
      cp_async_16(stage + kv * kBf16TileBytes + swizzled_offset(key, unit), src, pred);
    }
  }
};

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// ---- FP8 E4M3: raw rows of 128 B, then e4m3 -> f16 (exact) -> f32 -> bf16 (exact) ------------------------
template <>
struct ChunkIO<KvFormat::kFp8> {
  static __device__ __forceinline__ void load(uint8_t* stage, const void* cache, int num_kv_heads, int g,
                                              const ChunkRef& c) {
    const uint8_t* base = static_cast<const uint8_t*>(cache) +
                          ((c.page * num_kv_heads + g) * kPageSize + c.half * kChunkKeys) * int64_t(2 * kHeadDim);
#pragma unroll
    for (int i = 0; i < 2 * kChunkKeys * 8 / kThreads; ++i) {  // 1024 units of 16 B
      const int idx = i * kThreads + threadIdx.x;
      const int kv = idx >> 9, key = (idx >> 3) & 63, unit = idx & 7;
      const bool pred = key < c.visible;
      const uint8_t* src = pred ? base + key * (2 * kHeadDim) + kv * kHeadDim + unit * 16 : base;
      cp_async_16(stage + kv * (kChunkKeys * kHeadDim) + key * kHeadDim + unit * 16, src, pred);
    }
  }

  static __device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint16_t two) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two), __NV_E4M3);
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
    return pack_bf16x2(f.x, f.y);
  }

  static __device__ __forceinline__ void dequant(const uint8_t* stage, uint8_t* tile, const ChunkRef&) {
#pragma unroll
    for (int i = 0; i < 2 * kChunkKeys * 8 / kThreads; ++i) {
      const int idx = i * kThreads + threadIdx.x;
      const int kv = idx >> 9, key = (idx >> 3) & 63, unit = idx & 7;
      const uint4 raw = *reinterpret_cast<const uint4*>(stage + kv * (kChunkKeys * kHeadDim) + key * kHeadDim + unit * 16);
      const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
      uint32_t o[8];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        o[2 * j] = e4m3x2_to_bf16x2(uint16_t(w[j] & 0xffffu));
        o[2 * j + 1] = e4m3x2_to_bf16x2(uint16_t(w[j] >> 16));
      }
      uint8_t* dst = tile + kv * kBf16TileBytes;
      *reinterpret_cast<uint4*>(dst + swizzled_offset(key, 2 * unit)) = make_uint4(o[0], o[1], o[2], o[3]);
      *reinterpret_cast<uint4*>(dst + swizzled_offset(key, 2 * unit + 1)) = make_uint4(o[4], o[5], o[6], o[7]);
    }
  }
};

// ---- NVFP4: data and scale bytes of the chunk's tokens (both contiguous in the slot), then
//      e2m1 x e4m3 -> bf16 (exact) ------------------------------------------------------------------------
template <>
struct ChunkIO<KvFormat::kNvfp4> {
  using T = FormatTraits<KvFormat::kNvfp4>;
  static constexpr int kHalfBytes = T::kDataBytes + T::kScaleBytes;  // K (or V) part of a stage

  static __device__ __forceinline__ void load(uint8_t* stage, const void* cache, int num_kv_heads, int g,
                                              const ChunkRef& c) {
    const Nvfp4Slot slot{kHeadDim};
    constexpr int kUnits = 2 * kHalfBytes / 16;  // 576
    for (int idx = threadIdx.x; idx < kUnits; idx += kThreads) {
      const int kv = idx / (kHalfBytes / 16);
      const int u = idx % (kHalfBytes / 16);
      const uint8_t* slot_base = static_cast<const uint8_t*>(cache) +
                                 (c.page * 2 * num_kv_heads + 2 * g + kv) * slot.slot_bytes();
      const uint8_t* src;
      bool pred;
      if (u < T::kDataBytes / 16) {  // data: 4 units per token
        const int key = u >> 2;
        pred = key < c.visible;
        src = slot_base + int64_t(c.half * kChunkKeys + key) * (kHeadDim / 2) + (u & 3) * 16;
      } else {  // scales: K linear from t*8, V quads from (t/4)*32; both start at 512 * half
        pred = true;
        src = slot_base + slot.data_bytes() + c.half * T::kScaleBytes + (u - T::kDataBytes / 16) * 16;
      }
      cp_async_16(stage + kv * kHalfBytes + u * 16, pred ? src : slot_base, pred);
    }
  }

  static __device__ __forceinline__ void dequant(const uint8_t* stage, uint8_t* tile, const ChunkRef& c) {
#pragma unroll
    for (int i = 0; i < 2 * kChunkKeys * 4 / kThreads; ++i) {  // 512 units of 16 data bytes = 32 values
      const int idx = i * kThreads + threadIdx.x;
      const int kv = idx >> 8, key = (idx >> 2) & 63, unit = idx & 3;
      const uint8_t* half = stage + kv * kHalfBytes;
      const uint4 raw = *reinterpret_cast<const uint4*>(half + key * (kHeadDim / 2) + unit * 16);
      const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
      const bool live = key < c.visible;  // scale bytes of invisible keys may hold anything (even NaN)
      uint32_t o[16];
#pragma unroll
      for (int grp = 0; grp < 2; ++grp) {
        const int group = 2 * unit + grp;  // 16-value group 0..7
        const int scale_off = kv == 0 ? key * 8 + group : (key >> 2) * 32 + 4 * group + (key & 3);
        const float sf = live ? e4m3_to_float(half[T::kDataBytes + scale_off]) : 0.0f;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const uint32_t word = w[2 * grp + j];
#pragma unroll
          for (int b = 0; b < 4; ++b) {
            const uint8_t byte = uint8_t(word >> (8 * b));
            o[grp * 8 + j * 4 + b] = pack_bf16x2(e2m1_to_float(byte & 0xf) * sf, e2m1_to_float(byte >> 4) * sf);
          }
        }
      }
      uint8_t* dst = tile + kv * kBf16TileBytes;
#pragma unroll
      for (int q = 0; q < 4; ++q)
        *reinterpret_cast<uint4*>(dst + swizzled_offset(key, 4 * unit + q)) =
            make_uint4(o[4 * q], o[4 * q + 1], o[4 * q + 2], o[4 * q + 3]);
    }
  }
};

}  // namespace jax_msa::sm90::decode
