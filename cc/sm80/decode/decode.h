// Warp-MMA (sm_80+) sparse decode: host entry points. The FFI handler (cc/ffi/decode_cuda_handler.cc) calls
// sparse_decode; one explicit instantiation of launch_sparse_decode per format lives in
// decode_<format>.cu.
#pragma once
#include <cuda_runtime.h>

#include "common/params.h"

namespace jax_msa::sm80::decode {

// Checks the shapes this kernel serves (D = 128, G divides 16, K <= 32) and launches the decode kernel
// (plus the split combine when p.num_splits > 1) on `stream`. No host sync, no allocation.
cudaError_t sparse_decode(const DecodeParams& p, cudaStream_t stream);

// True when the kernel serves these shapes; `why` names the first unsupported one.
bool decode_supports(const DecodeParams& p, const char** why);

// Merges p.num_splits partials (p.partial_o, p.partial_lse) into p.out and p.lse.
cudaError_t launch_combine_splits(const DecodeParams& p, cudaStream_t stream);

template <KvFormat F>
cudaError_t launch_sparse_decode(const DecodeParams& p, cudaStream_t stream);

}  // namespace jax_msa::sm80::decode
