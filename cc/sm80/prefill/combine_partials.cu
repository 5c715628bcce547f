// Warp-MMA (sm_80+) prefill: log-sum-exp merge of each query's per-block partials (the plan's query_edge_count of them)
// into the bf16 output and the lse. One warp a (token, query head) row, 4 dims a lane (positions 4 lane .. + 3 of the
// partial rows: natural order, or fragment order when p.partial_fragment_order, common/partial_order.h). Empty rows:
// 0, -inf.
#include <cuda_runtime.h>

#include "common/partial_order.h"
#include "common/plan_view.h"
#include "sm80/common/register_pack.cuh"
#include "sm80/prefill/config.h"
#include "sm80/prefill/prefill.h"

namespace jax_msa::sm80::prefill {

namespace {

// kFragmentOrder: the partial rows are in fragment order (the sm90 kernel's default; the warp-MMA kernels write the
// natural order).
template <bool kFragmentOrder>
__global__ void __launch_bounds__(128) combine_partials_kernel(const PrefillParams p) {
  const PlanView plan = PlanView::from(p);
  const int64_t rows = int64_t(p.total_q) * p.num_q_heads;
  const int64_t row = int64_t(blockIdx.x) * 4 + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const int t = int(row / p.num_q_heads), h = int(row % p.num_q_heads);
  const int group = p.num_q_heads / p.num_kv_heads;
  const int g = h / group, hl = h % group;
  const int count = min(max(plan.partial_count(g, t), 0), p.topk);
  const int64_t first = plan.partial_index(t, g, 0, p.num_kv_heads) * group + hl;  // rank r at first + r * group
  // lane r holds partial c0 + r's lse and weight; the partials' O are summed in rank order (deterministic)
  float m = -INFINITY;
  for (int r = lane; r < count; r += 32) m = fmaxf(m, p.partial_lse[first + int64_t(r) * group]);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float total = 0.0f;
  if (m != -INFINITY) {
    for (int c0 = 0; c0 < count; c0 += 32) {
      const int r = c0 + lane;
      const float w = r < count ? expf(p.partial_lse[first + int64_t(r) * group] - m) : 0.0f;
      total += w;
      const int n = min(32, count - c0);
#pragma unroll 4
      for (int j = 0; j < n; ++j) {
        const float wj = __shfl_sync(0xffffffffu, w, j);
        const uint2 raw = reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(p.partial_o) +
                                                         (first + int64_t(c0 + j) * group) * kHeadDim)[lane];
        acc.x += wj * __uint_as_float(raw.x << 16);  // bf16 -> fp32 is a shift
        acc.y += wj * __uint_as_float(raw.x & 0xffff0000u);
        acc.z += wj * __uint_as_float(raw.y << 16);
        acc.w += wj * __uint_as_float(raw.y & 0xffff0000u);
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) total += __shfl_xor_sync(0xffffffffu, total, off);
  }
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
  if constexpr (kFragmentOrder) {  // positions 4 lane, +1 and 4 lane + 2, +3 hold two column pairs 8 apart
    static_assert(kHeadDim == partial_order::kRowColumns &&
                  partial_order::fragment_column(2) == partial_order::fragment_column(0) + 8);
    uint32_t* out_row = reinterpret_cast<uint32_t*>(p.out + row * kHeadDim);
    out_row[partial_order::fragment_column(4 * lane) / 2] = pack_bf16x2(acc.x * inv, acc.y * inv);
    out_row[partial_order::fragment_column(4 * lane + 2) / 2] = pack_bf16x2(acc.z * inv, acc.w * inv);
  } else {
    reinterpret_cast<uint2*>(p.out + row * kHeadDim)[lane] =
        make_uint2(pack_bf16x2(acc.x * inv, acc.y * inv), pack_bf16x2(acc.z * inv, acc.w * inv));
  }
  if (lane == 0) p.lse[row] = total > 0.0f ? m + logf(total) : -INFINITY;
}

}  // namespace

cudaError_t launch_combine_partials(const PrefillParams& p, cudaStream_t stream) {
  const int64_t rows = int64_t(p.total_q) * p.num_q_heads;
  if (rows == 0) return cudaSuccess;
  if (p.partial_fragment_order)
    combine_partials_kernel<true><<<unsigned((rows + 3) / 4), 128, 0, stream>>>(p);
  else
    combine_partials_kernel<false><<<unsigned((rows + 3) / 4), 128, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jax_msa::sm80::prefill
