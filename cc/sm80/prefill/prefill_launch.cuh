// Definition of launch_sparse_prefill<F>; included by exactly one prefill_<format>.cu each.
#pragma once
#include "cuda/launch_config.h"
#include "sm80/prefill/prefill.h"
#include "sm80/prefill/prefill_kernel.cuh"

namespace jax_msa::sm80::prefill {

template <KvFormat F>
cudaError_t launch_sparse_prefill(const PrefillParams& p, cudaStream_t stream) {
  constexpr int kSmem = SharedPlan<F>::kBytes;
  auto kernel = sparse_prefill_kernel<F>;
  if (cudaError_t e = cuda::ensure_dynamic_smem<sparse_prefill_kernel<F>>(kSmem); e != cudaSuccess) return e;
  if (p.work_capacity > 0) kernel<<<unsigned(p.work_capacity), kThreads, kSmem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jax_msa::sm80::prefill
