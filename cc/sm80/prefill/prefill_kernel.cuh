// Warp-MMA (sm_80+) sparse prefill kernel: one plan work item a CTA, two CTAs an SM on sm_90 / sm_100 (see config.h).
// Writes one normalized partial and its lse per (query, selected block); combine_partials.cu merges them. Reads the
// plan only through PlanView.
#pragma once
#include <cuda_bf16.h>

#include <cute/arch/copy_sm80.hpp>

#include "common/params.h"
#include "sm80/common/online_softmax.cuh"
#include "sm80/common/warp_mma.cuh"
#include "common/plan_view.h"
#include "cuda/prefill_work_item.cuh"
#include "sm80/common/register_pack.cuh"
#include "sm80/decode/chunk_io.cuh"
#include "sm80/prefill/config.h"

namespace jax_msa::sm80::prefill {

using cuda::gather_tile_queries;
using cuda::ItemView;
using cuda::tile_visible_keys;
using cuda::TileQueries;
using decode::ChunkIO;
using decode::ChunkRef;
using decode::kBf16RowBytes;
using decode::swizzled_offset;

static_assert(kTileRows == cuda::kMaxTileRows, "one query tile = one plan work item of <= 128 rows");

// Gathers the tile's query rows (row R = i * G + h: token s_query[i], head g * G + h) into the swizzled bf16 query
// tile; rows past the tile are zero. bf16 q: cp.async (the caller fences and waits); FP8 q: the raw e4m3 values,
// exact in bf16 (q_scale is folded into the softmax scale), through registers.
__device__ __forceinline__ void load_query_tile(uint8_t* q_tile, const PrefillParams& p, const int* s_query, int count,
                                                int group, int g) {
  constexpr int kUnits = kTileRows * kHeadDim * 2 / 16;  // 16-byte units of the tile
#pragma unroll
  for (int i = 0; i < kUnits / kThreads; ++i) {
    const int u = i * kThreads + threadIdx.x;
    const int row = u >> 4, unit = u & 15;
    const int qi = row / group;
    const bool valid = qi < count;
    const int64_t elem = valid ? (int64_t(s_query[qi]) * p.num_q_heads + g * group + row % group) * kHeadDim + unit * 8
                               : 0;
    uint8_t* dst = q_tile + swizzled_offset(row, unit);
    if (p.q_is_fp8) {
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (valid) {
        const uint2 raw = *reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(p.q) + elem);
        const uint32_t w[2] = {raw.x, raw.y};
        uint32_t o[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t b = w[j >> 1] >> (16 * (j & 1));
          o[j] = pack_bf16x2(e4m3_to_float(uint8_t(b)), e4m3_to_float(uint8_t(b >> 8)));
        }
        v = make_uint4(o[0], o[1], o[2], o[3]);
      }
      *reinterpret_cast<uint4*>(dst) = v;
    } else {
      decode::cp_async_16(dst, static_cast<const uint16_t*>(p.q) + elem, valid);
    }
  }
}

// Steps 3 and 4: every warp attends its 16 rows of the query tile (swizzled bf16 in shared memory) over the
// block's bf16 K | V tiles (two 64-key halves) and writes their normalized partials and lse at the plan's slots.
template <KvFormat F>
__device__ __forceinline__ void attend_tile(const PrefillParams& p, const PlanView& plan, const ItemView& v,
                                            const TileQueries& tq, int tile_visible, const uint8_t* kv_tiles,
                                            const uint8_t* q_tile) {
  using Plan = SharedPlan<F>;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int group = v.group, g = v.item.head, count = v.count;
  // ---- 3. per warp: rows R = 16 warp + {lane / 4, lane / 4 + 8}, R = query * G + head
  const int row0 = warp * kRowsPerWarp + (lane >> 2), row1 = row0 + 8;
  const int qi0 = row0 / group, qi1 = row1 / group;
  const bool ok0 = qi0 < count, ok1 = qi1 < count;
  if (!__any_sync(0xffffffffu, ok0 || ok1)) return;  // a warp past the tile's rows has nothing to do
  const int vis[2] = {ok0 ? tq.visible[qi0] : 0, ok1 ? tq.visible[qi1] : 0};
  const int c2 = (lane & 3) * 2;
  // ldmatrix.x4 of the A operand (k16 step ks): lanes 0-15 rows 0-15 at dims 16 ks, lanes 16-31 at 16 ks + 8
  const uint8_t* q_row = q_tile + (warp * kRowsPerWarp + (lane & 15)) * kBf16RowBytes;
  const int q_swz = lane & 7, q_unit_hi = lane >> 4;

  const bool quantized = F != KvFormat::kBf16;
  const float q_scale = p.q_is_fp8 ? *p.q_scale : 1.0f;
  const float k_scale = quantized ? *p.k_scale : 1.0f;
  const float v_scale = quantized ? *p.v_scale : 1.0f;
  const float scale_log2 = p.softmax_scale * q_scale * k_scale * kLog2e;

  float acc[16][4];
#pragma unroll
  for (int i = 0; i < 16; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
  OnlineSoftmax softmax;

  const int n_slices = (tile_visible + kSliceKeys - 1) / kSliceKeys;
  for (int sl = 0; sl < n_slices; ++sl) {
    const int hf = sl >> 1, key_base = (sl & 1) * kSliceKeys;  // slice = keys [key_base, +32) of half hf
    const uint8_t* k_tile = kv_tiles + hf * Plan::kTileHalfBytes;
    const uint8_t* v_tile = k_tile + kBf16TileBytes;
    // S = Q K^T over the slice's 32 keys: 4 n-tiles, two per ldmatrix.x4
    float s[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
      uint32_t qa[4];
      ldsm_x4(q_row + (((2 * ks + q_unit_hi) ^ q_swz) << 4), qa[0], qa[1], qa[2], qa[3]);
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        const int key = key_base + np * 16 + ((lane >> 4) << 3) + (lane & 7);
        uint32_t b00, b01, b10, b11;
        ldsm_x4(k_tile + swizzled_offset(key, 2 * ks + ((lane >> 3) & 1)), b00, b01, b10, b11);
        mma_bf16(s[2 * np], qa, b00, b01);
        mma_bf16(s[2 * np + 1], qa, b10, b11);
      }
    }
    // causal mask (key of the block <= the row's position), log2 units, online softmax
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = sl * kSliceKeys + nt * 8 + c2 + (e & 1);
        s[nt][e] = key < vis[e >> 1] ? s[nt][e] * scale_log2 : -INFINITY;
      }
    }
    float alpha[2];
    if (softmax.update(s, alpha)) rescale_rows(acc, alpha);
    // O += P V over the slice: 2 k-steps of 16 keys x 16 n-tiles of 8 dims
#pragma unroll
    for (int np = 0; np < 2; ++np) {
      const uint32_t pa[4] = {pack_bf16x2(s[2 * np][0], s[2 * np][1]), pack_bf16x2(s[2 * np][2], s[2 * np][3]),
                              pack_bf16x2(s[2 * np + 1][0], s[2 * np + 1][1]),
                              pack_bf16x2(s[2 * np + 1][2], s[2 * np + 1][3])};
      const int key = key_base + np * 16 + (((lane >> 3) & 1) << 3) + (lane & 7);
#pragma unroll
      for (int dn = 0; dn < 16; dn += 2) {
        uint32_t b00, b01, b10, b11;
        ldsm_x4_t(v_tile + swizzled_offset(key, dn + (lane >> 4)), b00, b01, b10, b11);
        mma_bf16(acc[dn], pa, b00, b01);
        mma_bf16(acc[dn + 1], pa, b10, b11);
      }
    }
  }

  // ---- 4. normalized partials at the plan's slots
  softmax.reduce_row_sums();
  const int num_kv = p.num_kv_heads;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const bool ok = r == 0 ? ok0 : ok1;
    if (!ok) continue;
    const int qi = r == 0 ? qi0 : qi1;
    const int head_in_group = (r == 0 ? row0 : row1) % group;
    const int64_t slot = plan.partial_index(tq.query[qi], g, tq.rank[qi], num_kv) * group + head_in_group;
    const bool empty = !(softmax.l[r] > 0.0f);
    const float inv = empty ? 0.0f : v_scale / softmax.l[r];
    uint16_t* dst = static_cast<uint16_t*>(p.partial_o) + slot * kHeadDim + c2;  // bf16 partials
#pragma unroll
    for (int i = 0; i < 16; ++i)
      *reinterpret_cast<uint32_t*>(dst + i * 8) = pack_bf16x2(acc[i][2 * r] * inv, acc[i][2 * r + 1] * inv);
    if ((lane & 3) == 0) p.partial_lse[slot] = empty ? -INFINITY : (softmax.m[r] + log2f(softmax.l[r])) * kLn2;
  }
}

template <KvFormat F>
__global__ void __launch_bounds__(kThreads, register_budget_ctas<F>()) sparse_prefill_kernel(const PrefillParams p) {
  using Plan = SharedPlan<F>;
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ TileQueries s_tq;
  __shared__ uint32_t s_table[F == KvFormat::kNvfp4 ? 256 : 1];

  const PlanView plan = PlanView::from(p);
  if (int(blockIdx.x) >= plan.work_count()) return;  // static-capacity grid: the count is read on device
  const ItemView v = ItemView::make(p, plan, blockIdx.x);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = v.item.head;

  // ---- 1. the tile's queries
  gather_tile_queries(s_tq, p, plan, v);
  if constexpr (F == KvFormat::kNvfp4) ChunkIO<F>::build_table(s_table);
  __syncthreads();
  const int tile_visible = tile_visible_keys(s_tq, v.count);

  // ---- 2. load the block once (warp w: half w / 4, keys 16 (w % 4) ..), dequantize, share; the query tile
  uint8_t* q_tile = smem + Plan::kQueryOffset;
  const int half = warp >> 2, key0 = (warp & 3) * kKeysPerWarp;
  const int half_visible = max(0, min(kChunkKeys, tile_visible - half * kChunkKeys));
  uint8_t* raw_half = smem + Plan::kRawOffset + half * Plan::kRawHalfBytes;
  uint8_t* tile_half = smem + half * Plan::kTileHalfBytes;
  const ChunkRef ref{v.page_ok ? v.page : 0, half, half_visible};
  if (half_visible > 0) ChunkIO<F>::load(raw_half, p.kv_cache, p.num_kv_heads, g, ref, key0, lane);
  if constexpr (F == KvFormat::kBf16) load_query_tile(q_tile, p, s_tq.query, v.count, v.group, g);
  cute::cp_async_fence();
  cute::cp_async_wait<0>();
  if constexpr (F != KvFormat::kBf16) {
    __syncwarp();
    if constexpr (F == KvFormat::kNvfp4) {
      if (half_visible > 0) ChunkIO<F>::dequant(raw_half, tile_half, ref, key0, lane, s_table);
    } else {
      if (half_visible > 0) ChunkIO<F>::dequant(raw_half, tile_half, ref, key0, lane);
    }
    __syncthreads();  // every warp is done with the raw block: the query tile takes its place
    load_query_tile(q_tile, p, s_tq.query, v.count, v.group, g);
    cute::cp_async_fence();
    cute::cp_async_wait<0>();
  }
  __syncthreads();  // every warp reads every key of the block and its rows of the query tile from here on

  attend_tile<F>(p, plan, v, s_tq, tile_visible, smem, q_tile);
}

}  // namespace jax_msa::sm80::prefill
