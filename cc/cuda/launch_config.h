// Host-side launch helpers shared by the CUDA kernels' launchers: per-device, once-only settings that are
// host calls (not stream operations), so they are safe while XLA captures a command buffer.
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

namespace jax_msa::cuda {

// Raises kKernel's dynamic shared-memory limit to `bytes` once per device. The template parameter is the kernel
// itself, so every kernel keeps its own flags.
template <auto kKernel>
cudaError_t ensure_dynamic_smem(int bytes) {
  static std::atomic<uint64_t> configured{0};
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  const uint64_t bit = uint64_t(1) << (device & 63);
  if (configured.load(std::memory_order_acquire) & bit) return cudaSuccess;
  if (cudaError_t e = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
      e != cudaSuccess)
    return e;
  configured.fetch_or(bit, std::memory_order_acq_rel);
  return cudaSuccess;
}

// The current device's number of SMs (read once per device).
inline cudaError_t current_sm_count(int* sms) {
  static std::atomic<int> counts[64] = {};
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  int n = counts[device & 63].load(std::memory_order_acquire);
  if (n == 0) {
    if (cudaError_t e = cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device); e != cudaSuccess) return e;
    counts[device & 63].store(n, std::memory_order_release);
  }
  *sms = n;
  return cudaSuccess;
}

// How many CTAs of kKernel (`threads` a CTA, `smem_bytes` of dynamic shared memory, which ensure_dynamic_smem allows
// first) an SM of the current device holds, read once per device: the launcher's choice between layouts that give the
// same bits (the decode's team CTAs, one or two an SM), not a correctness condition.
template <auto kKernel>
cudaError_t resident_ctas_per_sm(int threads, int smem_bytes, int* ctas) {
  static std::atomic<int> known[64] = {};  // the answer + 1; 0: not asked yet on that device
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  int n = known[device & 63].load(std::memory_order_acquire);
  if (n == 0) {
    if (cudaError_t e = ensure_dynamic_smem<kKernel>(smem_bytes); e != cudaSuccess) return e;
    int fit = 0;
    if (cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, kKernel, threads, size_t(smem_bytes));
        e != cudaSuccess)
      return e;
    n = fit + 1;
    known[device & 63].store(n, std::memory_order_release);
  }
  *ctas = n - 1;
  return cudaSuccess;
}

}  // namespace jax_msa::cuda
