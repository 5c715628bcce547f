// Warp-MMA (sm_80+) sparse decode, bf16 KV cache: the one explicit instantiation of this translation unit.
#include "sm80/decode/decode_launch.cuh"

namespace jax_msa::sm80::decode {
template cudaError_t launch_sparse_decode<KvFormat::kBf16>(const DecodeParams&, cudaStream_t);
}  // namespace jax_msa::sm80::decode
