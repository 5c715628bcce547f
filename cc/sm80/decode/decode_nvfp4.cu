// Warp-MMA (sm_80+) sparse decode, nvfp4 KV cache: the one explicit instantiation of this translation unit.
#include "sm80/decode/decode_launch.cuh"

namespace jax_msa::sm80::decode {
template cudaError_t launch_sparse_decode<KvFormat::kNvfp4>(const DecodeParams&, cudaStream_t);
}  // namespace jax_msa::sm80::decode
