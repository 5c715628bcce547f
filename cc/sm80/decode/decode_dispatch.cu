// Warp-MMA (sm_80+) sparse decode: shape checks and the per-format dispatch.
#include "sm80/decode/config.h"
#include "sm80/decode/decode.h"

namespace jax_msa::sm80::decode {

bool decode_supports(const DecodeParams& p, const char** why) {
  const int group = p.num_kv_heads > 0 ? p.num_q_heads / p.num_kv_heads : 0;
  const char* reason = nullptr;
  if (p.head_dim != kHeadDim) reason = "head_dim must be 128";
  else if (group < 1 || group > kRows || kRows % group != 0) reason = "GQA ratio must divide 16";
  else if (p.topk < 1 || p.topk > kMaxTopk) reason = "top-k must be in [1, 32]";
  else if (int64_t(p.batch) * p.q_len > 65535) reason = "batch * decode_query_len must be <= 65535";
  else if (p.num_splits > kMaxTopk) reason = "num_splits must be <= 32";
  else if (p.num_splits > 1 && (p.partial_o == nullptr || p.partial_lse == nullptr)) reason = "split workspace missing";
  if (why) *why = reason;
  return reason == nullptr;
}

cudaError_t sparse_decode(const DecodeParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.q_len == 0) return cudaSuccess;
  switch (p.kv_format) {
    case KvFormat::kBf16: return launch_sparse_decode<KvFormat::kBf16>(p, stream);
    case KvFormat::kFp8: return launch_sparse_decode<KvFormat::kFp8>(p, stream);
    case KvFormat::kNvfp4: return launch_sparse_decode<KvFormat::kNvfp4>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace jax_msa::sm80::decode
