// tcgen05 (sm_100a) decode, fp8 KV cache: the one explicit instantiation of this translation unit (UNVERIFIED).
#include "sm100/decode/decode_launch.cuh"

namespace jax_msa::sm100::decode {
template cudaError_t launch_sparse_decode<KvFormat::kFp8>(const DecodeParams& p, cudaStream_t stream);
}  // namespace jax_msa::sm100::decode
