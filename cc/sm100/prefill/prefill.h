// tcgen05 (sm_100a) sparse prefill, UNVERIFIED: host entry points. The FFI handler calls sparse_prefill when the
// dispatch table (cc/cuda/kernel_path.h) selects the tcgen05 kernels; one explicit instantiation of
// launch_sparse_prefill per format lives in prefill_<format>.cu.
#pragma once
#include <cuda_runtime.h>

#include "common/params.h"

namespace jax_msa::sm100::prefill {

// True when the kernels serve these shapes (D = 128, G <= 128, bf16 partials present); `why` names the first
// unsupported one.
bool prefill_supports(const PrefillParams& p, const char** why);

// The tcgen05 prefill kernel over the plan's work list (static-capacity grid, the count read on device), then the
// shared combine of each query's partials (cc/sm80/prefill/combine_partials.cu). No host sync, no allocation.
cudaError_t sparse_prefill(const PrefillParams& p, cudaStream_t stream);

template <KvFormat F>
cudaError_t launch_sparse_prefill(const PrefillParams& p, cudaStream_t stream);

}  // namespace jax_msa::sm100::prefill
