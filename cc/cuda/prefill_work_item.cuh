// One work item of the KV-block-major prefill plan as every prefill kernel sees it (warp-MMA and tcgen05 alike): the
// item and its block (ItemView), the tile's queries with their partial slots and causal visibility (TileQueries).
// Reads the plan only through PlanView.
#pragma once
#include <cstdint>

#include "common/kv_format.h"
#include "common/params.h"
#include "common/plan_view.h"

namespace jax_msa::cuda {

constexpr int kMaxTileRows = 128;  // MMA rows of a tile: queries_per_tile * G <= 128 (G = 1 packs 128 queries)

// The tile's queries (<= 128 / G tokens that selected the block): token, partial slot (rank), and how many keys of
// the block each one sees (causal).
struct TileQueries {
  int query[kMaxTileRows], rank[kMaxTileRows], visible[kMaxTileRows];
};

// An item's block entries (the request's length, the page), loaded but not yet used: ItemView::make in two steps, so
// that a producer can keep them in flight while it waits for a stage.
struct ItemLoads {
  WorkItem item;
  int seq_len, page;  // (kept as loaded: widening the page would wait for it)
};

// One work item of the plan and the block it names.
struct ItemView {
  WorkItem item;
  int group, count, block_key0, n_keys;
  int64_t page;
  bool page_ok;

  // The tile's queries: the item's edges, at most kMaxTileRows / G.
  static __device__ __forceinline__ int tile_count(const WorkItem& item, int group) {
    return min(item.edge_count, kMaxTileRows / group);
  }

  static __device__ __forceinline__ ItemLoads load(const PrefillParams& p, const WorkItem& item) {
    return ItemLoads{item, p.seq_lens[item.request], p.block_table[int64_t(item.request) * p.max_blocks + item.block]};
  }

  static __device__ __forceinline__ ItemView from(const PrefillParams& p, const ItemLoads& l) {
    ItemView v;
    v.item = l.item;
    v.group = p.num_q_heads / p.num_kv_heads;
    v.count = tile_count(v.item, v.group);
    v.block_key0 = v.item.block * kPageSize;
    v.n_keys = max(0, min(kPageSize, l.seq_len - v.block_key0));
    v.page = l.page;  // int32 -> int64
    v.page_ok = v.page >= 0 && v.page < p.num_pages;
    return v;
  }

  static __device__ __forceinline__ ItemView make(const PrefillParams& p, const PlanView& plan, int w) {
    return from(p, load(p, plan.item(w)));
  }
};

// Step 1 (threads < count; the caller synchronizes before tq is read).
__device__ __forceinline__ void gather_tile_queries(TileQueries& tq, const PrefillParams& p, const PlanView& plan,
                                                    const ItemView& v) {
  if (threadIdx.x < v.count) {
    const int e = v.item.edge_begin + threadIdx.x;
    const int t = plan.query(v.item.head, e);
    tq.query[threadIdx.x] = t;
    tq.rank[threadIdx.x] = plan.rank(v.item.head, e);
    const int pos = query_position(p.cu_seqlens_q, p.seq_lens, v.item.request, t);
    tq.visible[threadIdx.x] = v.page_ok ? max(0, min(v.n_keys, pos - v.block_key0 + 1)) : 0;
  }
}

// Keys any query of the tile sees: the loads stop there (zero-filled beyond).
__device__ __forceinline__ int tile_visible_keys(const TileQueries& tq, int count) {
  int visible = 0;
  for (int i = 0; i < count; ++i) visible = max(visible, tq.visible[i]);
  return visible;
}

}  // namespace jax_msa::cuda
