// Warp-MMA (sm_80+) sparse prefill: shape checks, per-format dispatch, then the combine.
#include "cuda/env_flag.h"
#include "sm80/prefill/config.h"
#include "sm80/prefill/prefill.h"

namespace jax_msa::sm80::prefill {

bool prefill_supports(const PrefillParams& p, const char** why) {
  const int group = p.num_kv_heads > 0 ? p.num_q_heads / p.num_kv_heads : 0;
  const char* reason = nullptr;
  if (p.head_dim != kHeadDim) reason = "head_dim must be 128";
  else if (group < 1 || group > kTileRows) reason = "GQA ratio must be in [1, 128]";
  else if (p.total_q > 0 && (p.partial_o == nullptr || p.partial_lse == nullptr)) reason = "partial workspaces missing";
  if (why) *why = reason;
  return reason == nullptr;
}

bool prefill_pipelined_enabled() {
  static const bool on = cuda::env_flag("JAX_MSA_PREFILL_PIPELINED");
  return on;
}

cudaError_t sparse_prefill(const PrefillParams& p, cudaStream_t stream) {
  if (p.total_q == 0) return cudaSuccess;
  cudaError_t e = cudaErrorInvalidValue;
  switch (p.kv_format) {
    case KvFormat::kBf16:
      e = prefill_pipelined_enabled() ? launch_sparse_prefill_pipelined(p, stream)
                                      : launch_sparse_prefill<KvFormat::kBf16>(p, stream);
      break;
    case KvFormat::kFp8: e = launch_sparse_prefill<KvFormat::kFp8>(p, stream); break;
    case KvFormat::kNvfp4: e = launch_sparse_prefill<KvFormat::kNvfp4>(p, stream); break;
  }
  if (e != cudaSuccess) return e;
  return launch_combine_partials(p, stream);
}

}  // namespace jax_msa::sm80::prefill
