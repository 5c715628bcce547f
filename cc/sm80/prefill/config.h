// Warp-MMA (sm_80+) sparse prefill (KV-block-major over the jnp plan): traits and shared-memory plan.
//
// Work unit (one CTA): one work item of the plan = (KV head g, request b, block blk, <= 128 / G query tokens
// that selected the block). The block's K and V (128 keys) are loaded once, by all 8 warps (warp w loads
// keys [16 (w % 4), +16) of half w / 4 with the decode kernel's chunk loaders), dequantized to bf16 for
// FP8 / NVFP4, and shared by every query of the tile.
//   MMA rows : tile row R = i * G + h (query i of the tile, head h of the group), 16 rows a warp, mma.sync
//              m16n8k16 bf16 -> fp32 (8 warps = 128 rows = 8 tokens x 16 heads for M3); the query tile is
//              gathered into shared memory (cp.async) and read with ldmatrix, so that a thread holds only its
//              O accumulator (64 fp32) and one 32-key slice of scores: <= 128 registers, two CTAs an SM on sm_90 /
//              sm_100, one CTA's loads overlapping the other's MMAs (one CTA elsewhere: register_budget_ctas)
//   softmax  : per warp over 32-key slices of the block (online), causal mask per row (key <= position)
//   output   : one normalized partial (O fp32, lse) per (query, selected block) at the plan's rank slot; the
//              combine kernel merges each query's partials by log-sum-exp
#pragma once
#include "common/kv_format.h"
#include "sm80/common/register_budget.h"
#include "sm80/decode/config.h"

namespace jax_msa::sm80::prefill {

using decode::FormatTraits;
using decode::kBf16TileBytes;
using decode::kChunkKeys;
using decode::kHeadDim;
using decode::kKeysPerWarp;

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerWarp = 16;
constexpr int kTileRows = kWarps * kRowsPerWarp;  // 128 MMA rows: queries_per_tile * G <= 128
constexpr int kSliceKeys = 32;                    // keys of one softmax / MMA step
constexpr int kCtasPerSm = 2;

// Shared memory: [K|V half 0 bf16 | K|V half 1 bf16 | query tile bf16 (128 rows x 256 B, swizzled)].
// FP8 / NVFP4 blocks are staged raw in the query tile's region, dequantized into the K|V tiles, and only
// then is the query tile loaded (bf16 blocks and the query tile load together).
template <KvFormat F>
struct SharedPlan {
  using T = FormatTraits<F>;
  static constexpr bool kDequantized = F != KvFormat::kBf16;  // staged raw, then converted into the bf16 tiles
  static constexpr int kTileHalfBytes = 2 * kBf16TileBytes;  // K | V of 64 keys in swizzled bf16
  static constexpr int kQueryOffset = 2 * kTileHalfBytes;
  static constexpr int kQueryBytes = kTileRows * kHeadDim * 2;
  static constexpr int kRawOffset = kDequantized ? kQueryOffset : 0;  // bf16: the raw halves are the tiles
  static constexpr int kRawHalfBytes = kDequantized ? T::kStageBytes : kTileHalfBytes;
  static constexpr int kBytes = kQueryOffset + kQueryBytes;
  static_assert(!kDequantized || 2 * T::kStageBytes <= kQueryBytes, "raw block fits the query region");
  // What one CTA takes of an SM's shared memory: the dynamic bytes, the static arrays (the tile's queries, NVFP4's
  // decode table: < 3 KB) and the driver's 1 KB reserve
  static constexpr int kSmFootprintBytes = kBytes + 4 * 1024;
  static_assert(kCtasPerSm * kSmFootprintBytes <= kSm90SharedBytes, "two CTAs an SM on sm_90 / sm_100");
  // <= 96 KB dynamic + a few KB of static arrays: within the 99 KB per-block limit of sm_86 / sm_89 / sm_120,
  // so the same kernels launch on every sm_80+ GPU.
  static_assert(kBytes <= 96 * 1024, "fits every sm_80+ GPU");
};

// Opt-in, unverified (JAX_MSA_PREFILL_PIPELINED=1, bf16 KV only): persistent CTAs, one an SM, that load the next
// work item's block and query tile (cp.async) while attending the current one. Two stages of [K|V bf16 | query tile].
struct PipelinedPlan {
  static constexpr int kStageBytes = SharedPlan<KvFormat::kBf16>::kBytes;  // 96 KB
  static constexpr int kStages = 2;
  static constexpr int kBytes = kStages * kStageBytes;
  static_assert(kBytes <= 227 * 1024 - 4096, "two stages in one CTA (sm_80 / sm_90 / sm_100 shared memory)");
};

// The CTAs an SM the kernel's registers are budgeted for (__launch_bounds__' second argument): kCtasPerSm on sm_90 /
// sm_100; one on sm_80, sm_86, sm_89 and sm_120, whose shared memory holds one CTA of ~100 KB (register_budget.h), so
// that those do not spill under a two-CTA register cap they can never use.
template <KvFormat F>
constexpr int register_budget_ctas() {
  return sm80::register_budget_ctas(kCtasPerSm, SharedPlan<F>::kSmFootprintBytes);
}

}  // namespace jax_msa::sm80::prefill
