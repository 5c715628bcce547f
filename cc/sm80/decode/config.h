// Warp-MMA (sm_80+) sparse decode: traits (tiles, pipeline depth, shared-memory plan) per KV-cache format.
//
// Work unit (one CTA): query token t, KV head g, split s of t's valid selected blocks.
//   MMA rows  : the G <= 16 query heads of (t, g), zero padded to 16 (mma.sync m16n8k16, bf16 or f16 -> fp32)
//   pipeline  : chunks of 64 keys (half a block) of K and V, cp.async (zero-fill past the visible keys),
//               kStages deep. bf16 chunks are read by ldmatrix. FP8 and NVFP4 chunks stay raw in shared memory and
//               go straight into the MMA registers as f16 (the register path, kRegisterPath: exact hardware
//               e4m3 -> f16 conversion on sm_89+, e2m1 placed as f16 by bit operations; V transposed by movmatrix),
//               so their MMAs take f16 operands (kOperand; the query is scaled into f16 per row). On that path lane l
//               owns dims [32 (l % 4), +32) of Q, K and V (kRegisterDims): the MMA's k order over dims is permuted
//               (QK^T does not care) and the O accumulator's dims with it (undone in the epilogue)
//   query     : staged once per CTA in shared memory (coalesced cp.async into the last pipeline stage, which the
//               loop first fills at chunk 0); each warp reads its Q fragments from there. The fragments then stay in
//               registers, or (kQFragmentsInShared: FP8, whose 4 CTAs an SM leave 128 registers a thread) in a
//               4 KB shared copy the loop reads at every k-step
//   warps     : 4; warp w owns keys [16w, 16w + 16) of every chunk and keeps its own online softmax
//               (m, l, O); a warp also loads and dequantizes only its own rows, so the main loop has no
//               CTA-wide barrier; the 4 warps merge through shared memory at the end
//   output    : one split -> bf16 out and lse directly; several -> on sm_90+ the splits of a (token, KV head) run as
//               one thread-block cluster and merge through distributed shared memory (cluster_merge.cuh); else
//               fp32 partials + the combine kernel (combine_splits.cu). FP8 / NVFP4 with 2 splits: one CTA of two teams
//               of 4 warps, a split each, merged through its shared memory (CtaShape below), on every GPU that runs
//               these kernels; FP8's at two CTAs an SM when the (token, KV head) pairs outnumber the SMs (CtaLayout)
#pragma once
#include <cstdint>

#include "common/kv_format.h"
#include "sm80/common/register_budget.h"
#include "sm80/common/warp_mma.cuh"

namespace jax_msa::sm80::decode {

constexpr int kHeadDim = 128;
constexpr int kRows = 16;           // MMA M: query heads of one token
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kChunkKeys = 64;      // keys per pipeline stage
constexpr int kKeysPerWarp = kChunkKeys / kWarps;
constexpr int kMaxTopk = 32;        // a top-k row is compacted by one warp ballot
constexpr int kMaxChunks = 2 * kMaxTopk;
constexpr int kBf16RowBytes = kHeadDim * 2;              // 256 B: one key of K (or V) in bf16
constexpr int kBf16TileBytes = kChunkKeys * kBf16RowBytes;  // 16 KB: K (or V) of a chunk in bf16
constexpr int kQTileBytes = kRows * kHeadDim * 2;           // 4 KB: the query of (token, KV head), bf16 or FP8 rows

static_assert(kKeysPerWarp == 16, "each warp takes one k16 step of keys per chunk");

// Which dims of a row the MMA registers of lane l hold (K and V as the B operand, Q as the A operand, O's n order):
//   kMma            : the MMA's own order (ldmatrix path)
//   kLanePairs      : register path; lane l owns dims [32 (l % 4), +32), its register i holds dims 32 (l % 4) + 2 i, +1
//   kLaneSplitPairs : register path; register i = 4 j + r holds dims 32 (l % 4) + 8 j + r and + 4 (one byte permute
//                     places values r and r + 4 of an NVFP4 word, chunk_io.cuh)
enum class RegisterDims { kMma, kLanePairs, kLaneSplitPairs };

// The dim that half h (0: low) of register i (0..15) of lane `lane` holds on the register path
template <RegisterDims D>
__host__ __device__ constexpr int register_dim(int lane, int i, int h) {
  static_assert(D != RegisterDims::kMma, "the ldmatrix path's order is the MMA's");
  return D == RegisterDims::kLanePairs ? 32 * (lane & 3) + 2 * i + h : 32 * (lane & 3) + 8 * (i >> 2) + (i & 3) + 4 * h;
}

template <KvFormat F>
struct FormatTraits;

// kCtasPerSm sets the one-team kernel's register budget (__launch_bounds__) and, with kStages, its shared-memory plan
// (the team variant: kTeamStages a team, one CTA an SM; CtaShape below). FP8 runs 4 CTAs an SM (3 stages, Q fragments
// in shared memory): faster than 3 (4 stages, Q in registers) wherever it was measured (docs/BENCHMARKS.md, decode v8);
// NVFP4 at 4 (5 stages) was 3% slower (v7); bf16's 32 KB stages fit 2.
template <>
struct FormatTraits<KvFormat::kBf16> {
  static constexpr int kStages = 3;
  static constexpr int kStageBytes = 2 * kBf16TileBytes;  // K | V, swizzled bf16 (read by ldmatrix)
  static constexpr bool kRegisterPath = false;
  static constexpr RegisterDims kRegisterDims = RegisterDims::kMma;
  static constexpr int kCtasPerSm = 2;
  static constexpr bool kQFragmentsInShared = false;
  static constexpr MmaOperand kOperand = MmaOperand::kBf16;
  static constexpr int kTeamSplits = 0;  // no team variant (two teams' 3 x 32 KB stages would not fit 96 KB)
  static constexpr int kTeamStages = 0;
  static constexpr int kTwoPerSmTeamStages = 0;
  static constexpr int kThreeTeamStages = 0;
};

template <>
struct FormatTraits<KvFormat::kFp8> {
  static constexpr int kStages = 3;
  static constexpr int kStageBytes = 2 * kChunkKeys * kHeadDim;  // K | V, raw e4m3 rows of 128 B (units swizzled)
  static constexpr bool kRegisterPath = true;
  static constexpr RegisterDims kRegisterDims = RegisterDims::kLanePairs;  // one conversion a register
  static constexpr int kCtasPerSm = 4;
  static constexpr bool kQFragmentsInShared = true;  // 128 registers a thread: the 32 of Q would spill
  static constexpr MmaOperand kOperand = MmaOperand::kF16;  // decode; the prefill kernel converts to bf16
  // num_splits == kTeamSplits runs as one CTA of that many teams a (token, KV head) (CtaShape): no cluster phases;
  // each team kTeamStages deep
  static constexpr int kTeamSplits = 2;
  static constexpr int kTeamStages = 3;
  // CtaLayout::kTeamsTwoPerSm: the teams at two CTAs an SM (128 registers, Q fragments in shared memory), 2 stages a
  // team (2 x 2 x 16 KB + 4 KB); 3 (100 KB) would not fit sm_86 / sm_89 / sm_120 and were slower at 160-192 pairs
  static constexpr int kTwoPerSmTeamStages = 2;
  static constexpr int kThreeTeamStages = 0;  // HBM-bound at one CTA an SM already
};

template <>
struct FormatTraits<KvFormat::kNvfp4> {
  // K data 64x64 B | K scales 512 B | V data 64x64 B | V scales 512 B (slot byte order kept)
  static constexpr int kDataBytes = kChunkKeys * kHeadDim / 2;
  static constexpr int kScaleBytes = kChunkKeys * kHeadDim / 16;
  static constexpr int kStages = 7;
  static constexpr int kStageBytes = 2 * (kDataBytes + kScaleBytes);
  static constexpr bool kRegisterPath = true;
  static constexpr RegisterDims kRegisterDims = RegisterDims::kLaneSplitPairs;  // no conversion instruction
  static constexpr int kCtasPerSm = 3;
  static constexpr bool kQFragmentsInShared = false;
  static constexpr MmaOperand kOperand = MmaOperand::kF16;  // decode; the prefill kernel converts to bf16
  static constexpr int kTeamSplits = 2;   // as FP8's
  static constexpr int kTeamStages = 5;   // 2 teams x 5 x 9 KB = 90 KB
  static constexpr int kTwoPerSmTeamStages = 0;  // none: 128 registers would spill its value placement
  // CtaLayout::kThreeTeams: num_splits == 3 as three teams of one CTA, 12 warps an SM for the issue-bound
  // NVFP4 loop (the two-team CTA gives 8); 3 x 3 x 9 KB of stages, the 12 warps' merge area (96 KB) over them
  static constexpr int kThreeTeamStages = 3;
};

// How a CTA's warps share the work:
//   kOneTeam       : kWarps warps, one split a CTA (the kernel as described above).
//   kTeams         : FormatTraits::kTeamSplits teams of kWarps warps (when num_splits equals it): team t of the CTA
//                    runs split t of its (token, KV head) with its own chunk table and kTeamStages pipeline stages, as
//                    a one-team CTA would (NVFP4's one-team CTA has 7 stages, a team 5), and the CTA's kTeams x 4
//                    warps merge through its shared memory and write the output: two splits without the cluster
//                    barrier and the cluster merge. Its Q fragments stay in registers and its budget is one CTA an SM
//                    (256 threads, up to 255 registers), so its kTeams x kStages stages fit the 99 KB a block of
//                    sm_86 / sm_89 / sm_120 too.
//   kTeamsTwoPerSm : the same teams budgeted for two CTAs an SM (128 registers: the Q fragments in shared memory,
//                    kTwoPerSmTeamStages stages a team), launched instead of kTeams when the (token, KV head) pairs
//                    outnumber the SMs, so that up to twice the SM count of team CTAs run as one wave (FP8). The same
//                    arithmetic in the same order as kTeams: the same output bits (a fixed num_splits stays
//                    batch-invariant).
//   kThreeTeams    : three teams (num_splits == 3), one CTA an SM, Q fragments in registers, 384 threads
//                    (168 registers at most), kThreeTeamStages stages a team
enum class CtaLayout : int { kOneTeam = 1, kTeams = 2, kTeamsTwoPerSm = 3, kThreeTeams = 4 };

template <KvFormat F, CtaLayout L>
struct CtaShape {
  using T = FormatTraits<F>;
  static_assert(L == CtaLayout::kOneTeam || T::kTeamSplits > 1, "the team variant of a format that has one");
  static_assert(L != CtaLayout::kTeamsTwoPerSm || T::kTwoPerSmTeamStages > 0, "a format with a two-an-SM team CTA");
  static_assert(L != CtaLayout::kThreeTeams || T::kThreeTeamStages > 0, "a format with a three-team CTA");
  static constexpr int kTeams = L == CtaLayout::kOneTeam ? 1 : L == CtaLayout::kThreeTeams ? 3 : T::kTeamSplits;
  static constexpr int kWarpsPerCta = kTeams * kWarps;
  static constexpr int kThreadsPerCta = kWarpsPerCta * 32;
  static constexpr bool kQFragmentsInShared =
      L == CtaLayout::kOneTeam ? T::kQFragmentsInShared : L == CtaLayout::kTeamsTwoPerSm;
  static constexpr int kCtasPerSm = L == CtaLayout::kOneTeam ? T::kCtasPerSm : L == CtaLayout::kTeamsTwoPerSm ? 2 : 1;
  // pipeline stages of a team (of the CTA when kOneTeam)
  static constexpr int kStages = L == CtaLayout::kOneTeam ? T::kStages
                                 : L == CtaLayout::kTeams ? T::kTeamStages
                                 : L == CtaLayout::kThreeTeams ? T::kThreeTeamStages
                                                               : T::kTwoPerSmTeamStages;
  static_assert(kStages >= 2, "a pipeline: the chunk being read and the one being loaded");
  // a team's chunk table: its share of at most kMaxTopk blocks, two chunks each
  static constexpr int kMaxTeamChunks = 2 * ((kMaxTopk + kTeams - 1) / kTeams);
  // the warps' merge: each of the first kMergeThreads threads one row and kMergeDims consecutive dims of it (a
  // three-team CTA's last 128 threads take no part)
  static constexpr int kMergeThreads = kThreadsPerCta < 256 ? kThreadsPerCta : 256;
  static constexpr int kMergeDims = kRows * kHeadDim / kMergeThreads;
  static_assert(kMergeDims % 8 == 0, "whole 16-byte bf16 stores");
};

// Shared-memory plan: [stages | Q fragments (kQFragmentsInShared)] dynamic; the chunk table and the merge
// statistics are static arrays
template <KvFormat F, CtaLayout L = CtaLayout::kOneTeam>
struct SharedPlan {
  using T = FormatTraits<F>;
  using Shape = CtaShape<F, L>;
  static constexpr int kStagesOffset = 0;
  static constexpr int kTeamStageBytes = Shape::kStages * T::kStageBytes;  // team t's stages at t x this
  static constexpr int kStageAreaBytes = Shape::kTeams * kTeamStageBytes;
  // 8 k-steps x 32 lanes x 16 B (4 registers of the A operand): the warps' common Q fragments
  static constexpr int kQFragmentOffset = kStagesOffset + kStageAreaBytes;
  static constexpr int kQFragmentBytes = Shape::kQFragmentsInShared ? 8 * 32 * 16 : 0;
  // The epilogue reuses the stage area (and beyond it, for a three-team CTA) for the warps' fp32 partial outputs
  static constexpr int kMergeBytes = Shape::kWarpsPerCta * kRows * kHeadDim * 4;
  static constexpr int kBytes =
      kQFragmentOffset + kQFragmentBytes > kMergeBytes ? kQFragmentOffset + kQFragmentBytes : kMergeBytes;
  // The prologue stages the query tile in team 0's last pipeline stage, which its main loop first fills at chunk 0.
  static constexpr int kQueryTileOffset = kStagesOffset + (Shape::kStages - 1) * T::kStageBytes;
  static_assert(T::kStageBytes >= kQTileBytes && T::kStageBytes % 16 == 0, "the query tile fits the last stage");
  // The epilogue reuses the stage area for the warps' fp32 partial outputs (and the cluster merge then for the slice
  // it gathers from the splits: cluster_merge.cuh's ClusterGather).
  static_assert(kStageAreaBytes >= kMergeBytes || L == CtaLayout::kThreeTeams,
                "merge area must fit in the reused stages");
  static_assert(kStageAreaBytes >= kMergeBytes || !Shape::kQFragmentsInShared,
                "a merge area past the stages would overwrite the shared Q fragments");
  // The cluster merge (cluster_merge.cuh) stages the CTA's partial after the merge area: 16 x 128 fp32 + 16 lse.
  static constexpr int kClusterPartialOffset = kMergeBytes;
  static constexpr int kClusterPartialBytes = kRows * kHeadDim * 4 + kRows * 4;
  static_assert(Shape::kTeams > 1 || kClusterPartialOffset + kClusterPartialBytes <= kStageAreaBytes,
                "the cluster partial fits the stages (the team variant has no cluster merge)");
  // What one CTA takes of an SM's shared memory: the dynamic bytes, a few KB of static arrays and the driver's reserve
  static constexpr int kSmFootprintBytes = kBytes + 3 * 1024;
  // kCtasPerSm CTAs an SM on sm_90 / sm_100
  static_assert(Shape::kCtasPerSm * kSmFootprintBytes <= kSm90SharedBytes, "kCtasPerSm CTAs fit an SM's shared memory");
  // <= 96 KB dynamic + a few KB of static arrays: within the 99 KB per-block limit of sm_86 / sm_89 / sm_120,
  // so the same kernels launch on every sm_80+ GPU.
  static_assert(kBytes <= 96 * 1024, "fits every sm_80+ GPU");
};

// The CTAs an SM the kernel's registers are budgeted for (__launch_bounds__' second argument): kCtasPerSm, capped by
// what the shared memory of the architecture being compiled holds (register_budget.h), so that a GPU which can never
// run kCtasPerSm of them does not get their register cap (FP8's 4 CTAs an SM would spill on sm_120, where one fits).
// On sm_90 and sm_100 it is kCtasPerSm.
template <KvFormat F, CtaLayout L = CtaLayout::kOneTeam>
constexpr int register_budget_ctas() {
  return sm80::register_budget_ctas(CtaShape<F, L>::kCtasPerSm, SharedPlan<F, L>::kSmFootprintBytes);
}

}  // namespace jax_msa::sm80::decode
