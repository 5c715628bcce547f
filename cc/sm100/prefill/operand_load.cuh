// tcgen05 (sm_100a) prefill, UNVERIFIED: the block's K and V and the gathered query tile as bf16, 16-byte units (8
// consecutive elements of one row) at a time, from the paged cache (sm100/common/kv_unit.cuh) and q into the UMMA
// shared-memory layouts of config.h (q_scale folds into the softmax scale).
#pragma once
#include <cstdint>

#include "common/kv_format.h"
#include "common/numeric.h"
#include "common/params.h"
#include "cuda/prefill_work_item.cuh"
#include "cuda/shared_memory.cuh"
#include "sm100/common/kv_unit.cuh"
#include "sm100/prefill/config.h"

namespace jax_msa::sm100::prefill {

// K into sK (row = key, K-major) and V into sV (MN-major: dims of one key contiguous); keys >= visible (the most any
// query of the tile sees) are zero, and nothing is read for them.
template <KvFormat F, class TensorK, class TensorV>
__device__ __forceinline__ void load_block(TensorK& sK, TensorV& sV, const PrefillParams& p, const cuda::ItemView& v,
                                           int visible) {
  const int g = v.item.head;
  constexpr int kUnits = kBlockKeys * kUnitsPerRow;  // per operand
#pragma unroll 4
  for (int i = threadIdx.x; i < 2 * kUnits; i += kThreads) {
    const int kv = i / kUnits, key = (i % kUnits) / kUnitsPerRow, u = i % kUnitsPerRow;
    const uint4 val = key < visible ? load_kv_unit<F>(p.kv_cache, p.num_kv_heads, v.page, g, key, kv, u)
                                    : make_uint4(0u, 0u, 0u, 0u);
    const int d = 8 * u;
    if (kv == 0) cuda::store_shared_16(&sK(cute::make_coord(cute::make_coord(key, d % 16), 0, d / 16)), val);
    else cuda::store_shared_16(&sV(cute::make_coord(cute::make_coord(d, key % 16), 0, key / 16)), val);
  }
}

// The tile's query rows R = i * G + h (token tq.query[i], head g * G + h) into sQ; rows past the tile are zero.
template <class TensorQ>
__device__ __forceinline__ void load_query_tile(TensorQ& sQ, const PrefillParams& p, const cuda::TileQueries& tq,
                                                int count, int group, int g) {
  constexpr int kUnits = kTileRows * kUnitsPerRow;
#pragma unroll 4
  for (int i = threadIdx.x; i < kUnits; i += kThreads) {
    const int row = i / kUnitsPerRow, u = i % kUnitsPerRow, qi = row / group;
    uint4 val = make_uint4(0u, 0u, 0u, 0u);
    if (qi < count) {
      const int64_t elem = (int64_t(tq.query[qi]) * p.num_q_heads + g * group + row % group) * kHeadDim + 8 * u;
      val = p.q_is_fp8 ? e4m3x8_to_bf16x8(*reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(p.q) + elem))
                       : *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.q) + elem);
    }
    const int d = 8 * u;
    cuda::store_shared_16(&sQ(cute::make_coord(cute::make_coord(row, d % 16), 0, d / 16)), val);
  }
}

}  // namespace jax_msa::sm100::prefill
