// Definition of launch_sparse_decode<F>; included by exactly one decode_<format>.cu each.
#pragma once
#include "cuda/launch_config.h"
#include "sm80/decode/decode.h"
#include "sm80/decode/decode_kernel.cuh"

namespace jax_msa::sm80::decode {

template <KvFormat F>
cudaError_t launch_sparse_decode(const DecodeParams& p, cudaStream_t stream) {
  constexpr int kSmem = SharedPlan<F>::kBytes;
  auto kernel = sparse_decode_kernel<F>;
  if (cudaError_t e = cuda::ensure_dynamic_smem<sparse_decode_kernel<F>>(kSmem); e != cudaSuccess) return e;
  const int splits = p.num_splits > 1 ? p.num_splits : 1;
  const dim3 grid(splits, p.num_kv_heads, p.batch * p.q_len);
  kernel<<<grid, kThreads, kSmem, stream>>>(p);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  return splits > 1 ? launch_combine_splits(p, stream) : cudaSuccess;
}

}  // namespace jax_msa::sm80::decode
