// Hopper (sm_90a) sparse prefill, FP8 KV: the converter warps' work (warps 1-3 of the producer warpgroup). Per item,
// the block's raw e4m3 K rows become the stage's bf16 K tile and its V rows the V tile (rows past the request as
// zeros), in the 128-byte-swizzled layout the wgmma reads. e4m3 -> bf16 is exact (sm80 decode's bit placement and one
// bf16x2 multiply); the scales are applied by the consumers.
#pragma once
#include <cutlass/arch/barrier.h>

#include "sm80/decode/chunk_io.cuh"
#include "sm90/prefill/config.h"

namespace jax_msa::sm90::prefill {

// Rows [0, 128) of one raw tile (row r at raw + 128 r) -> the bf16 tile; rows >= n_valid are written as zeros. Each
// warp takes 4 rows a step: lane = 8 (row % 4) + c converts bytes [16 c, +16) = dims [16 c, +16) = the bf16 tile's
// 16-byte units 2c and 2c + 1 (column half c / 4, unit (2 c) % 8 (+1), XORed with row % 8).
__device__ __forceinline__ void convert_fp8_rows(const uint8_t* raw, uint8_t* tile, int n_valid, int converter_warp,
                                                 int lane) {
  using Fp8 = sm80::decode::ChunkIO<KvFormat::kFp8>;
  const int c = lane & 7;
  // Lanes c >= 4 store their odd unit first: each 8-lane phase of a store then covers 8 distinct 16-byte bank groups.
  const int first = c >> 2;
  for (int step = converter_warp; step < kBlockKeys / 4; step += kConverterWarps) {
    const int row = step * 4 + (lane >> 3);
    uint32_t o[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
    if (row < n_valid) {
      const uint4 in = *reinterpret_cast<const uint4*>(raw + row * kHeadDim + c * 16);
      const uint32_t w[4] = {in.x, in.y, in.z, in.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        o[2 * j] = Fp8::e4m3x2_to_bf16x2(w[j], false);
        o[2 * j + 1] = Fp8::e4m3x2_to_bf16x2(w[j], true);
      }
    }
    uint8_t* dst = tile + (c >> 2) * kColumnHalfBytes + row * 128;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int odd = i ^ first;
      const int unit = ((2 * c) & 7) + odd;
      *reinterpret_cast<uint4*>(dst + ((unit ^ (row & 7)) << 4)) =
          odd ? make_uint4(o[4], o[5], o[6], o[7]) : make_uint4(o[0], o[1], o[2], o[3]);
    }
  }
}

// Per item (k-th of this CTA, stage k % kStages): K once its raw bytes landed and the stage's Q|K is free, then V once
// its raw bytes landed and the stage's V is free. Each converted tile is fenced for the async proxy (the consumers'
// wgmma), announced on the stage's full barrier, and its raw buffer handed back to the producer.
__device__ __forceinline__ void convert_items(SharedStorage& s, Fp8Storage& f, int n_items, int converter_warp) {
  using cutlass::arch::ClusterBarrier;
  const int lane = threadIdx.x & 31;
  int k = 0;
  for (int w = blockIdx.x; w < n_items; w += gridDim.x, ++k) {
    const int st = k % kStages;
    const uint32_t phase = (k / kStages) & 1;
    SharedStorage::Stage& sg = s.stage[st];
#pragma unroll
    for (int kv = 0; kv < 2; ++kv) {
      ClusterBarrier::wait(&f.raw_full[kv], k & 1);
      const bool load = f.raw_load[kv] != 0;
      const int n_valid = kv == 0 ? kBlockKeys : f.raw_n_keys;  // (K rows past the request are converted, then masked)
      ClusterBarrier::wait(kv == 0 ? &s.qk_empty[st] : &s.v_empty[st], phase ^ 1);
      if (load) convert_fp8_rows(f.raw[kv], kv == 0 ? sg.k : sg.v, n_valid, converter_warp, lane);
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
