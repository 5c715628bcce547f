// CPU decode: per (token, KV head), the set of valid selected blocks (sorted, duplicates dropped, holes
// and out-of-range ids skipped without a read) is attended block by block and merged by log-sum-exp.
#include <algorithm>
#include <vector>

#include "cpu/block_attention.h"
#include "cpu/handlers.h"
#include "cpu/parallel.h"

namespace jax_msa::cpu {

void decode(const DecodeParams& p) {
  const int D = p.head_dim, Hkv = p.num_kv_heads, G = p.num_q_heads / p.num_kv_heads, K = p.topk;
  const KvPageReader reader{p.kv_cache, p.kv_format, Hkv, D};
  const int64_t tokens = int64_t(p.batch) * p.q_len;

  parallel_for(tokens * Hkv, 1, [&](int64_t tg) {
    const int t = int(tg / Hkv), g = int(tg % Hkv);
    const int b = t / p.q_len;
    const int scale_entry = b / p.requests_per_scale;  // 0 but under jax.vmap's fold of per-layer scales
    const float q_scale = p.q_scale[scale_entry], k_scale = p.k_scale[scale_entry], v_scale = p.v_scale[scale_entry];
    const int seq_len = p.seq_lens[b];
    const int pos = seq_len - p.q_len + t % p.q_len;
    const int n_blocks = std::min((seq_len + kPageSize - 1) / kPageSize, p.max_blocks);
    std::vector<int> ids;
    const int32_t* row = p.topk_ids + (int64_t(g) * tokens + t) * K;
    for (int k = 0; k < K; ++k) {
      const int id = row[k];
      if (id >= 0 && id < n_blocks && pos >= 0 && id <= pos / kPageSize) ids.push_back(id);
    }
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());

    std::vector<LseMerger> merge(static_cast<size_t>(G), LseMerger(D));
    std::vector<float> qs(static_cast<size_t>(G) * D), o(static_cast<size_t>(D)), scores(static_cast<size_t>(kPageSize));
    for (int h = 0; h < G; ++h)
      load_query(p.q, p.q_is_fp8, q_scale, int64_t(t) * p.num_q_heads + g * G + h, D, &qs[size_t(h) * D]);
    BlockKV kv;
    for (int id : ids) {
      const int64_t page = p.block_table[int64_t(b) * p.max_blocks + id];
      if (page < 0 || page >= p.num_pages) continue;
      const int n_keys = std::min(kPageSize, seq_len - id * kPageSize);
      kv.load(reader, page, g, n_keys, k_scale, v_scale);
      const int visible = std::min(n_keys, pos - id * kPageSize + 1);
      for (int h = 0; h < G; ++h) {
        const float lse = attend_block(&qs[size_t(h) * D], kv, visible, D, p.softmax_scale, o.data(), scores.data());
        merge[h].add(o.data(), lse, D);
      }
    }
    for (int h = 0; h < G; ++h) {
      const int64_t r = int64_t(t) * p.num_q_heads + g * G + h;
      p.lse[r] = merge[h].finish(&p.out[r * D], D);
    }
  });
}

}  // namespace jax_msa::cpu
