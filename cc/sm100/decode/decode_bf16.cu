// tcgen05 (sm_100a) decode, bf16 KV cache: the one explicit instantiation of this translation unit (UNVERIFIED).
#include "sm100/decode/decode_launch.cuh"

namespace jax_msa::sm100::decode {
template cudaError_t launch_sparse_decode<KvFormat::kBf16>(const DecodeParams& p, cudaStream_t stream);
}  // namespace jax_msa::sm100::decode
