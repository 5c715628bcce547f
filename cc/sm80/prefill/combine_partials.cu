// Warp-MMA (sm_80+) prefill: log-sum-exp merge of each query's per-block partials (the plan's query_edge_count of them)
// into the bf16 output and the lse. One half-warp a (token, query head) row, a warp two rows, 8 dims a lane (positions
// 8 sub .. + 7 of the partial rows, sub = lane % 16: natural order, or fragment order when p.partial_fragment_order,
// common/partial_order.h). A row's partials are read with 16-byte streaming loads, 8 of them issued before any is
// used (the kernel is bound by reading the partials once: 4 KB a row for K = 16). Empty rows: 0, -inf.
#include <cuda_runtime.h>

#include "common/partial_order.h"
#include "common/plan_view.h"
#include "sm80/common/register_pack.cuh"
#include "sm80/prefill/config.h"
#include "sm80/prefill/prefill.h"

namespace jax_msa::sm80::prefill {

namespace {

constexpr int kCombineThreads = 128;
constexpr int kRowsPerCombineBlock = kCombineThreads / 16;
constexpr int kRanksInFlight = 8;  // a batch of partial rows loaded before the first is used

// kFragmentOrder: the partial rows are in fragment order (the sm90 kernel's default; the warp-MMA kernels write the
// natural order).
template <bool kFragmentOrder>
__global__ void __launch_bounds__(kCombineThreads) combine_partials_kernel(const PrefillParams p) {
  static_assert(kHeadDim == 16 * 8 && kHeadDim == partial_order::kRowColumns, "16 lanes x 8 dims a row");
  const PlanView plan = PlanView::from(p);
  const int64_t rows = int64_t(p.total_q) * p.num_q_heads;
  const int sub = threadIdx.x & 15;
  const int64_t row = int64_t(blockIdx.x) * kRowsPerCombineBlock + (threadIdx.x >> 4);
  if (row >= rows) return;  // no shuffles below: a half-warp may leave on its own
  const int t = int(row / p.num_q_heads), h = int(row % p.num_q_heads);
  const int group = p.num_q_heads / p.num_kv_heads;
  const int g = h / group, hl = h % group;
  const int count = min(max(plan.partial_count(g, t), 0), p.topk);
  const int64_t first = plan.partial_index(t, g, 0, p.num_kv_heads) * group + hl;  // rank r at first + r * group
  const float* lse_of = p.partial_lse + first;
  const uint4* o_of = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.partial_o) + first * kHeadDim) + sub;
  uint4 raw[kRanksInFlight];
  auto load_batch = [&](int c0) {  // read once: streaming (evict-first) loads
#pragma unroll
    for (int i = 0; i < kRanksInFlight; ++i)
      raw[i] = c0 + i < count ? __ldcs(o_of + int64_t(c0 + i) * group * (kHeadDim / 8)) : make_uint4(0, 0, 0, 0);
  };
  load_batch(0);  // in flight while the lse are read
  // every lane of the half-warp reads all of the row's lse (one broadcast request each) and sums the weights in rank
  // order: the same total in every lane, no shuffle
  float m = -INFINITY;
  for (int r = 0; r < count; ++r) m = fmaxf(m, __ldg(lse_of + int64_t(r) * group));
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  float total = 0.0f;
  if (m != -INFINITY) {
    for (int c0 = 0; c0 < count; c0 += kRanksInFlight) {
      if (c0 > 0) load_batch(c0);
#pragma unroll
      for (int i = 0; i < kRanksInFlight; ++i) {
        if (c0 + i >= count) break;
        const float w = expf(__ldg(lse_of + int64_t(c0 + i) * group) - m);
        total += w;
        const uint32_t words[4] = {raw[i].x, raw[i].y, raw[i].z, raw[i].w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          acc[2 * k] += w * __uint_as_float(words[k] << 16);  // bf16 -> fp32 is a shift
          acc[2 * k + 1] += w * __uint_as_float(words[k] & 0xffff0000u);
        }
      }
    }
  }
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
  if constexpr (kFragmentOrder) {  // positions 8 sub + 2 k, + 1 hold the column pair 8 k past position 8 sub's
    static_assert(partial_order::fragment_column(2) == 8 && partial_order::fragment_column(4) == 16 &&
                  partial_order::fragment_column(6) == 24 && partial_order::fragment_column(1) == 1);
    uint32_t* out_row = reinterpret_cast<uint32_t*>(p.out + row * kHeadDim);
#pragma unroll
    for (int k = 0; k < 4; ++k)
      out_row[partial_order::fragment_column(8 * sub + 2 * k) / 2] = pack_bf16x2(acc[2 * k] * inv, acc[2 * k + 1] * inv);
  } else {
    reinterpret_cast<uint4*>(p.out + row * kHeadDim)[sub] =
        make_uint4(pack_bf16x2(acc[0] * inv, acc[1] * inv), pack_bf16x2(acc[2] * inv, acc[3] * inv),
                   pack_bf16x2(acc[4] * inv, acc[5] * inv), pack_bf16x2(acc[6] * inv, acc[7] * inv));
  }
  if (sub == 0) p.lse[row] = total > 0.0f ? m + logf(total) : -INFINITY;
}

}  // namespace

cudaError_t launch_combine_partials(const PrefillParams& p, cudaStream_t stream) {
  const int64_t rows = int64_t(p.total_q) * p.num_q_heads;
  if (rows == 0) return cudaSuccess;
  const unsigned blocks = unsigned((rows + kRowsPerCombineBlock - 1) / kRowsPerCombineBlock);
  if (p.partial_fragment_order)
    combine_partials_kernel<true><<<blocks, kCombineThreads, 0, stream>>>(p);
  else
    combine_partials_kernel<false><<<blocks, kCombineThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jax_msa::sm80::prefill
