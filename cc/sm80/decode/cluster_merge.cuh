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

// Called by every thread of every CTA of the cluster (cluster size = p.num_splits <= kMaxClusterSplits) once the
// CTA's rows < group are in `part`. Writes the merged bf16 rows q_row_base + [0, group) of p.out and their lse.
__device__ __forceinline__ void merge_cluster_splits(const DecodeParams& p, const ClusterPartial* part, int group,
                                                     int64_t q_row_base) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cd = cluster_detail;
  cd::barrier();  // every split's partial is in its CTA's shared memory
  timeline_mark(true, Phase::kClusterBarrier);
  const int splits = p.num_splits;
  const int rank = int(cd::rank_in_cluster());
  constexpr int kUnits = kHeadDim / 4;  // float4 units of a row
  const int units = group * kUnits;
  const int begin = rank * units / splits, end = (rank + 1) * units / splits;
  for (int i = begin + int(threadIdx.x); i < end; i += kThreads) {
    const int row = i / kUnits, unit = i % kUnits;
    float lse[kMaxClusterSplits];
    float4 o[kMaxClusterSplits];
    float m = -INFINITY;
#pragma unroll
    for (int s = 0; s < kMaxClusterSplits; ++s) {
      if (s < splits) {
        lse[s] = cd::load_f32(cd::remote_address(&part->lse[row], s));
        o[s] = cd::load_f32x4(cd::remote_address(&part->o[row][4 * unit], s));
      }
    }
#pragma unroll
    for (int s = 0; s < kMaxClusterSplits; ++s)
      if (s < splits) m = fmaxf(m, lse[s]);
    SplitMergeAccumulator merged;
#pragma unroll
    for (int s = 0; s < kMaxClusterSplits; ++s)
      if (s < splits) merged.add(split_weight(lse[s], m), o[s]);
    const float4 v = merged.output();
    const int64_t out_row = q_row_base + row;
    reinterpret_cast<uint2*>(p.out + out_row * kHeadDim)[unit] =
        make_uint2(pack_bf16x2(v.x, v.y), pack_bf16x2(v.z, v.w));
    if (unit == 0) p.lse[out_row] = merged.lse(m);
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
