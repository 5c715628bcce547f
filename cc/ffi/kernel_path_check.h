// The attention handlers' first step on the GPU: which kernels serve this device (cc/cuda/kernel_path.h), or a
// clear error for a device that has none.
#pragma once
#include <cuda_runtime.h>

#include <string>

#include "cuda/kernel_path.h"
#include "xla/ffi/api/ffi.h"

namespace jax_msa::ffi_bind {

inline xla::ffi::Error select_attention_kernels(const char* op, jax_msa::cuda::KernelPath* path) {
  int major = 0, minor = 0;
  if (cudaError_t e = jax_msa::cuda::current_kernel_path(path, &major, &minor); e != cudaSuccess)
    return xla::ffi::Error::Internal(std::string("jax_msa ") + op + ": cannot read the device's compute capability: " +
                                     cudaGetErrorString(e));
  if (*path == jax_msa::cuda::KernelPath::kUnsupported)
    return xla::ffi::Error::InvalidArgument(
        std::string("jax_msa ") + op + ": the CUDA kernels need compute capability >= 8.0 (mma.sync bf16, cp.async); "
        "this device is " + std::to_string(major) + "." + std::to_string(minor) +
        ". Use impl=\"reference\" on this GPU.");
  return xla::ffi::Error::Success();
}

// A failed kernel launch as an FFI error; a device this build has no SASS for is named as such.
inline xla::ffi::Error launch_failure(const char* op, cudaError_t err) {
  std::string msg = std::string("jax_msa ") + op + " launch failed: " + cudaGetErrorString(err);
  if (err == cudaErrorNoKernelImageForDevice || err == cudaErrorInvalidDeviceFunction)
    msg += std::string("; this build holds SASS for ") + JAX_MSA_CUDA_ARCHS_CSV +
           " only: rebuild with JAX_MSA_CUDA_ARCHS listing this GPU's architecture";
  return xla::ffi::Error::Internal(msg);
}

}  // namespace jax_msa::ffi_bind
