// Hopper (sm_90a) sparse prefill: the launch of one kernel instantiation (persistent: one CTA an SM, at most one per
// work item). Included by the per-format translation units.
#pragma once
#include "cuda/launch_config.h"
#include "sm90/prefill/prefill_kernel.cuh"

namespace jax_msa::sm90::prefill {

template <KvFormat F>
cudaError_t launch_sparse_prefill(const TmaPrefillArgs& args, cudaStream_t stream) {
  if (cudaError_t e = cuda::ensure_dynamic_smem<sparse_prefill_wgmma_kernel<F>>(kSmemBytes<F>); e != cudaSuccess)
    return e;
  int sms = 0;
  if (cudaError_t e = cuda::current_sm_count(&sms); e != cudaSuccess) return e;
  const int grid = min(args.p.work_capacity, sms);
  if (grid > 0) sparse_prefill_wgmma_kernel<F><<<unsigned(grid), kThreads, kSmemBytes<F>, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace jax_msa::sm90::prefill
