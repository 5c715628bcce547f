// The one device-side reader of the KV-block-major prefill plan built by jax_msa/plan.py.
// CPU handlers and CUDA kernels read the plan only through this view, so the layout lives in two
// places: jax_msa/plan.py (writer) and here (reader).
#pragma once
#include <cstdint>

#include "common/host_device.h"
#include "common/params.h"

namespace jax_msa {

struct WorkItem {
  int head;        // KV head g
  int request;     // b
  int block;       // request-local logical block id
  int edge_begin;  // first edge of the tile in the head's CSR arrays
  int edge_count;  // queries in the tile (>= 1 for a valid item)
};

// A work item's entry as stored (4 int32: head, row = b * MB + block, edge_begin, edge_count), not yet decoded: a
// kernel can issue its load early and decode it once it has landed.
struct RawWorkItem {
  int head, row, edge_begin, edge_count;
};

struct PlanView {
  const int32_t* row_ptr;
  const int32_t* edge_query;
  const int32_t* edge_rank;
  const int32_t* query_edge_count;
  const int32_t* work;
  const int32_t* num_work;
  int num_rows;   // R = B * MB
  int num_edges;  // T * K (edge capacity per head)
  int total_q;
  int topk;
  int max_blocks;
  int work_capacity;

  static MSA_HD PlanView from(const PrefillParams& p) {
    return PlanView{p.row_ptr, p.edge_query, p.edge_rank, p.query_edge_count, p.work, p.num_work,
                    p.batch * p.max_blocks, p.total_q * p.topk, p.total_q, p.topk, p.max_blocks,
                    p.work_capacity};
  }

  // Valid work items; clamped to the static capacity so a corrupt count never reads out of bounds.
  MSA_HD int work_count() const {
    const int n = *num_work;
    return n < 0 ? 0 : (n > work_capacity ? work_capacity : n);
  }

  MSA_HD RawWorkItem raw_item(int w) const {
    const int32_t* it = work + 4 * int64_t(w);
    return RawWorkItem{it[0], it[1], it[2], it[3]};
  }
  MSA_HD WorkItem decode(const RawWorkItem& r) const {
    return WorkItem{r.head, r.row / max_blocks, r.row % max_blocks, r.edge_begin, r.edge_count};
  }
  MSA_HD WorkItem item(int w) const { return decode(raw_item(w)); }

  MSA_HD int query(int head, int edge) const { return edge_query[int64_t(head) * num_edges + edge]; }
  MSA_HD int rank(int head, int edge) const { return edge_rank[int64_t(head) * num_edges + edge]; }
  MSA_HD int partial_count(int head, int t) const { return query_edge_count[int64_t(head) * total_q + t]; }

  // Index of the partial (query t, KV head g, slot rank) in the [T, Hkv, K] partial grid.
  MSA_HD int64_t partial_index(int t, int head, int rank_, int num_kv_heads) const {
    return (int64_t(t) * num_kv_heads + head) * topk + rank_;
  }
};

// Causal position of query token t of request b: bottom-right aligned (MSA.md section 2).
MSA_HD int query_position(const int32_t* cu_seqlens_q, const int32_t* seq_lens, int b, int t) {
  const int q_len = cu_seqlens_q[b + 1] - cu_seqlens_q[b];
  return seq_lens[b] - q_len + (t - cu_seqlens_q[b]);
}

// The same position from the request's entries as loaded, seq_len = seq_lens[b] and q_end = cu_seqlens_q[b + 1]
// (cu_seqlens_q[b] cancels out): for a kernel that loads them ahead of their use.
MSA_HD int query_position(int seq_len, int q_end, int t) { return seq_len - q_end + t; }

}  // namespace jax_msa
