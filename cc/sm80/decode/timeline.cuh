// Debug build switch JAX_MSA_DECODE_TIMELINE (CMake, off by default): where a decode CTA's time goes, stamped on the
// GPU. Thread 0 of every CTA reads the global nanosecond timer and its SM's cycle counter at the kernel's phase
// boundaries and stores them in the partial-output workspace, which the cluster merge leaves unused (only CTAs that
// merge in a cluster stamp: with the combine kernel the workspace holds real partials). The default build compiles
// every mark to nothing (tests/test_sm80_decode_sass.py checks that its SASS reads no timer).
// examples/bench/decode_timeline.py reads the stamps back (jax_msa._ffi.decode_call(return_workspace=True)).
//
// Per CTA (blockIdx.x = split, .y = KV head, .z = token; linear index (z * gridDim.y + y) * gridDim.x + x), 16 u64
// at float offset 32 * cta of partial_o: [0, 7) %globaltimer at each Phase (ns; comparable across SMs), [7] unused,
// [8, 15) clock64 at each Phase (cycles of this SM), [15] = smid << 32 | the CTA's chunk count.
#pragma once
#include <cstdint>

#include "common/params.h"

#ifndef JAX_MSA_DECODE_TIMELINE  // (CMake defines it as 1 when the build switch is on)
#define JAX_MSA_DECODE_TIMELINE 0
#endif

namespace jax_msa::sm80::decode {

enum class Phase : int {
  kEntry = 0,           // first instruction
  kChunkTable = 1,      // the split's chunk table in shared memory (top-k row, block table: both round trips done)
  kLoopDone = 2,        // warp 0 past its last chunk (cp.async drained)
  kWarpMerge = 3,       // the 4 warps merged; the CTA's partial in its shared memory
  kClusterBarrier = 4,  // every split of the cluster has its partial staged (barrier.cluster passed)
  kClusterMerge = 5,    // this CTA's slice of the rows merged and stored
  kExit = 6,            // the cluster's exit barrier passed
};
constexpr int kTimelineWords = 16;  // u64 a CTA

__device__ __forceinline__ void timeline_mark(const DecodeParams& p, bool merge_in_cluster, Phase phase,
                                              int chunks = -1) {
#if JAX_MSA_DECODE_TIMELINE
  if (threadIdx.x != 0 || !merge_in_cluster) return;
  uint64_t ns, cycles;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(cycles));
  const int64_t cta = (int64_t(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  uint64_t* slot = reinterpret_cast<uint64_t*>(p.partial_o) + cta * kTimelineWords;
  slot[int(phase)] = ns;
  slot[8 + int(phase)] = cycles;
  if (chunks >= 0) {
    uint32_t smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    slot[15] = (uint64_t(smid) << 32) | uint32_t(chunks);
  }
#else
  (void)p, (void)merge_in_cluster, (void)phase, (void)chunks;
#endif
}

}  // namespace jax_msa::sm80::decode
