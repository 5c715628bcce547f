// Split-K merge inside a thread-block cluster (sm_90+): the CTAs of one (token, KV head), one a split, are launched
// as one cluster; each leaves its normalized partial (O, lse) in its own shared memory, and after a cluster barrier
// every CTA merges a slice of the rows' dims by reading all the partials through distributed shared memory. No
// partials go to global memory and no combine kernel is launched. The arithmetic is split_merge.cuh's, as in the
// combine kernel, so both paths give bit-identical outputs.
#pragma once
#include <cstdint>

#include "common/params.h"
#include "sm80/common/register_pack.cuh"
#include "sm80/decode/cluster_launch.h"
#include "sm80/decode/config.h"
#include "sm80/decode/split_merge.cuh"
#include "sm80/decode/timeline.cuh"

namespace jax_msa::sm80::decode {

// One CTA's partial, staged in its shared memory for the cluster.
struct ClusterPartial {
  float o[kRows][kHeadDim];  // normalized output of the split (v_scale applied), rows < group written
  float lse[kRows];          // natural log; -inf when the split saw no key of the row
};
static_assert(sizeof(ClusterPartial) == SharedPlan<KvFormat::kBf16>::kClusterPartialBytes,
              "config.h reserves the cluster partial's bytes");

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
namespace cluster_detail {

__device__ __forceinline__ uint32_t rank_in_cluster() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

// Every thread of every CTA of the cluster: release this CTA's shared-memory writes, acquire the others'.
__device__ __forceinline__ void barrier() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Every thread of every CTA of the cluster, orders nothing: for the exit, where this thread's remote loads have
// returned (their values were consumed) and only the CTAs' lifetimes must overlap. Skips the release's fence.
__device__ __forceinline__ void barrier_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
}

// The shared::cluster address of `local` (this CTA's shared memory) in the CTA of rank `rank`.
__device__ __forceinline__ uint32_t remote_address(const void* local, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
               : "=r"(remote)
               : "r"(uint32_t(__cvta_generic_to_shared(local))), "r"(rank));
  return remote;
}

__device__ __forceinline__ float load_f32(uint32_t address) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(address));
  return v;
}

__device__ __forceinline__ float4 load_f32x4(uint32_t address) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(address));
  return v;
}

}  // namespace cluster_detail
#endif

// This CTA's slice of every split's partial (units [begin, end) of the rows' float4 units), gathered into its own
// shared memory by one remote round trip, and the slice rows' split weights: what the merge reads. It lives in the
// warps' merge area (SharedPlan::kMergeBytes at offset 0), free once the cluster barrier has passed.
struct ClusterGather {
  static constexpr int kUnits = kHeadDim / 4;                        // float4 units of a row
  // Rows a slice touches: at most 8. A slice of n units starting at unit offset o of a row touches
  // ceil((o + n) / 32) rows; n = units / splits (rounded either way) is at most 171 at 3+ splits (6 rows + 1 for the
  // offset); at 2 splits, n = 16 group and o = 0 (even group) or 16 (odd group, n <= 240): 8 rows either way.
  static constexpr int kMaxSliceRows = 8;
  static constexpr int kMaxEntries = kRows * kUnits + kMaxClusterSplits - 1;  // splits x slice <= units + splits - 1
  float4 o[kMaxEntries];                         // [split][slice unit]
  float weight[kMaxSliceRows][kMaxClusterSplits];  // split_weight(lse_s, m) of slice row r
  float m[kMaxSliceRows];                        // max_s lse_s of slice row r
};
static_assert(sizeof(ClusterGather) <= SharedPlan<KvFormat::kBf16>::kMergeBytes,
              "the gathered slice fits the warps' merge area");

// Called by every thread of every CTA of the cluster (cluster size = p.num_splits in [2, kMaxClusterSplits]) once the
// CTA's rows < group are in `part` (the entry barrier also orders the CTA's last reads of the merge area, which
// `gather` overlays, before its writes). Writes the
// merged bf16 rows q_row_base + [0, group) of p.out and their lse. CTA `rank` merges units [begin, end) of the
// rows' group * 32 float4 units: all 128 threads first fetch the slice from every split (each thread about
// units / 128 float4s and at most 1 lse, every load issued before any is used: one remote round trip), a warp's
// half takes one row's lse and weights, then each unit's thread adds the splits in split order from its own shared
// memory (split_merge.cuh's arithmetic: the combine kernel's bits).
__device__ __forceinline__ void merge_cluster_splits(const DecodeParams& p, const ClusterPartial* part,
                                                     ClusterGather* gather, int group, int64_t q_row_base) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cd = cluster_detail;
  constexpr int kUnits = ClusterGather::kUnits;
  constexpr int kLoadsPerThread = (ClusterGather::kMaxEntries + kThreads - 1) / kThreads;
  constexpr int kHalves = kThreads / 16;  // half-warps: one slice row each, lane s of the half = split s
  constexpr int kRowPasses = (ClusterGather::kMaxSliceRows + kHalves - 1) / kHalves;  // 1
  static_assert(kMaxClusterSplits <= 16, "a half-warp holds a row's splits");
  cd::barrier();  // every split's partial is in its CTA's shared memory
  timeline_mark(true, Phase::kClusterBarrier);
  const int splits = p.num_splits;
  const int rank = int(cd::rank_in_cluster());
  const int units = group * kUnits;
  const int begin = rank * units / splits, n = (rank + 1) * units / splits - begin;
  const int row0 = begin / kUnits;
  const int rows = n > 0 ? (begin + n - 1) / kUnits - row0 + 1 : 0;

  // ---- 1. the slice from every split: entry k = s * n + i is unit begin + i of split s
  const float* slice = &part->o[0][0] + 4 * begin;
  float4 o[kLoadsPerThread];
  if (n > 0) {
    // (s, i) of entry threadIdx.x + j * kThreads, stepped by kThreads = step_s * n + step_i: two divisions in all
    const int step_s = kThreads / n, step_i = kThreads - step_s * n;
    int s = int(threadIdx.x) / n, i = int(threadIdx.x) - s * n;
#pragma unroll
    for (int j = 0; j < kLoadsPerThread; ++j) {
      if (s < splits) o[j] = cd::load_f32x4(cd::remote_address(slice + 4 * i, s));
      s += step_s;
      i += step_i;
      if (i >= n) i -= n, ++s;
    }
  }
  const int half = int(threadIdx.x) >> 4, split_lane = int(threadIdx.x) & 15;
  float lse[kRowPasses];
#pragma unroll
  for (int j = 0; j < kRowPasses; ++j) {
    const int r = half + j * kHalves;
    lse[j] = r < rows && split_lane < splits ? cd::load_f32(cd::remote_address(&part->lse[row0 + r], split_lane))
                                             : -INFINITY;
  }
#pragma unroll
  for (int j = 0; j < kLoadsPerThread; ++j) {
    const int k = int(threadIdx.x) + j * kThreads;
    if (k < splits * n) gather->o[k] = o[j];
  }
#pragma unroll
  for (int j = 0; j < kRowPasses; ++j) {
    const int r = half + j * kHalves;
    float m = lse[j];
#pragma unroll
    for (int offset = 8; offset > 0; offset >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
    if (r < rows && split_lane < splits) gather->weight[r][split_lane] = split_weight(lse[j], m);
    if (r < rows && split_lane == 0) gather->m[r] = m;
  }
  __syncthreads();  // the slice and the weights are staged

  // ---- 2. each unit of the slice: the splits in split order
  for (int i = int(threadIdx.x); i < n; i += kThreads) {
    const int row = (begin + i) / kUnits, unit = (begin + i) % kUnits, r = row - row0;
    float w[kMaxClusterSplits];
    float4 x[kMaxClusterSplits];
#pragma unroll
    for (int s = 0; s < kMaxClusterSplits; ++s) {
      if (s < splits) {
        w[s] = gather->weight[r][s];
        x[s] = gather->o[s * n + i];
      }
    }
    SplitMergeAccumulator merged;
#pragma unroll
    for (int s = 0; s < kMaxClusterSplits; ++s)
      if (s < splits) merged.add(w[s], x[s]);
    const float4 v = merged.output();
    const int64_t out_row = q_row_base + row;
    reinterpret_cast<uint2*>(p.out + out_row * kHeadDim)[unit] =
        make_uint2(pack_bf16x2(v.x, v.y), pack_bf16x2(v.z, v.w));
    if (unit == 0) p.lse[out_row] = merged.lse(gather->m[r]);
  }
  timeline_mark(true, Phase::kClusterMerge);
  cd::barrier_relaxed();  // no CTA leaves while another still reads its shared memory
  timeline_mark(true, Phase::kExit);
  timeline_write(p, true);
#else
  __trap();  // the launcher clusters only kernels built for sm_90+ (cluster_launch.cc): unreachable
#endif
}

}  // namespace jax_msa::sm80::decode
