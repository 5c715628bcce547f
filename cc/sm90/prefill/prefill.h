// Hopper (sm_90a) sparse prefill: host entry points. The FFI handler (cc/ffi/prefill_cuda_handler.cc) calls
// sparse_prefill on the sm90 kernel path when prefill_supports says this kernel serves the call; the warp-MMA prefill
// (cc/sm80/prefill) serves the rest.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>

#include "common/params.h"

namespace jax_msa::sm90::prefill {

// Kernel arguments: the prefill parameters and the two TMA descriptors built on the host for this call's buffers.
struct TmaPrefillArgs {
  PrefillParams p;
  CUtensorMap q_map;   // q as [T * Hq rows, 128] bf16 (row stride 256 B); box 64 dims x G rows, 128-byte swizzle
  CUtensorMap kv_map;  // bf16 cache as [pages * Hkv * 128 rows, 256] bf16 (row = token: K dims 0-127, V 128-255,
                       // stride 512 B), box 64 dims x 128 rows, 128-byte swizzle; FP8 cache as [pages * Hkv * 128
                       // rows, 256] bytes (K bytes 0-127, V 128-255), box 128 bytes x 128 rows, no swizzle; NVFP4:
                       // not encoded (its cache slots are loaded by bulk copies from p.kv_cache)
};

// True when the wgmma kernel serves these shapes: bf16, FP8 or NVFP4 KV (FP8 / NVFP4 unless fp8_prefill_enabled /
// nvfp4_prefill_enabled is false), bf16 q, D = 128,
// G in {8, 16}, the partial workspaces present, TMA row coordinates within int32; `why` names the first unsupported
// one.
bool prefill_supports(const PrefillParams& p, const char** why);

// FP8 KV takes the wgmma kernel (converter warps) unless JAX_MSA_SM90_FP8_PREFILL=0 (read once) sends it to the
// warp-MMA one. Default since its GPU tests and memcheck passed on the H200 (seventh session; 1.65x faster).
bool fp8_prefill_enabled();

// NVFP4 KV takes the wgmma kernel (bulk copies of the cache slots, converter warps) unless JAX_MSA_SM90_NVFP4_PREFILL=0
// (read once) sends it to the warp-MMA one. Default since its GPU tests and memcheck passed on the H200 (seventh
// session; 1.8x faster than the warp-MMA kernel at 32k 64/4).
bool nvfp4_prefill_enabled();

// The wgmma prefill kernel over the plan's work list (persistent, the count read on device), then the combine of each
// query's partials into out / lse. No host sync, no allocation (the TMA descriptors are kernel parameters).
cudaError_t sparse_prefill(const PrefillParams& p, cudaStream_t stream);

// The kernel alone, one translation unit a format (prefill_bf16.cu, prefill_fp8.cu, prefill_nvfp4.cu).
cudaError_t launch_sparse_prefill_bf16(const TmaPrefillArgs& args, cudaStream_t stream);
cudaError_t launch_sparse_prefill_fp8(const TmaPrefillArgs& args, cudaStream_t stream);
cudaError_t launch_sparse_prefill_nvfp4(const TmaPrefillArgs& args, cudaStream_t stream);

}  // namespace jax_msa::sm90::prefill
