// Debug build switch JAX_MSA_DECODE_TIMELINE (CMake, off by default): where a decode CTA's time goes, stamped on the
// GPU. Thread 0 of every stamped CTA reads the global nanosecond timer and its SM's cycle counter at the kernel's
// phase marks, keeps them in shared memory (a global store before the cluster barrier would lengthen the barrier's
// release fence, the phase being measured) and writes them at its end into the split workspace, which neither stamped
// kind of CTA uses for partials. Stamped: a CTA that merges its split inside a thread-block cluster (after the exit
// barrier), and the two-team CTA (config.h CtaShape: a (token, KV head)'s splits as the teams of one CTA, which writes
// the output itself; after its output store). With the combine kernel the workspace holds real partials: no stamps.
// The default build compiles every call here to nothing (tests/test_sm80_decode_sass.py checks that its SASS reads no
// timer). examples/bench/decode_timeline.py reads the stamps back (jax_msa._ffi.decode_call(return_workspace=True)).
//
// Per CTA (blockIdx.x = split, .y = KV head, .z = token; linear index (z * gridDim.y + y) * gridDim.x + x, so the
// CTAs of one cluster are consecutive; a two-team CTA's gridDim.x is 1), 32 u64 at float offset 64 * cta of partial_o
// (a CTA's share of the workspace is num_splits * group * 128 / gridDim.x >= 128 floats): [0, 7) %globaltimer at each
// Phase (ns; comparable across SMs), [7] kTimelineMagic, [8, 15) clock64 at each Phase (cycles of this SM), [15] =
// smid << 32 | team 0's chunk count, [16 + 8 p + w] %globaltimer when warp w (lane 0; w < 8: a two-team CTA has 8
// warps, the one-team CTA 4 and leaves w = 4..7 unused) reaches WarpPhase p. The Phase marks are thread 0's view: a
// phase ends when thread 0 (warp 0) reaches its mark; the WarpPhase marks show how far apart the warps are. A two-team
// CTA has no cluster phases: its kWarpMerge .. kExit stamps are one reading, after thread 0's output store.
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
  kLoopDone = 2,        // warp 0 past its last chunk (the query's wait and conversion, every chunk, cp.async drained)
  kWarpMerge = 3,       // the warps' partials merged (after waiting for the slowest warp) and thread 0's rows of
                        // the CTA's partial staged for the cluster (a two-team CTA: written to the output)
  kClusterBarrier = 4,  // every split of the cluster has its partial staged (barrier.cluster passed)
  kClusterMerge = 5,    // thread 0's units of this CTA's slice merged and stored (the other threads' tail falls
                        // into the exit barrier)
  kExit = 6,            // the cluster's exit barrier passed
};
constexpr int kPhases = 7;
// Per-warp marks (lane 0 of every warp): where the warps' merge waits for the slowest warp
enum class WarpPhase : int {
  kLoopDone = 0,  // the warp past its last chunk (cp.async drained)
  kStaged = 1,    // the warp's (m, l, O) written to the merge area, before the barrier that waits for every warp
};
constexpr int kTimelineWords = 32;                            // u64 a CTA
constexpr int kTimelineWarps = 8;                             // per-warp stamps a WarpPhase
constexpr uint64_t kTimelineMagic = 0x54494D454C494E45ull;  // "TIMELINE": word 7 of a stamped CTA
static_assert(int(Phase::kExit) + 1 == kPhases && kPhases <= 7 && 16 + 2 * kTimelineWarps <= kTimelineWords,
              "the stamp layout above");

#if JAX_MSA_DECODE_TIMELINE
__device__ __forceinline__ uint64_t* timeline_stamps() {
  __shared__ uint64_t stamps[kTimelineWords];  // one per CTA: every mark goes through this function
  return stamps;
}

// %tid.x read at each mark (volatile): a thread-0 predicate kept live across the main loop costs a register
__device__ __forceinline__ uint32_t timeline_tid() {
  uint32_t tid;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
  return tid;
}
#endif

// Phases first .. last (one reading: a CTA that skips the phases between them) of a stamped CTA, by thread 0
__device__ __forceinline__ void timeline_mark_through(bool stamped, Phase first, Phase last, int chunks = -1) {
#if JAX_MSA_DECODE_TIMELINE
  const uint32_t tid = timeline_tid();
  if (tid != 0 || !stamped) return;
  uint64_t ns, cycles;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(cycles));
  uint64_t* stamps = timeline_stamps();
  for (int phase = int(first); phase <= int(last); ++phase) {
    stamps[phase] = ns;
    stamps[8 + phase] = cycles;
  }
  if (chunks >= 0) {
    uint32_t smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    stamps[15] = (uint64_t(smid) << 32) | uint32_t(chunks);
  }
#else
  (void)stamped, (void)first, (void)last, (void)chunks;
#endif
}

__device__ __forceinline__ void timeline_mark(bool stamped, Phase phase, int chunks = -1) {
  timeline_mark_through(stamped, phase, phase, chunks);
}

__device__ __forceinline__ void timeline_warp_mark(bool stamped, WarpPhase phase) {
#if JAX_MSA_DECODE_TIMELINE
  const uint32_t tid = timeline_tid();
  if ((tid & 31) != 0 || !stamped || (tid >> 5) >= uint32_t(kTimelineWarps)) return;  // a three-team CTA's last 4 warps
  uint64_t ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  timeline_stamps()[16 + kTimelineWarps * int(phase) + int(tid >> 5)] = ns;
#else
  (void)stamped, (void)phase;
#endif
}

// After the last mark (kExit): thread 0 copies the CTA's stamps to the workspace (every warp's marks precede the
// barriers before it).
__device__ __forceinline__ void timeline_write(const DecodeParams& p, bool stamped) {
#if JAX_MSA_DECODE_TIMELINE
  if (threadIdx.x != 0 || !stamped) return;
  const uint64_t* stamps = timeline_stamps();
  const int64_t cta = (int64_t(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  uint64_t* slot = reinterpret_cast<uint64_t*>(p.partial_o) + cta * kTimelineWords;
  for (int i = 0; i < kTimelineWords; ++i) slot[i] = i == 7 ? kTimelineMagic : stamps[i];
#else
  (void)p, (void)stamped;
#endif
}

}  // namespace jax_msa::sm80::decode
