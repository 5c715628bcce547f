// Hopper (sm_90a) sparse prefill, bf16 KV cache and bf16 queries: the one kernel of this translation unit and its
// launch (persistent: one CTA an SM, at most one per work item).
#include "cuda/launch_config.h"
#include "sm90/prefill/prefill_kernel.cuh"

namespace jax_msa::sm90::prefill {

cudaError_t launch_sparse_prefill_bf16(const TmaPrefillArgs& args, cudaStream_t stream) {
  if (cudaError_t e = cuda::ensure_dynamic_smem<sparse_prefill_wgmma_kernel>(kSmemBytes); e != cudaSuccess) return e;
  int sms = 0;
  if (cudaError_t e = cuda::current_sm_count(&sms); e != cudaSuccess) return e;
  const int grid = min(args.p.work_capacity, sms);
  if (grid > 0) sparse_prefill_wgmma_kernel<<<unsigned(grid), kThreads, kSmemBytes, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace jax_msa::sm90::prefill
