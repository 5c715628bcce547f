// Definition of launch_sparse_prefill<F> (tcgen05); included by exactly one prefill_<format>.cu each.
#pragma once
#include "cuda/launch_config.h"
#include "sm100/prefill/prefill.h"
#include "sm100/prefill/prefill_kernel.cuh"

namespace jax_msa::sm100::prefill {

template <KvFormat F>
cudaError_t launch_sparse_prefill(const PrefillParams& p, cudaStream_t stream) {
  constexpr int kSmem = SharedPlan::kBytes;
  if (cudaError_t e = cuda::ensure_dynamic_smem<sparse_prefill_tcgen05_kernel<F>>(kSmem); e != cudaSuccess) return e;
  if (p.work_capacity > 0) sparse_prefill_tcgen05_kernel<F><<<unsigned(p.work_capacity), kThreads, kSmem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jax_msa::sm100::prefill
