// SM90 sparse prefill (KV-block-major over the jnp plan): traits and shared-memory plan.
//
// Work unit (one CTA): one work item of the plan = (KV head g, request b, block blk, <= 128 / G query tokens
// that selected the block). The block's K and V (128 keys) are loaded once, by all 8 warps (warp w loads
// keys [16 (w % 4), +16) of half w / 4 with the decode kernel's chunk loaders), dequantized to bf16 for
// FP8 / NVFP4, and shared by every query of the tile.
//   MMA rows : tile row R = i * G + h (query i of the tile, head h of the group), 16 rows a warp, mma.sync
//              m16n8k16 bf16 -> fp32 (8 warps = 128 rows = 8 tokens x 16 heads for M3)
//   softmax  : per warp over the two 64-key halves (online), causal mask per row (key <= position)
//   output   : one normalized partial (O fp32, lse) per (query, selected block) at the plan's rank slot; the
//              combine kernel merges each query's partials by log-sum-exp
#pragma once
#include "common/kv_format.h"
#include "sm90/decode/config.h"

namespace jax_msa::sm90::prefill {

using decode::FormatTraits;
using decode::kBf16TileBytes;
using decode::kChunkKeys;
using decode::kHeadDim;
using decode::kKeysPerWarp;

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerWarp = 16;
constexpr int kTileRows = kWarps * kRowsPerWarp;  // 128 MMA rows: queries_per_tile * G <= 128
constexpr int kMaxTileQueries = 128;              // G = 1 packs 128 queries

// Shared memory: [half 0 raw | half 1 raw] then, when dequantizing, [half 0 bf16 | half 1 bf16].
template <KvFormat F>
struct SharedPlan {
  using T = FormatTraits<F>;
  static constexpr int kRawHalfBytes = T::kStageBytes;  // one 64-key chunk in cache format
  static constexpr int kTileOffset = T::kNeedsDequant ? 2 * kRawHalfBytes : 0;
  static constexpr int kTileHalfBytes = 2 * kBf16TileBytes;  // K | V of 64 keys in swizzled bf16
  static constexpr int kBytes = kTileOffset + 2 * kTileHalfBytes;  // bf16: the raw halves are the tiles
};

}  // namespace jax_msa::sm90::prefill
