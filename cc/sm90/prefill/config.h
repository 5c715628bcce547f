// Hopper (sm_90a) sparse prefill, KV-block-major over the jnp plan: traits, shared-memory plan, MMA atoms, barriers.
//
// Work unit: one plan work item = (KV head g, request b, block blk, <= 128 / G query tokens that selected the block),
// the same items the warp-MMA prefill (cc/sm80/prefill) serves; bf16, FP8 or NVFP4 KV with bf16
// queries and G in {8, 16} come here (prefill_supports), everything else keeps the warp-MMA kernels.
//
//   CTA      : persistent, one an SM (grid = min(SMs, work capacity)); CTA c takes the contiguous range
//              [c n / grid, (c + 1) n / grid) of the n items (ItemRange), so its consecutive items are mostly chunks
//              of one (head, block) and a stage keeps its K / V (below). Three warpgroups. Warpgroup 0: warp 0 is
//              the producer (reads the next item's queries from the plan while the current one loads, then
//              TMA-loads the tile's G query rows a token and the block into a stage); for FP8 and NVFP4 warps 1-3
//              are converters (the block's raw K and V bytes -> the stage's bf16 tiles).
//              Warpgroups 1 and 2 are consumers (tile rows [64 (wg - 1), +64) each: 4 tokens x 16 heads for M3).
//   pipeline : kStages stages of [Q tile | K | V]. Q|K and V have their own full / empty barriers: a stage's Q|K is
//              refilled as soon as the consumers' S = Q K^T is done, its V once O = P V is done (bf16: the producer
//              loads an item's V after the next item's Q|K, so a Q|K never waits behind a V stage). A stage whose K / V
//              already hold the item's block (its previous item, kStages items back, had the same cache page, KV
//              head and keys in the request) keeps them: only the queries are loaded (FP8 / NVFP4: nothing is
//              converted), and the barriers run their usual phases.
//   MMA      : S = Q K^T by wgmma m64n64k16 (both operands in shared memory, K-major) for both 64-key halves of the
//              block (keys nobody sees are masked); O = P V by wgmma m64n128k16 with P from registers and V MN-major
//              (the same K-major tile viewed as dims x keys). The consumers are software-pipelined across items
//              (FA3's intra-warpgroup overlap): item j + 1's S runs while item j - 1's partials are stored, item j's
//              O while item j + 1's softmax runs (setmaxnreg: the consumers take the producer warpgroup's registers).
//              Build-time experiment (kConsumerPingPong, off; within 2% of the default before this pipeline): the two
//              consumer warpgroups take turns through an iteration's S issue, partial stores and O issue
//   softmax  : over the whole block at once (both halves' S are in registers, exponentiated in place), 2^x by
//              ex2.approx; keys a row does not see (diagonal and last blocks, rows past the tile's tokens, invalid
//              pages) set to -inf by a select (skipped by a warp whose rows all see the whole block), the max over
//              the raw scores and the scale in one FFMA a score, the same arithmetic for every row whatever its
//              warp-mates see (batch invariance: G = 8 puts two tokens in a warp); a non-positive scale (the whole
//              call's) scales each score, then masks
//   output   : one normalized bf16 partial (and its lse) per (query, selected block) at the plan's rank slot, as the
//              warp-MMA kernel writes them; the warp-MMA combine (sm80/prefill/combine_partials.cu) merges them.
//              Build-time experiment (kBulkPartialStores, off; bf16): rows staged in shared memory, one bulk copy a
//              token.
//              FP8: the tiles hold the raw e4m3 values (exact in bf16); NVFP4: e2m1 x its e4m3 block scale (exact
//              in bf16). k_scale is folded into the softmax scale and v_scale into the normalization.
#pragma once
#include <cstdint>

#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <type_traits>

#include "common/kv_format.h"

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
static_assert(kBlockKeys < 256, "the producer's stage key packs the block's keys into 8 bits");
constexpr int kConverterWarps = 3;  // FP8 / NVFP4: warps 1-3 of the producer warpgroup

// Consumer ping-pong, a build-time experiment (CMake JAX_MSA_SM90_PREFILL_PINGPONG=ON; off by default; on the H200,
// before the consumers' pipeline across items, it passed the small prefill tests and measured within 2% of the
// default): consumer warpgroup i waits on named barrier kConsumerTurn + i (ids past CUTLASS's reserved ones) before
// it issues an iteration's next S, and again before this item's O, and arrives on the other's after each, so the
// tensor cores run S0 S1 O0 O1 ... and one warpgroup's softmax runs while the other's MMAs occupy them. Since the
// twenty-first session the turns are split around S and around O (the partial stores and the V wait outside them);
// this version compiles and passes its SASS test but has not run on a GPU.
#ifndef JAX_MSA_SM90_PREFILL_PINGPONG
#define JAX_MSA_SM90_PREFILL_PINGPONG 0
#endif
constexpr bool kConsumerPingPong = JAX_MSA_SM90_PREFILL_PINGPONG != 0;
constexpr uint32_t kConsumerTurn = 0;                                 // + consumer warpgroup (0, 1)
constexpr uint32_t kConsumerTurnThreads = kConsumerWarpgroups * 128;  // both consumer warpgroups

// Bulk partial stores, a build-time experiment (CMake JAX_MSA_SM90_PREFILL_BULK_STORE=ON; off by default; compiled and
// SASS-tested, not yet run on a GPU): bf16 KV and fragment-order partials only. Each consumer warp writes its 16
// normalized partial rows (one token for G = 16, two for G = 8) into its 4 KB of shared memory and one lane copies each
// token's G rows, consecutive slots, to the partials with one cp.async.bulk (CuTe's SM90_BULK_COPY_S2G; the fence and
// the final wait in bulk_store.cuh), instead of eight 16-byte global stores a thread (the partial stores held a quarter
// of the consumers' samples in the v6 profile, BENCHMARKS "Against the goal", lever 2). The buffers take 32 KB
// of the ~33 KB bf16 leaves free; FP8 / NVFP4 have no room (their raw buffers).
#ifndef JAX_MSA_SM90_PREFILL_BULK_STORE
#define JAX_MSA_SM90_PREFILL_BULK_STORE 0
#endif

// The cache formats whose blocks the converter warps turn into bf16 tiles.
template <KvFormat F>
constexpr bool kConverted = F != KvFormat::kBf16;
// Registers a thread after setmaxnreg: the producer warpgroup gives, the consumers take (S 64 + O 64 + P 32 fp32/bf16
// registers live across the overlap). The producer keeps the next item's plan entries and (bf16) the previous item's
// pending V load, the converters their tiles' addresses (at 40 the bf16 producer spilled). setmaxnreg moves registers
// inside the pool the CTA was launched with (kLaunchRegisters a thread, from __launch_bounds__(kThreads, 1)), so the
// split must fit that pool, not 64K: a consumer request beyond it never completes (setmaxnreg.inc waits forever; seen
// on the H200 with 48 / 232).
constexpr int kLaunchRegisters = (65536 / kThreads) / 8 * 8;  // 168
constexpr int kProducerRegisters = 56;   // every format since v6
constexpr int kConsumerRegisters = 224;
static_assert(kWarpgroupThreads * (kProducerRegisters + kConsumerWarpgroups * kConsumerRegisters) <=
                  kThreads * kLaunchRegisters,
              "the setmaxnreg split must fit the pool the CTA launches with");

constexpr int kRowBytes = kHeadDim * 2;                      // one bf16 row of 128 dims
constexpr int kColumnHalfBytes = kBlockKeys * 128;           // one 64-dim column half of a 128-row tile (16 KB)
constexpr int kTileBytes = kTileRows * kRowBytes;            // 32 KB: Q tile, K tile, V tile alike
// Raw bytes of one block's K (or V) as the producer loads them for the converters.
template <KvFormat F>
constexpr int kRawTileBytes = F == KvFormat::kNvfp4 ? int(Nvfp4Slot{kHeadDim}.slot_bytes())  // data | scales, 9 KB
                                                    : kBlockKeys * kHeadDim;  // FP8: 128 e4m3 rows, 16 KB


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

// The work items of one CTA: a contiguous range of the plan's work list, split evenly by count over the grid (the items
// are tiles of equal cost). Producer, converters and consumers walk the same range.
struct ItemRange {
  int begin, end;
  static __device__ __forceinline__ ItemRange of_cta(int n_items) {
    return {int(int64_t(n_items) * blockIdx.x / gridDim.x), int(int64_t(n_items) * (blockIdx.x + 1) / gridDim.x)};
  }
};

// The tile's queries, written by the producer warp per stage, read by the consumers after the Q|K full barrier.
struct TileMeta {
  int query[kMaxTokens];    // token
  int rank[kMaxTokens];     // partial slot of this block among the token's selected blocks
  int visible[kMaxTokens];  // keys of the block the token sees (causal; 0 when the page is invalid)
  int head;                 // KV head g
  int count;                // tokens in the tile
  int visible_max;          // keys any token sees: 0 = nothing loaded for this item (the stage keeps what it held);
                            // no longer read by the consumers (v6), kept so the layout stays the one measured
};

struct alignas(1024) SharedStorage {
  struct alignas(1024) Stage {
    uint8_t q[kTileBytes];  // query rows R = i * G + h (token i of the tile, head h of the group)
    uint8_t k[kTileBytes];  // keys of the block
    uint8_t v[kTileBytes];  // values of the block
  } stage[kStages];
  TileMeta meta[kStages];
  uint64_t qk_full[kStages];   // -> consumers: meta written, Q and K landed (producer arrival + TMA bytes; FP8 / NVFP4:
                               // + one arrival per converter warp once K is written)
  uint64_t qk_empty[kStages];  // consumers -> producer (and converters): S done, Q and K free (one arrival a consumer
                               // warp)
  uint64_t v_full[kStages];    // -> consumers: V landed (bf16: producer arrival + TMA bytes; else the converters)
  uint64_t v_empty[kStages];   // consumers -> producer (and converters): O done, V free
  uint64_t v_landed[kStages];  // bf16, a block that ends inside its page: TMA -> producer, which zeroes the V rows past
                               // the request (0 * NaN would poison O) before it arrives on v_full
};

// FP8 / NVFP4 KV: the block's raw K and V bytes land in raw[0] and raw[1] (FP8: 128 e4m3 rows x 128 B each, TMA
// without swizzle; NVFP4: the head's K and V cache slots, 9 KB each, one bulk copy each); the converter warps write
// them as bf16 into a stage's K and V tiles. Each raw buffer is refilled as soon as it is converted, so the next
// block's K bytes load while this block's V is converted.
template <KvFormat F>
struct alignas(1024) RawStorage {
  SharedStorage s;
  alignas(128) uint8_t raw[2][kRawTileBytes<F>];
  uint64_t raw_full[2];   // producer arrival + TMA bytes -> converters
  uint64_t raw_empty[2];  // converters -> producer (one arrival a converter warp)
  int raw_load[2];        // the raw buffer holds a block to convert (0: nobody sees the block, or the stage already
                          // holds it)
  int raw_n_keys[2];      // keys of the buffer's block inside the request (rows past it are written as zeros; FP8 K:
                          // converted and masked)
};

// bf16 with bulk partial stores: each consumer warp's 16 partial rows (16 x 256 B, row k of the warp at k x 256 B, the
// columns in fragment order) staged for their bulk copies.
template <KvFormat F>
constexpr bool kBulkPartialStores = JAX_MSA_SM90_PREFILL_BULK_STORE != 0 && F == KvFormat::kBf16;
constexpr int kWarpPartialRows = 16;
constexpr int kWarpPartialBytes = kWarpPartialRows * kRowBytes;  // 4 KB

struct alignas(1024) BulkStoreStorage {
  SharedStorage s;
  alignas(128) uint8_t partial[kConsumerWarps][kWarpPartialBytes];
};

template <KvFormat F>
using Storage = std::conditional_t<kConverted<F>, RawStorage<F>,
                                   std::conditional_t<kBulkPartialStores<F>, BulkStoreStorage, SharedStorage>>;

template <KvFormat F>
constexpr int kSmemBytes = int(sizeof(Storage<F>)) + 1024;  // + slack to align the dynamic base to 1 KB
static_assert(kSmemBytes<KvFormat::kBf16> <= 227 * 1024 && kSmemBytes<KvFormat::kFp8> <= 227 * 1024 &&
                  kSmemBytes<KvFormat::kNvfp4> <= 227 * 1024,
              "one CTA an SM (sm_90 / sm_100 shared memory)");

}  // namespace jax_msa::sm90::prefill
