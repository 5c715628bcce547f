// Which family of attention kernels serves the current device: the runtime dispatch table of the CUDA handlers.
//
//   compute capability        kernels
//   < 8.0                     none: the handler returns a clear error (mma.sync bf16 and cp.async need sm_80)
//   10.0 / 10.3 (Blackwell)   with JAX_MSA_ENABLE_SM100_KERNELS=1 and a build for that exact architecture (sm_100a
//                             for 10.0, sm_103a for 10.3): the tcgen05 kernels (cc/sm100, UNVERIFIED: never run; a
//                             decode call they do not serve, more than 16 blocks a CTA, takes the warp-MMA decode);
//                             otherwise the warp-MMA kernels
//   9.0 (H100 / H200)         with a build for sm_90a: the sm90 path = the wgmma prefill (cc/sm90/prefill) where it
//                             serves the call (bf16 queries with bf16, FP8 or NVFP4 KV, G = 8 or 16;
//                             JAX_MSA_SM90_FP8_PREFILL=0 / ..._NVFP4_PREFILL=0 opt out), the warp-MMA kernels for
//                             the rest and for the decode; JAX_MSA_DISABLE_SM90_KERNELS=1 selects the warp-MMA kernels only
//   any other >= 8.0          the warp-MMA kernels of cc/sm80 (mma.sync m16n8k16 + cp.async + ldmatrix). On sm_90
//                             (H200) they serve the decode and the prefill calls the wgmma kernel does not.
//
// JAX_MSA_FORCE_COMPUTE_CAPABILITY="M.m" makes the handlers see that capability instead of the device's (to exercise
// the table; the kernels still need SASS for the real device in this build).
#pragma once
#include <cuda_runtime.h>

namespace jax_msa::cuda {

enum class KernelPath : int { kUnsupported = 0, kWarpMma = 1, kSm100 = 2, kSm90 = 3 };

// Which of sm_100a (bit 0) and sm_103a (bit 1) this build's architecture list holds: the tcgen05 kernels have a body
// only there, and "a" code runs only on its exact compute capability (set by CMakeLists.txt).
#ifndef JAX_MSA_SM100_KERNEL_ARCHS
#define JAX_MSA_SM100_KERNEL_ARCHS 0
#endif
constexpr int kSm100KernelArchs = JAX_MSA_SM100_KERNEL_ARCHS;

// Whether this build holds tcgen05 kernels for compute capability 10.minor.
constexpr bool sm100_kernels_built_for(int minor) {
  return (minor == 0 && (kSm100KernelArchs & 1)) || (minor == 3 && (kSm100KernelArchs & 2));
}

// Whether this build holds the sm_90a kernels (wgmma, TMA): set by CMakeLists.txt when 90a is in the list.
#ifndef JAX_MSA_SM90_KERNELS
#define JAX_MSA_SM90_KERNELS 0
#endif
constexpr bool kSm90KernelsBuilt = JAX_MSA_SM90_KERNELS != 0;

constexpr KernelPath select_kernel_path(int major, int minor, bool sm100_kernels_built, bool sm100_enabled,
                                        bool sm90_kernels_built, bool sm90_enabled) {
  if (major < 8) return KernelPath::kUnsupported;
  if (major == 10 && (minor == 0 || minor == 3) && sm100_kernels_built && sm100_enabled) return KernelPath::kSm100;
  if (major == 9 && minor == 0 && sm90_kernels_built && sm90_enabled) return KernelPath::kSm90;
  return KernelPath::kWarpMma;
}

const char* kernel_path_name(KernelPath path);

// JAX_MSA_ENABLE_SM100_KERNELS == "1" (read once).
bool sm100_kernels_enabled();

// JAX_MSA_DISABLE_SM90_KERNELS != "1" (read once).
bool sm90_kernels_enabled();

// The compute capability the handlers see for the current device (cached per device; the override above wins)
// and the kernel path it selects. No stream work: safe during command-buffer capture.
cudaError_t current_kernel_path(KernelPath* path, int* major, int* minor);

}  // namespace jax_msa::cuda
