// tcgen05 (sm_100a) sparse decode, UNVERIFIED: shape checks, per-format dispatch, then the shared split combine.
#include "sm100/decode/config.h"
#include "sm100/decode/decode.h"
#include "sm80/decode/decode.h"

namespace jax_msa::sm100::decode {

bool decode_supports(const DecodeParams& p, const char** why) {
  const int group = p.num_kv_heads > 0 ? p.num_q_heads / p.num_kv_heads : 0;
  const int splits = p.num_splits > 1 ? p.num_splits : 1;
  const char* reason = nullptr;
  if (p.head_dim != kHeadDim) reason = "head_dim must be 128";
  else if (group < 1 || group > kHeads || kHeads % group != 0) reason = "GQA ratio must divide 16";
  else if (p.topk < 1 || p.topk > kMaxTopk) reason = "top-k must be in [1, 32]";
  else if ((p.topk + splits - 1) / splits > kMaxBlocks) reason = "more than 16 selected blocks a CTA";
  else if (int64_t(p.batch) * p.q_len > 65535) reason = "batch * decode_query_len must be <= 65535";
  else if (splits > 1 && (p.partial_o == nullptr || p.partial_lse == nullptr)) reason = "split workspace missing";
  if (why) *why = reason;
  return reason == nullptr;
}

cudaError_t sparse_decode(const DecodeParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.q_len == 0) return cudaSuccess;
  cudaError_t e = cudaErrorInvalidValue;
  switch (p.kv_format) {
    case KvFormat::kBf16: e = launch_sparse_decode<KvFormat::kBf16>(p, stream); break;
    case KvFormat::kFp8: e = launch_sparse_decode<KvFormat::kFp8>(p, stream); break;
    case KvFormat::kNvfp4: e = launch_sparse_decode<KvFormat::kNvfp4>(p, stream); break;
  }
  if (e != cudaSuccess) return e;
  return p.num_splits > 1 ? sm80::decode::launch_combine_splits(p, stream) : cudaSuccess;  // architecture-generic
}

}  // namespace jax_msa::sm100::decode
