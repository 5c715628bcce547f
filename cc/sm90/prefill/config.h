// Hopper (sm_90a) sparse prefill, KV-block-major over the jnp plan: traits, shared-memory plan, MMA atoms, barriers.
//
// Work unit: one plan work item = (KV head g, request b, block blk, <= 128 / G query tokens that selected the block),
// the same items the warp-MMA prefill (cc/sm80/prefill) serves; only bf16 KV and bf16 queries with G in {8, 16} come
// here (prefill_supports), everything else keeps the warp-MMA kernels.
//
//   CTA      : persistent, one an SM (grid = min(SMs, work capacity); CTA c takes items c, c + grid, ...), three
//              warpgroups: warpgroup 0 is the producer (one warp: the tile's queries from the plan, then TMA loads of
//              K, V (128 keys x 256 B each, two 64-dim column halves) and of each token's G query rows into a stage),
//              warpgroups 1 and 2 are consumers (tile rows [64 (wg - 1), +64) each: 4 tokens x 16 heads for M3)
//   pipeline : kStages stages of [Q tile | K | V], full barriers (TMA transaction bytes) and empty barriers (one arrival
//              per consumer warp once its last wgmma has read the stage); the producer runs up to kStages - 1 items
//              ahead, so loads overlap the consumers' MMAs and their partial stores
//   MMA      : S = Q K^T by wgmma m64n64k16 (both operands in shared memory, K-major) for both 64-key halves of the
//              block (keys nobody sees are masked); O = P V by wgmma m64n128k16 with P from registers and V MN-major (the same K-major tile viewed
//              as dims x keys). A consumer issues the next item's S before it waits for this item's O, so the tensor
//              cores work while it stores this item's partials (setmaxnreg: 232 registers a consumer thread)
//   softmax  : over the whole block at once (both halves' S are in registers), causal mask per row (key < visible)
//   output   : one normalized bf16 partial (and its lse) per (query, selected block) at the plan's rank slot, as the
//              warp-MMA kernel writes them; the warp-MMA combine (sm80/prefill/combine_partials.cu) merges them
#pragma once
#include <cstdint>

#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>

namespace jax_msa::sm90::prefill {

constexpr int kHeadDim = 128;
constexpr int kBlockKeys = 128;  // one block = one page
constexpr int kHalfKeys = 64;    // keys of one S = Q K^T step
constexpr int kTileRows = 128;   // MMA rows of a work item: tokens x G
constexpr int kWarpgroupThreads = 128;
constexpr int kConsumerWarpgroups = 2;
constexpr int kConsumerRows = kTileRows / kConsumerWarpgroups;  // 64: one wgmma M
constexpr int kThreads = kWarpgroupThreads * (1 + kConsumerWarpgroups);
constexpr int kConsumerWarps = kConsumerWarpgroups * 4;
constexpr int kStages = 2;
constexpr int kMaxTokens = 16;  // tokens of a tile: 128 / G for G in {8, 16}
// Registers a thread after setmaxnreg: the producer warpgroup gives, the consumers take (S 64 + O 64 + P 32 fp32/bf16
// registers live across the overlap); 128 * 40 + 256 * 232 <= 64K.
constexpr int kProducerRegisters = 40;
constexpr int kConsumerRegisters = 232;
static_assert(kWarpgroupThreads * (kProducerRegisters + kConsumerWarpgroups * kConsumerRegisters) <= 65536);

constexpr int kRowBytes = kHeadDim * 2;                      // one bf16 row of 128 dims
constexpr int kColumnHalfBytes = kBlockKeys * 128;           // one 64-dim column half of a 128-row tile (16 KB)
constexpr int kTileBytes = kTileRows * kRowBytes;            // 32 KB: Q tile, K tile, V tile alike
constexpr int kKvBytes = 2 * kBlockKeys * kRowBytes;         // K and V of one block: 64 KB of transaction bytes


using Element = cute::bfloat16_t;

// [128 rows][128 dims] bf16, K-major, 128-byte swizzle: two column halves of 128 rows x 128 B, rows 16-byte units
// XORed with row % 8. The layout TMA writes with CU_TENSOR_MAP_SWIZZLE_128B (box 64 x rows) and wgmma reads.
using TileLayout =
    decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<Element>{}, cute::Shape<cute::_128, cute::_128>{}));
// The V tile viewed as (dims, keys): the MN-major B operand of O = P V.
using VtLayout = decltype(cute::composition(
    TileLayout{}, cute::make_layout(cute::Shape<cute::_128, cute::_128>{}, cute::Stride<cute::_128, cute::_1>{})));

using MmaS = decltype(cute::make_tiled_mma(
    cute::SM90_64x64x16_F32BF16BF16_SS<cute::GMMA::Major::K, cute::GMMA::Major::K>{}));
using MmaO = decltype(cute::make_tiled_mma(
    cute::SM90_64x128x16_F32BF16BF16_RS<cute::GMMA::Major::K, cute::GMMA::Major::MN>{}));

// The tile's queries, written by the producer warp per stage, read by the consumers after the full barrier.
struct TileMeta {
  int query[kMaxTokens];    // token
  int rank[kMaxTokens];     // partial slot of this block among the token's selected blocks
  int visible[kMaxTokens];  // keys of the block the token sees (causal; 0 when the page is invalid)
  int count;                // tokens in the tile
  int visible_max;          // keys any token sees: 0 = nothing was loaded
  int n_keys;               // keys of the block inside the request (the producer zeroes the V rows past it)
};

struct alignas(1024) SharedStorage {
  struct alignas(1024) Stage {
    uint8_t q[kTileBytes];  // query rows R = i * G + h (token i of the tile, head h of the group)
    uint8_t k[kTileBytes];  // keys of the block
    uint8_t v[kTileBytes];  // values of the block
  } stage[kStages];
  TileMeta meta[kStages];
  uint64_t full[kStages];   // producer -> consumers: meta written, TMA bytes landed (arrival count 1 + bytes)
  uint64_t empty[kStages];  // consumers -> producer: the stage is free (one arrival per consumer warp)
  uint64_t landed[kStages]; // TMA -> producer, for a block that ends inside its page: the producer zeroes V past the
                            // request, then arrives on full

};

constexpr int kSmemBytes = int(sizeof(SharedStorage)) + 1024;  // + slack to align the dynamic base to 1 KB
static_assert(kSmemBytes <= 227 * 1024, "one CTA an SM (sm_90 / sm_100 shared memory)");

}  // namespace jax_msa::sm90::prefill
