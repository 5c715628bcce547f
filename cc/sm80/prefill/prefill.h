// Warp-MMA (sm_80+) sparse prefill: host entry points. The FFI handler (cc/ffi/prefill_cuda_handler.cc) calls
// sparse_prefill; one explicit instantiation of launch_sparse_prefill per format lives in
// prefill_<format>.cu.
#pragma once
#include <cuda_runtime.h>

#include "common/params.h"

namespace jax_msa::sm80::prefill {

// True when the kernels serve these shapes (D = 128, G <= 128, partial workspaces present); `why` names the
// first unsupported one. The plan's tile size (<= 128 / G queries) is checked at trace time in Python.
bool prefill_supports(const PrefillParams& p, const char** why);

// The prefill kernel over the plan's work list (static-capacity grid, the count read on device), then the
// combine of each query's partials into out / lse. No host sync, no allocation.
cudaError_t sparse_prefill(const PrefillParams& p, cudaStream_t stream);

template <KvFormat F>
cudaError_t launch_sparse_prefill(const PrefillParams& p, cudaStream_t stream);

// Opt-in, unverified: persistent software-pipelined prefill kernel for bf16 KV (JAX_MSA_PREFILL_PIPELINED=1).
cudaError_t launch_sparse_prefill_pipelined(const PrefillParams& p, cudaStream_t stream);

// JAX_MSA_PREFILL_PIPELINED == "1" (read once).
bool prefill_pipelined_enabled();

cudaError_t launch_combine_partials(const PrefillParams& p, cudaStream_t stream);

}  // namespace jax_msa::sm80::prefill
