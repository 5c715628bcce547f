// Definition of launch_sparse_decode<F>; included by exactly one decode_<format>.cu each.
#pragma once
#include "cuda/env_flag.h"
#include "cuda/launch_config.h"
#include "sm80/decode/cluster_launch.h"
#include "sm80/decode/decode.h"
#include "sm80/decode/decode_kernel.cuh"

namespace jax_msa::sm80::decode {

// num_splits == FormatTraits<F>::kTeamSplits: one CTA a (token, KV head), its teams the splits (config.h, CtaShape).
// The same arithmetic on every GPU and batch size that runs these warp-MMA kernels (not where the opt-in tcgen05
// decode serves the call): the layout (one or two CTAs an SM) follows the batch, the bits do not, so a fixed
// num_splits stays batch-invariant; JAX_MSA_DECODE_CLUSTER_MERGE = 0 (a test switch) sends the splits to the combine
// kernel instead.
template <KvFormat F, CtaLayout L>
cudaError_t launch_teams(const DecodeParams& p, cudaStream_t stream, DecodeMerge counted_as) {
  constexpr int kSmem = SharedPlan<F, L>::kBytes;
  if (cudaError_t e = cuda::ensure_dynamic_smem<sparse_decode_kernel<F, L>>(kSmem); e != cudaSuccess) return e;
  const dim3 grid(1, p.num_kv_heads, p.batch * p.q_len);
  sparse_decode_kernel<F, L><<<grid, CtaShape<F, L>::kThreadsPerCta, kSmem, stream>>>(p, false);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  count_decode_merge(counted_as);
  return cudaSuccess;
}

// The team CTA's layout: where the format has a two-an-SM one (FP8), the (token, KV head) pairs, one team CTA each,
// outnumber the SMs and the GPU's SMs hold two of them (sm_80 / sm_87 / sm_90 / sm_100; not the 100 KB SMs of sm_86
// / sm_89 / sm_120), that one (up to twice the SM count in one wave); else one CTA an SM. Both give the same bits
// (config.h, CtaLayout).
template <KvFormat F>
cudaError_t launch_team_splits(const DecodeParams& p, cudaStream_t stream) {
  if constexpr (FormatTraits<F>::kTwoPerSmTeamStages > 0) {
    constexpr CtaLayout kTwo = CtaLayout::kTeamsTwoPerSm;
    int sms = 0;
    if (cudaError_t e = cuda::current_sm_count(&sms); e != cudaSuccess) return e;
    if (int64_t(p.num_kv_heads) * p.batch * p.q_len > sms) {
      int fit = 0;
      if (cudaError_t e = cuda::resident_ctas_per_sm<sparse_decode_kernel<F, kTwo>>(
              CtaShape<F, kTwo>::kThreadsPerCta, SharedPlan<F, kTwo>::kBytes, &fit);
          e != cudaSuccess)
        return e;
      if (fit >= 2) return launch_teams<F, kTwo>(p, stream, DecodeMerge::kTeamsTwoPerSm);
    }
  }
  return launch_teams<F, CtaLayout::kTeams>(p, stream, DecodeMerge::kTeams);
}

template <KvFormat F>
cudaError_t launch_sparse_decode(const DecodeParams& p, cudaStream_t stream) {
  if constexpr (FormatTraits<F>::kTeamSplits > 1) {
    if (p.num_splits == FormatTraits<F>::kTeamSplits && !cuda::env_equals("JAX_MSA_DECODE_CLUSTER_MERGE", "0"))
      return launch_team_splits<F>(p, stream);
  }
  // 3 splits as the three teams of one CTA (the rule's NVFP4 factor at 89-132 pairs on 132 SMs)
  if constexpr (FormatTraits<F>::kThreeTeamStages > 0) {
    if (p.num_splits == 3 && !cuda::env_equals("JAX_MSA_DECODE_CLUSTER_MERGE", "0"))
      return launch_teams<F, CtaLayout::kThreeTeams>(p, stream, DecodeMerge::kTeams);
  }
  constexpr int kSmem = SharedPlan<F>::kBytes;
  auto kernel = sparse_decode_kernel<F, CtaLayout::kOneTeam>;
  if (cudaError_t e = cuda::ensure_dynamic_smem<sparse_decode_kernel<F, CtaLayout::kOneTeam>>(kSmem); e != cudaSuccess)
    return e;
  const int splits = p.num_splits > 1 ? p.num_splits : 1;
  const dim3 grid(splits, p.num_kv_heads, p.batch * p.q_len);
  if (splits > 1 && use_cluster_merge(reinterpret_cast<const void*>(kernel), splits, kThreads, kSmem)) {
    // the splits of a (token, KV head) are grid.x: one cluster each, merged on chip (cluster_merge.cuh)
    cudaLaunchAttribute cluster = cluster_dimension(splits);
    cudaLaunchConfig_t config = {};
    config.gridDim = grid;
    config.blockDim = dim3(kThreads);
    config.dynamicSmemBytes = kSmem;
    config.stream = stream;
    config.attrs = &cluster;
    config.numAttrs = 1;
    if (cudaError_t e = cudaLaunchKernelEx(&config, kernel, p, true); e != cudaSuccess) {
      cudaGetLastError();  // the error is returned, not left for the next caller
      return e;
    }
    count_decode_merge(DecodeMerge::kCluster);
    return cudaSuccess;
  }
  kernel<<<grid, kThreads, kSmem, stream>>>(p, false);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (splits == 1) return cudaSuccess;
  if (cudaError_t e = launch_combine_splits(p, stream); e != cudaSuccess) return e;
  count_decode_merge(DecodeMerge::kCombineKernel);
  return cudaSuccess;
}

}  // namespace jax_msa::sm80::decode
