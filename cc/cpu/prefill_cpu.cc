// CPU prefill: the same two phases as the GPU kernel. Phase 1 walks the plan's work list (one KV block,
// several queries each) and writes a normalized partial and its lse per (query, block); phase 2 merges
// each query's partials by log-sum-exp.
#include <vector>

#include "common/plan_view.h"
#include "cpu/block_attention.h"
#include "cpu/handlers.h"
#include "cpu/parallel.h"

namespace jax_msa::cpu {

void prefill(const PrefillParams& p) {
  const PlanView plan = PlanView::from(p);
  const int D = p.head_dim, Hkv = p.num_kv_heads, G = p.num_q_heads / p.num_kv_heads;
  const KvPageReader reader{p.kv_cache, p.kv_format, Hkv, D};
  const float q_scale = *p.q_scale, k_scale = *p.k_scale, v_scale = *p.v_scale;
  float* partial_o = static_cast<float*>(p.partial_o);  // fp32 here (the FFI handler checks)

  parallel_for(plan.work_count(), 4, [&](int64_t w) {
    const WorkItem it = plan.item(int(w));
    if (it.edge_count <= 0 || it.request < 0 || it.request >= p.batch) return;
    const int64_t page = p.block_table[int64_t(it.request) * p.max_blocks + it.block];
    const bool page_ok = page >= 0 && page < p.num_pages;
    const int n_keys = std::clamp(p.seq_lens[it.request] - it.block * kPageSize, 0, kPageSize);
    BlockKV kv;
    if (page_ok) kv.load(reader, page, it.head, n_keys, k_scale, v_scale);
    std::vector<float> qh(static_cast<size_t>(D)), scores(static_cast<size_t>(kPageSize));
    for (int e = it.edge_begin; e < it.edge_begin + it.edge_count; ++e) {
      const int t = plan.query(it.head, e);
      const int r = plan.rank(it.head, e);
      if (t < 0 || t >= p.total_q || r < 0 || r >= p.topk) continue;
      const int pos = query_position(p.cu_seqlens_q, p.seq_lens, it.request, t);
      const int visible = page_ok ? std::min(n_keys, pos - it.block * kPageSize + 1) : 0;
      const int64_t slot = plan.partial_index(t, it.head, r, Hkv) * G;
      for (int h = 0; h < G; ++h) {
        load_query(p.q, p.q_is_fp8, q_scale, int64_t(t) * p.num_q_heads + it.head * G + h, D, qh.data());
        p.partial_lse[slot + h] =
            attend_block(qh.data(), kv, visible, D, p.softmax_scale, &partial_o[(slot + h) * D], scores.data());
      }
    }
  });

  parallel_for(p.total_q, 16, [&](int64_t t) {
    for (int g = 0; g < Hkv; ++g) {
      const int count = std::clamp(plan.partial_count(g, int(t)), 0, p.topk);
      for (int h = 0; h < G; ++h) {
        LseMerger merge(D);
        for (int r = 0; r < count; ++r) {
          const int64_t slot = plan.partial_index(int(t), g, r, Hkv) * G + h;
          merge.add(&partial_o[slot * D], p.partial_lse[slot], D);
        }
        const int64_t row = t * p.num_q_heads + g * G + h;
        p.lse[row] = merge.finish(&p.out[row * D], D);
      }
    }
  });
}

}  // namespace jax_msa::cpu
