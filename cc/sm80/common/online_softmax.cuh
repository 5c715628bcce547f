// Online softmax of the two rows a thread holds in an m16n8 MMA accumulator (rows lane / 4 and lane / 4 + 8; the
// four lanes of a quad share a row), in log2 units, shared by the warp-MMA decode and prefill kernels.
//
// Lazy rescaling: the running max m only moves when a new score exceeds it by more than kRescaleThreshold (log2
// units), so after the first keys the O accumulator is almost never rescaled (the warp skips the 64 multiplies
// when no row of it moved). Exact: O, l and the lse all refer to the same m; the probabilities are at most
// 2^kRescaleThreshold = 256, well inside bf16 / f16 and the fp32 sums.
#pragma once
#include <cmath>

#include "cuda/exp2_approx.cuh"

namespace jax_msa::sm80 {

constexpr float kRescaleThreshold = 8.0f;

struct OnlineSoftmax {
  float m[2] = {-INFINITY, -INFINITY};  // running max per row (log2 units), -inf while every key was masked
  float l[2] = {0.0f, 0.0f};            // this lane's share of the row sum of exp2(s - m)

  // s: scores already scaled to log2 units, masked keys -inf; replaced by p = exp2(s - m). alpha: the factor the
  // row's O accumulator must be multiplied with. Returns whether any row of the warp needs it (warp-uniform).
  template <int kNTiles>
  __device__ __forceinline__ bool update(float (&s)[kNTiles][4], float (&alpha)[2]) {
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[nt][e]);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      // -inf + threshold = -inf: the first finite score always moves m (alpha = 0 on an empty accumulator)
      const bool move = mx[r] > m[r] + kRescaleThreshold;
      alpha[r] = move ? exp2_approx(m[r] - mx[r]) : 1.0f;
      m[r] = move ? mx[r] : m[r];
    }
    float row_sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float base = m[e >> 1] == -INFINITY ? 0.0f : m[e >> 1];
        const float pr = exp2_approx(s[nt][e] - base);
        s[nt][e] = pr;
        row_sum[e >> 1] += pr;
      }
    }
    l[0] = l[0] * alpha[0] + row_sum[0];
    l[1] = l[1] * alpha[1] + row_sum[1];
    return __any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f);
  }

  // The quad's full row sums (call once, after the last update).
  __device__ __forceinline__ void reduce_row_sums() {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
  }
};

// O accumulator of 16 n-tiles of 8 dims ([0,1] row lane / 4, [2,3] row lane / 4 + 8) times the rows' alpha.
__device__ __forceinline__ void rescale_rows(float (&acc)[16][4], const float (&alpha)[2]) {
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    acc[i][0] *= alpha[0];
    acc[i][1] *= alpha[0];
    acc[i][2] *= alpha[1];
    acc[i][3] *= alpha[1];
  }
}

}  // namespace jax_msa::sm80
