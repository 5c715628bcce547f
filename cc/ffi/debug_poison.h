// Test aid: with JAX_MSA_DEBUG_POISON=1 in the environment, CUDA handlers fill their outputs with NaN
// (all-ones bytes) on the stream before launching, so that an element a kernel fails to write shows up as
// NaN in the GPU tests. A stream memset, so it is also safe inside command buffers. Off by default.
#pragma once
#include <cuda_runtime.h>

#include <cstdlib>

namespace jax_msa::ffi_bind {

inline bool poison_outputs() {
  static const bool on = [] {
    const char* v = std::getenv("JAX_MSA_DEBUG_POISON");
    return v != nullptr && v[0] == '1';
  }();
  return on;
}

inline cudaError_t poison(void* data, size_t bytes, cudaStream_t stream) {
  if (!poison_outputs() || data == nullptr || bytes == 0) return cudaSuccess;
  return cudaMemsetAsync(data, 0xff, bytes, stream);
}

}  // namespace jax_msa::ffi_bind
