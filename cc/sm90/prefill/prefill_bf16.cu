// Hopper (sm_90a) sparse prefill, bf16 KV cache and bf16 queries: the one kernel of this translation unit.
#include "sm90/prefill/launch.cuh"

namespace jax_msa::sm90::prefill {

cudaError_t launch_sparse_prefill_bf16(const TmaPrefillArgs& args, cudaStream_t stream) {
  return launch_sparse_prefill<KvFormat::kBf16>(args, stream);
}

}  // namespace jax_msa::sm90::prefill
