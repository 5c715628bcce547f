// Runtime side of the kernel dispatch table (see kernel_path.h): the device's compute capability, cached.
#include "cuda/kernel_path.h"

#include "cuda/env_flag.h"

#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>

namespace jax_msa::cuda {

const char* kernel_path_name(KernelPath path) {
  switch (path) {
    case KernelPath::kWarpMma: return "warp_mma";
    case KernelPath::kSm100: return "sm100";
    case KernelPath::kSm90: return "sm90";
    case KernelPath::kUnsupported: break;
  }
  return "unsupported";
}

bool sm100_kernels_enabled() {
  static const bool on = env_flag("JAX_MSA_ENABLE_SM100_KERNELS");
  return on;
}

bool sm90_kernels_enabled() {
  static const bool on = !env_flag("JAX_MSA_DISABLE_SM90_KERNELS");
  return on;
}

namespace {

// "M.m" -> 10 * M + m, or -1 when unset or malformed.
int forced_capability() {
  static const int forced = [] {
    const char* v = std::getenv("JAX_MSA_FORCE_COMPUTE_CAPABILITY");
    int major = 0, minor = 0;
    if (v == nullptr || std::sscanf(v, "%d.%d", &major, &minor) != 2 || major < 0 || minor < 0 || minor > 9) return -1;
    return 10 * major + minor;
  }();
  return forced;
}

}  // namespace

cudaError_t current_kernel_path(KernelPath* path, int* major, int* minor) {
  int capability = forced_capability();
  if (capability < 0) {
    static std::array<std::atomic<int>, 64> cached{};  // 10 * major + minor + 1 per device; 0 = not yet read
    int device = 0;
    if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
    const int slot = device & 63;
    int value = cached[slot].load(std::memory_order_acquire);
    if (value == 0) {
      int ma = 0, mi = 0;
      if (cudaError_t e = cudaDeviceGetAttribute(&ma, cudaDevAttrComputeCapabilityMajor, device); e != cudaSuccess)
        return e;
      if (cudaError_t e = cudaDeviceGetAttribute(&mi, cudaDevAttrComputeCapabilityMinor, device); e != cudaSuccess)
        return e;
      value = 10 * ma + mi + 1;
      cached[slot].store(value, std::memory_order_release);
    }
    capability = value - 1;
  }
  *major = capability / 10;
  *minor = capability % 10;
  *path = select_kernel_path(*major, *minor, sm100_kernels_built_for(*minor), sm100_kernels_enabled(),
                             kSm90KernelsBuilt, sm90_kernels_enabled());
  return cudaSuccess;
}

}  // namespace jax_msa::cuda
