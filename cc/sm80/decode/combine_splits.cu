// Warp-MMA (sm_80+) decode: log-sum-exp merge of the split-K partials in global memory (launched after the decode
// kernel when num_splits > 1 and the splits do not merge inside a cluster; see cluster_merge.cuh).
#include <cuda_bf16.h>

#include "sm80/common/register_pack.cuh"
#include "sm80/decode/config.h"
#include "sm80/decode/decode.h"
#include "sm80/decode/split_merge.cuh"

namespace jax_msa::sm80::decode {

namespace {

// Merges the num_splits (<= 32) partials of every (token, query head) row by log-sum-exp (split_merge.cuh). One warp
// a row, 4 dims a lane. Lane s reads split s's lse, so a row's lse loads are one round trip, not num_splits; the
// partial outputs are loaded 8 splits at a time.
__global__ void __launch_bounds__(128) combine_splits_kernel(const DecodeParams p) {
  const int64_t rows = int64_t(p.batch) * p.q_len * p.num_q_heads;
  const int64_t row = int64_t(blockIdx.x) * 4 + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const int splits = p.num_splits;
  const float lse_lane = lane < splits ? p.partial_lse[lane * rows + row] : -INFINITY;
  float m = lse_lane;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
  const float w_lane = split_weight(lse_lane, m);
  const float4* o = reinterpret_cast<const float4*>(p.partial_o + row * kHeadDim) + lane;
  const int64_t split_stride = rows * (kHeadDim / 4);  // float4s between one split's partials and the next's
  SplitMergeAccumulator merged;
  for (int s0 = 0; s0 < splits; s0 += 8) {
    float4 o_s[8];
#pragma unroll
    for (int k = 0; k < 8; ++k)
      if (s0 + k < splits) o_s[k] = o[(s0 + k) * split_stride];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float w = __shfl_sync(0xffffffffu, w_lane, (s0 + k) & 31);
      if (s0 + k < splits) merged.add(w, o_s[k]);
    }
  }
  const float4 v = merged.output();
  reinterpret_cast<uint2*>(p.out + row * kHeadDim)[lane] = make_uint2(pack_bf16x2(v.x, v.y), pack_bf16x2(v.z, v.w));
  if (lane == 0) p.lse[row] = merged.lse(m);
}

}  // namespace

cudaError_t launch_combine_splits(const DecodeParams& p, cudaStream_t stream) {
  const int64_t rows = int64_t(p.batch) * p.q_len * p.num_q_heads;
  if (rows == 0) return cudaSuccess;
  combine_splits_kernel<<<unsigned((rows + 3) / 4), 128, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jax_msa::sm80::decode
