// Hopper (sm_90a) sparse prefill: the launch of one format's kernel (persistent: one CTA an SM, at most one per work
// item), in the partial column order the host chose. Included by the per-format translation units.
#pragma once
#include "cuda/launch_config.h"
#include "sm90/prefill/prefill_kernel.cuh"

namespace jax_msa::sm90::prefill {

template <KvFormat F, bool kFragmentOrder>
cudaError_t launch_sparse_prefill_order(const TmaPrefillArgs& args, cudaStream_t stream) {
  if (cudaError_t e = cuda::ensure_dynamic_smem<sparse_prefill_wgmma_kernel<F, kFragmentOrder>>(kSmemBytes<F>);
      e != cudaSuccess)
    return e;
  int sms = 0;
  if (cudaError_t e = cuda::current_sm_count(&sms); e != cudaSuccess) return e;
  const int grid = min(args.p.work_capacity, sms);
  if (grid > 0)
    sparse_prefill_wgmma_kernel<F, kFragmentOrder><<<unsigned(grid), kThreads, kSmemBytes<F>, stream>>>(args);
  return cudaGetLastError();
}

// The partial rows' column order follows args.p.partial_fragment_order (the combine reads them the same way).
template <KvFormat F>
cudaError_t launch_sparse_prefill(const TmaPrefillArgs& args, cudaStream_t stream) {
  return args.p.partial_fragment_order ? launch_sparse_prefill_order<F, true>(args, stream)
                                       : launch_sparse_prefill_order<F, false>(args, stream);
}

}  // namespace jax_msa::sm90::prefill
