// Warp-MMA (sm_80+) sparse prefill, fp8 KV cache: the one explicit instantiation of this translation unit.
#include "sm80/prefill/prefill_launch.cuh"

namespace jax_msa::sm80::prefill {
template cudaError_t launch_sparse_prefill<KvFormat::kFp8>(const PrefillParams&, cudaStream_t);
}  // namespace jax_msa::sm80::prefill
