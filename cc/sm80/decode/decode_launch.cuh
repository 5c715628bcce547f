// Definition of launch_sparse_decode<F>; included by exactly one decode_<format>.cu each.
#pragma once
#include "cuda/launch_config.h"
#include "sm80/decode/cluster_launch.h"
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
  if (splits > 1 && use_cluster_merge(reinterpret_cast<const void*>(kernel), splits, kThreads, kSmem)) {
    // the splits of a (token, KV head) are grid.x: one cluster each, merged on chip (cluster_merge.cuh)
    cudaLaunchAttribute cluster = cluster_dimension(splits);
    cudaLaunchConfig_t config = {};
    config.gridDim = grid;
    config.blockDim = dim3(kThreads);
    config.dynamicSmemBytes = kSmem;
    config.stream = stream;
    config.attrs = &cluster;
    config.numAttrs = 1;
    if (cudaError_t e = cudaLaunchKernelEx(&config, kernel, p, true); e != cudaSuccess) {
      cudaGetLastError();  // the error is returned, not left for the next caller
      return e;
    }
    count_decode_merge(DecodeMerge::kCluster);
    return cudaSuccess;
  }
  kernel<<<grid, kThreads, kSmem, stream>>>(p, false);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (splits == 1) return cudaSuccess;
  if (cudaError_t e = launch_combine_splits(p, stream); e != cudaSuccess) return e;
  count_decode_merge(DecodeMerge::kCombineKernel);
  return cudaSuccess;
}

}  // namespace jax_msa::sm80::decode
