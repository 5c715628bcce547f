// CUDA write_kv: scatters new K/V tokens into a bf16, FP8 or NVFP4 paged cache in place, quantizing on
// the way (MSA.md sections 3-4). Same bytes as the CPU handler (cc/cpu/write_kv_cpu.cc) and
// jax_msa/kv_cache.py: both share cc/common/quantize.h.
//
// Host-only header (no CUDA syntax), included by cc/ffi/cuda_module.cc and cc/cuda/write_kv.cu.
#pragma once
#include <cuda_runtime_api.h>

#include "common/params.h"

namespace jax_msa::cuda {

// Enqueues the write on `stream`; no host synchronisation, no allocation. The caller has checked that the
// buffers are consistent: k, v [num_tokens, num_kv_heads, head_dim] bf16, slot_mapping [num_tokens],
// k_scale / v_scale fp32 [L] on the device (L divides num_tokens: token n reads entry n / tokens_per_scale), the cache
// of kv_format with num_pages pages and num_kv_heads heads, and head_dim % 16 == 0. Slots < 0 or >= num_pages * 128
// are skipped without touching memory.
// Returns the launch error (cudaGetLastError) or cudaSuccess; nothing is launched for num_tokens == 0.
cudaError_t launch_write_kv(const WriteKvParams& p, cudaStream_t stream);

}  // namespace jax_msa::cuda
