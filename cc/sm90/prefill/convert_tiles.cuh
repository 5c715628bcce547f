// Hopper (sm_90a) sparse prefill, FP8 and NVFP4 KV: the converter warps' work (warps 1-3 of the producer warpgroup).
// Per item, the block's raw K bytes become the stage's bf16 K tile and its V bytes the V tile, in the 128-byte-swizzled
// layout the wgmma reads. Both conversions are exact: e4m3 -> bf16 by the sm80 decode's bit placement and one bf16x2
// multiply; e2m1 x its e4m3 block scale (at most 6 significant bits, in [2^-10, 2688]) through f16, as the decode's
// register path computes it, then widened to bf16. The per-layer scales are applied by the consumers.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cutlass/arch/barrier.h>

#include "sm80/decode/chunk_io.cuh"
#include "sm90/prefill/config.h"

namespace jax_msa::sm90::prefill {

// One converter lane's share of a row: dims [16 c, +16) as 8 bf16x2 -> the bf16 tile's 16-byte units 2c and 2c + 1
// (column half c / 4, unit (2 c) % 8 (+1), XORed with row % 8). Lanes c >= 4 store their odd unit first: each 8-lane
// phase of a store then covers 8 distinct 16-byte bank groups.
__device__ __forceinline__ void store_row_units(uint8_t* tile, int row, int c, const uint32_t (&o)[8]) {
  const int first = c >> 2;
  uint8_t* dst = tile + (c >> 2) * kColumnHalfBytes + row * 128;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int odd = i ^ first;
    const int unit = ((2 * c) & 7) + odd;
    *reinterpret_cast<uint4*>(dst + ((unit ^ (row & 7)) << 4)) =
        odd ? make_uint4(o[4], o[5], o[6], o[7]) : make_uint4(o[0], o[1], o[2], o[3]);
  }
}

// 16 dims of a row as 8 bf16x2 (registers = dim pairs in order).
template <KvFormat F>
struct RowConverter;

// FP8: the raw tile is 128 rows x 128 e4m3 bytes; lane c takes bytes [16 c, +16).
template <>
struct RowConverter<KvFormat::kFp8> {
  static __device__ __forceinline__ void convert(const uint8_t* raw, int /*kv*/, int row, int c, uint32_t (&o)[8]) {
    using Fp8 = sm80::decode::ChunkIO<KvFormat::kFp8>;
    const uint4 in = *reinterpret_cast<const uint4*>(raw + row * kHeadDim + c * 16);
    const uint32_t w[4] = {in.x, in.y, in.z, in.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      o[2 * j] = Fp8::e4m3x2_to_bf16x2(w[j], false);
      o[2 * j + 1] = Fp8::e4m3x2_to_bf16x2(w[j], true);
    }
  }
};

// NVFP4: the raw tile is the head's cache slot (kv_format.h Nvfp4Slot): 128 rows x 64 data bytes (low nibble = even
// dim), then the e4m3 block scales, K linear (row * 8 + group), V in 4-row quads ((row / 4) * 32 + 4 group + row % 4).
// Lane c takes data bytes [8 c, +8) = scale group c.
template <>
struct RowConverter<KvFormat::kNvfp4> {
  static __device__ __forceinline__ void convert(const uint8_t* raw, int kv, int row, int c, uint32_t (&o)[8]) {
    constexpr Nvfp4Slot kSlot{kHeadDim};
    const uint2 in = *reinterpret_cast<const uint2*>(raw + row * kSlot.data_bytes_per_token() + c * 8);
    const uint32_t sf_byte = raw[int(kv == 0 ? kSlot.k_scale_offset(row, c) : kSlot.v_scale_offset(row, c))];
    // the scale as f16 times 2^6 (exact), undoing the 2^-6 of the e2m1 placement below
    const uint32_t sf_bits = sm80::decode::e4m3x2_to_f16x2(sf_byte | (sf_byte << 8));
    const __half2 sf2 = __hmul2(*reinterpret_cast<const __half2*>(&sf_bits), __floats2half2_rn(64.0f, 64.0f));
    const uint32_t w[2] = {in.x, in.y};
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      uint32_t v[4];
      sm80::decode::e2m1x8_to_f16x8(w[j], v);  // values x 2^-6
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const __half2 x = __hmul2(*reinterpret_cast<const __half2*>(&v[b]), sf2);  // exact in f16
        const __nv_bfloat162 y = __float22bfloat162_rn(__half22float2(x));         // exact in bf16
        o[4 * j + b] = *reinterpret_cast<const uint32_t*>(&y);
      }
    }
  }
};

// Rows [0, 128) of one raw tile -> the bf16 tile; rows >= n_valid are written as zeros (their bytes, NVFP4 scales
// included, may hold anything). Each warp takes 4 rows a step: lane = 8 (row % 4) + c converts dims [16 c, +16).
template <KvFormat F>
__device__ __forceinline__ void convert_rows(const uint8_t* raw, uint8_t* tile, int kv, int n_valid, int converter_warp,
                                             int lane) {
  const int c = lane & 7;
  for (int step = converter_warp; step < kBlockKeys / 4; step += kConverterWarps) {
    const int row = step * 4 + (lane >> 3);
    uint32_t o[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
    if (row < n_valid) RowConverter<F>::convert(raw, kv, row, c, o);
    store_row_units(tile, row, c, o);
  }
}

// Per item (k-th of this CTA, stage k % kStages): K once its raw bytes landed and the stage's Q|K is free, then V once
// its raw bytes landed and the stage's V is free. A buffer the producer did not load (raw_load 0: nobody sees the
// block, or the stage already holds it) converts nothing and leaves the stage's tile as it is. Each converted tile is
// fenced for the async proxy (the consumers' wgmma), announced on the stage's full barrier, and its raw buffer handed
// back to the producer.
template <KvFormat F>
__device__ __forceinline__ void convert_items(SharedStorage& s, RawStorage<F>& f, ItemRange items, int converter_warp) {
  using cutlass::arch::ClusterBarrier;
  const int lane = threadIdx.x & 31;
  int k = 0;
  for (int w = items.begin; w < items.end; ++w, ++k) {
    const int st = k % kStages;
    const uint32_t phase = (k / kStages) & 1;
    SharedStorage::Stage& sg = s.stage[st];
#pragma unroll
    for (int kv = 0; kv < 2; ++kv) {
      ClusterBarrier::wait(&f.raw_full[kv], k & 1);
      const bool load = f.raw_load[kv] != 0;
      // FP8 K rows past the request are converted, then masked; NVFP4 writes them as zeros (their scales may be NaN)
      const int n_valid = kv == 0 && F == KvFormat::kFp8 ? kBlockKeys : f.raw_n_keys[kv];
      ClusterBarrier::wait(kv == 0 ? &s.qk_empty[st] : &s.v_empty[st], phase ^ 1);
      if (load) convert_rows<F>(f.raw[kv], kv == 0 ? sg.k : sg.v, kv, n_valid, converter_warp, lane);
      cutlass::arch::fence_view_async_shared();  // generic-proxy writes before the consumers' wgmma reads them
      __syncwarp();
      if (lane == 0) {
        ClusterBarrier::arrive(kv == 0 ? &s.qk_full[st] : &s.v_full[st]);
        ClusterBarrier::arrive(&f.raw_empty[kv]);
      }
    }
  }
}

}  // namespace jax_msa::sm90::prefill
