// Warp-MMA (sm_80+) decode: log-sum-exp merge of the split-K partials (launched after the decode kernel when
// num_splits > 1).
#include <cuda_bf16.h>

#include "sm80/common/register_pack.cuh"
#include "sm80/decode/config.h"
#include "sm80/decode/decode.h"

namespace jax_msa::sm80::decode {

namespace {

// Merges the num_splits partials of every (token, query head) row by log-sum-exp. One warp a row,
// 4 dims a lane.
__global__ void __launch_bounds__(128) combine_splits_kernel(const DecodeParams p) {
  const int64_t rows = int64_t(p.batch) * p.q_len * p.num_q_heads;
  const int64_t row = int64_t(blockIdx.x) * 4 + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  float m = -INFINITY;
  for (int s = 0; s < p.num_splits; ++s) m = fmaxf(m, p.partial_lse[s * rows + row]);
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float total = 0.0f;
  if (m != -INFINITY) {
    for (int s = 0; s < p.num_splits; ++s) {
      const float w = expf(p.partial_lse[s * rows + row] - m);
      const float4 o = reinterpret_cast<const float4*>(p.partial_o + (s * rows + row) * kHeadDim)[lane];
      acc.x += w * o.x;
      acc.y += w * o.y;
      acc.z += w * o.z;
      acc.w += w * o.w;
      total += w;
    }
  }
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
  const uint2 packed = make_uint2(pack_bf16x2(acc.x * inv, acc.y * inv), pack_bf16x2(acc.z * inv, acc.w * inv));
  reinterpret_cast<uint2*>(p.out + row * kHeadDim)[lane] = packed;
  if (lane == 0) p.lse[row] = total > 0.0f ? m + logf(total) : -INFINITY;
}

}  // namespace

cudaError_t launch_combine_splits(const DecodeParams& p, cudaStream_t stream) {
  const int64_t rows = int64_t(p.batch) * p.q_len * p.num_q_heads;
  if (rows == 0) return cudaSuccess;
  combine_splits_kernel<<<unsigned((rows + 3) / 4), 128, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jax_msa::sm80::decode
