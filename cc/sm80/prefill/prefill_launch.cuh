// Definition of launch_sparse_prefill<F>; included by exactly one prefill_<format>.cu each.
#pragma once
#include <atomic>

#include "sm80/prefill/prefill.h"
#include "sm80/prefill/prefill_kernel.cuh"

namespace jax_msa::sm80::prefill {

template <KvFormat F>
cudaError_t launch_sparse_prefill(const PrefillParams& p, cudaStream_t stream) {
  constexpr int kSmem = SharedPlan<F>::kBytes;
  auto kernel = sparse_prefill_kernel<F>;
  // keyed apart from the decode kernels' flags by the kernel's own static
  static std::atomic<uint64_t> configured{0};
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  const uint64_t bit = uint64_t(1) << (device & 63);
  if (!(configured.load(std::memory_order_acquire) & bit)) {
    if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
        e != cudaSuccess)
      return e;
    configured.fetch_or(bit, std::memory_order_acq_rel);
  }
  if (p.work_capacity > 0) kernel<<<unsigned(p.work_capacity), kThreads, kSmem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jax_msa::sm80::prefill
