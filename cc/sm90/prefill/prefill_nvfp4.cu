// Hopper (sm_90a) sparse prefill, NVFP4 KV cache (converted to bf16 in shared memory) and bf16 queries: the one
// kernel of this translation unit.
#include "sm90/prefill/launch.cuh"

namespace jax_msa::sm90::prefill {

cudaError_t launch_sparse_prefill_nvfp4(const TmaPrefillArgs& args, cudaStream_t stream) {
  return launch_sparse_prefill<KvFormat::kNvfp4>(args, stream);
}

}  // namespace jax_msa::sm90::prefill
