// tcgen05 (sm_100a) prefill, bf16 KV cache: the one explicit instantiation of this translation unit (UNVERIFIED).
#include "sm100/prefill/prefill_launch.cuh"

namespace jax_msa::sm100::prefill {
template cudaError_t launch_sparse_prefill<KvFormat::kBf16>(const PrefillParams& p, cudaStream_t stream);
}  // namespace jax_msa::sm100::prefill
