// tcgen05 (sm_100a) sparse decode, UNVERIFIED: host entry points. The FFI handler calls sparse_decode when the
// dispatch table (cc/cuda/kernel_path.h) selects the tcgen05 kernels and decode_supports accepts the call; one
// explicit instantiation of launch_sparse_decode per format lives in decode_<format>.cu.
#pragma once
#include <cuda_runtime.h>

#include "common/params.h"

namespace jax_msa::sm100::decode {

// True when this kernel serves the call (D = 128, G divides 16, K <= 32, at most 16 selected blocks a CTA:
// ceil(K / splits) <= 16); `why` names the first reason it does not (the handler then takes the warp-MMA decode).
bool decode_supports(const DecodeParams& p, const char** why);

// The decode kernel, then the shared split combine when p.num_splits > 1. No host sync, no allocation.
cudaError_t sparse_decode(const DecodeParams& p, cudaStream_t stream);

template <KvFormat F>
cudaError_t launch_sparse_decode(const DecodeParams& p, cudaStream_t stream);

}  // namespace jax_msa::sm100::decode
