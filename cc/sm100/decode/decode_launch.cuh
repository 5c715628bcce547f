// Definition of launch_sparse_decode<F> (tcgen05); included by exactly one decode_<format>.cu each.
#pragma once
#include "cuda/launch_config.h"
#include "sm100/decode/decode.h"
#include "sm100/decode/decode_kernel.cuh"

namespace jax_msa::sm100::decode {

template <KvFormat F>
cudaError_t launch_sparse_decode(const DecodeParams& p, cudaStream_t stream) {
  constexpr int kSmem = SharedPlan::kBytes;
  if (cudaError_t e = cuda::ensure_dynamic_smem<sparse_decode_tcgen05_kernel<F>>(kSmem); e != cudaSuccess) return e;
  const int splits = p.num_splits > 1 ? p.num_splits : 1;
  const dim3 grid(splits, p.num_kv_heads, p.batch * p.q_len);
  sparse_decode_tcgen05_kernel<F><<<grid, kThreads, kSmem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jax_msa::sm100::decode
