// Log-sum-exp merge of a row's split-K partials: the one definition of its arithmetic, shared by the combine
// kernel (combine_splits.cu: partials in global memory) and the cluster merge (cluster_merge.cuh: partials in the
// cluster's shared memory), so that both paths give bit-identical outputs.
//
// Split s of a row holds o_s (the split's normalized output) and lse_s (natural log; -inf when it saw no key).
// With m = max_s lse_s and w_s = exp(lse_s - m):  out = (sum_s w_s o_s) / (sum_s w_s),  lse = m + log(sum_s w_s),
// the sums taken in split order. A row no split saw gives out = 0 and lse = -inf.
#pragma once
#include <cmath>

namespace jax_msa::sm80::decode {

// w_s for a row whose largest partial lse is m (0 when every split of the row was empty).
__device__ __forceinline__ float split_weight(float lse_s, float m) { return m == -INFINITY ? 0.0f : expf(lse_s - m); }

// Running sums of one row's 4 dims; add() must be called in split order.
struct SplitMergeAccumulator {
  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  float total = 0.0f;

  __device__ __forceinline__ void add(float w, float4 o) {
    acc.x = fmaf(w, o.x, acc.x);
    acc.y = fmaf(w, o.y, acc.y);
    acc.z = fmaf(w, o.z, acc.z);
    acc.w = fmaf(w, o.w, acc.w);
    total += w;
  }
  // The merged output (before the bf16 rounding).
  __device__ __forceinline__ float4 output() const {
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    return make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
  }
  __device__ __forceinline__ float lse(float m) const { return total > 0.0f ? m + logf(total) : -INFINITY; }
};

}  // namespace jax_msa::sm80::decode
