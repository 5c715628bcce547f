// Definition of launch_sparse_decode<F>; included by exactly one decode_<format>.cu each.
#pragma once
#include <atomic>

#include "sm80/decode/decode.h"
#include "sm80/decode/decode_kernel.cuh"

namespace jax_msa::sm80::decode {

// Raises the kernel's dynamic shared-memory limit once per device (a host-side attribute, not a stream
// operation, so it is safe while XLA captures a command buffer). One flag set per format: the three
// kernels share a function type, so the format must key the static.
template <KvFormat F, typename Kernel>
cudaError_t ensure_smem_limit(Kernel kernel, int bytes) {
  static std::atomic<uint64_t> configured{0};
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  const uint64_t bit = uint64_t(1) << (device & 63);
  if (configured.load(std::memory_order_acquire) & bit) return cudaSuccess;
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes); e != cudaSuccess)
    return e;
  configured.fetch_or(bit, std::memory_order_acq_rel);
  return cudaSuccess;
}

template <KvFormat F>
cudaError_t launch_sparse_decode(const DecodeParams& p, cudaStream_t stream) {
  constexpr int kSmem = SharedPlan<F>::kBytes;
  auto kernel = sparse_decode_kernel<F>;
  if (cudaError_t e = ensure_smem_limit<F>(kernel, kSmem); e != cudaSuccess) return e;
  const int splits = p.num_splits > 1 ? p.num_splits : 1;
  const dim3 grid(splits, p.num_kv_heads, p.batch * p.q_len);
  kernel<<<grid, kThreads, kSmem, stream>>>(p);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  return splits > 1 ? launch_combine_splits(p, stream) : cudaSuccess;
}

}  // namespace jax_msa::sm80::decode
