// Hopper (sm_90a) sparse prefill kernel: a persistent, warp-specialized CTA (see config.h) = a TMA producer warp that
// stages each work item's block and query tile (FP8 / NVFP4: plus three warps converting the block to bf16), and two
// wgmma consumer warpgroups that attend the tile's 128 rows over the block and write one normalized partial and its lse
// per (query, selected block). Reads the plan only through PlanView; included by prefill_bf16.cu, prefill_fp8.cu and
// prefill_nvfp4.cu, one instantiation each.
#pragma once
#include <cuda_bf16.h>

#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "common/params.h"
#include "common/partial_order.h"
#include "common/plan_view.h"
#include "cuda/exp2_approx.cuh"
#include "cuda/prefill_work_item.cuh"
#include "cuda/shared_memory.cuh"
#include "sm80/common/register_pack.cuh"
#include "sm80/common/warp_mma.cuh"
#include "sm90/prefill/bulk_store.cuh"
#include "sm90/prefill/config.h"
#include "sm90/prefill/convert_tiles.cuh"
#include "sm90/prefill/prefill.h"

namespace jax_msa::sm90::prefill {

using cutlass::arch::ClusterBarrier;
using cutlass::arch::ClusterTransactionBarrier;

// The dynamic shared memory, its base rounded up to 1 KB in the shared address space (cuda/shared_memory.cuh).
template <KvFormat F>
__device__ __forceinline__ Storage<F>& shared_storage(uint8_t* raw) {
  return *reinterpret_cast<Storage<F>*>(cuda::align_shared<1024>(raw));
}

__device__ __forceinline__ SharedStorage& shared_part(SharedStorage& s) { return s; }
template <KvFormat F>
__device__ __forceinline__ SharedStorage& shared_part(RawStorage<F>& f) {
  return f.s;
}
__device__ __forceinline__ SharedStorage& shared_part(BulkStoreStorage& b) { return b.s; }

// The consumer warps' partial staging buffers (kBulkPartialStores), else null.
template <KvFormat F>
__device__ __forceinline__ uint8_t* partial_buffers(Storage<F>& storage) {
  if constexpr (kBulkPartialStores<F>)
    return storage.partial[0];
  else
    return nullptr;
}

constexpr uint64_t kEvictNormal = uint64_t(cute::TMA::CacheHintSm90::EVICT_NORMAL);

// Rows [n_keys, 128) of a stage's V tile: zero (whatever the page holds past the request; the warp's 32 lanes).
__device__ __forceinline__ void zero_value_rows(uint8_t* v_tile, int n_keys, int lane) {
  const int units = (kBlockKeys - n_keys) * 16;  // 16-byte units: 8 a row in each of the two column halves
#pragma unroll 1  // a request's last block only: not unrolled, so the producer's registers hold (its plan read-ahead)
  for (int u = lane; u < units; u += 32) {
    const int row = n_keys + (u >> 4), half = (u >> 3) & 1, unit = u & 7;
    *reinterpret_cast<uint4*>(v_tile + half * kColumnHalfBytes + row * 128 + unit * 16) = make_uint4(0u, 0u, 0u, 0u);
  }
}

// ---- producer: one warp ------------------------------------------------------------------------------------------

// What the producer warp reads of a work item from the plan (lane i: token i of the tile).
struct ProducerItem {
  cuda::ItemView v;
  int count, token, rank, visible, visible_max;
};

// The same entries loaded but not yet used (lane i: token i's edge; the end of its request's queries). The plan is a
// chain of dependent loads (the item, then its block's and its tokens' entries). Read in one go, the chain held the
// producer for two global round trips an item, about as long as the consumers took for one (they waited for Q|K). The
// producer now keeps each step an item ahead of the next (raw item -> these loads -> ProducerItem): what it issues at
// the end of a turn is independent loads, one round trip. (ptxas still waits for them early in the next turn, bf16
// after its wait for a free stage, NVFP4 at the loop head: loads in flight across the back edge share one
// scoreboard.)
struct ProducerLoads {
  cuda::ItemLoads block;
  int token, rank, q_end;  // q_end = cu_seqlens_q[b + 1] (query_position)
};

// Item `item`'s loads (valid = false: past the CTA's items; nothing is read).
__device__ __forceinline__ ProducerLoads load_item(const PrefillParams& p, const PlanView& plan, bool valid,
                                                   const WorkItem& item, int lane) {
  ProducerLoads l{};
  if (!valid) return l;
  l.block = cuda::ItemView::load(p, item);
  const int group = p.num_q_heads / p.num_kv_heads;
  if (lane < min(cuda::ItemView::tile_count(item, group), kMaxTokens)) {  // the lanes finish_item reads (count)
    const int e = item.edge_begin + lane;
    l.token = plan.query(item.head, e);
    l.rank = plan.rank(item.head, e);
    l.q_end = p.cu_seqlens_q[item.request + 1];
  }
  return l;
}

__device__ __forceinline__ ProducerItem finish_item(const PrefillParams& p, const ProducerLoads& l, int lane) {
  ProducerItem r;
  r.v = cuda::ItemView::from(p, l.block);
  r.count = min(r.v.count, kMaxTokens);
  r.token = r.rank = r.visible = 0;
  if (lane < r.count) {
    r.token = l.token;
    r.rank = l.rank;
    const int pos = query_position(l.block.seq_len, l.q_end, r.token);
    r.visible = r.v.page_ok ? max(0, min(r.v.n_keys, pos - r.v.block_key0 + 1)) : 0;
  }
  r.visible_max = r.visible;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1)
    r.visible_max = max(r.visible_max, __shfl_xor_sync(0xffffffffu, r.visible_max, off));
  return r;
}

// Per item: wait for the stage's Q|K to be free, write the tile's queries into the stage's TileMeta, arm Q|K's full
// barrier with the transaction bytes and load the tokens' G query rows (lanes < count, two 64-dim boxes each) and
// (bf16) the block's K column halves, then the previous item's V once its stage is handed back (V lags one item: the
// consumers hand a stage's V back at the end of an item, later than its Q|K, and the next Q|K must not wait for that),
// or (FP8 / NVFP4) load the block's raw K and V bytes into the converters' buffers as each is handed back (FP8: a TMA
// box of the K or V byte columns; NVFP4: one bulk copy of the head's K or V cache slot). The plan entries of the
// next items are read ahead, a step of their chain of dependent loads an item (ProducerLoads). An item nobody
// sees (invalid page) loads nothing; its barriers complete on the arrivals alone. A stage that already holds the item's
// block (held[]) gets only the query rows: no K / V copies, no raw bytes for the converters.
template <KvFormat F>
__device__ __forceinline__ void produce_items(const TmaPrefillArgs& a, Storage<F>& storage, const PlanView& plan,
                                              ItemRange items) {
  constexpr bool kRaw = kConverted<F>;
  SharedStorage& s = shared_part(storage);
  const PrefillParams& p = a.p;
  const int lane = threadIdx.x & 31;
  const int group = p.num_q_heads / p.num_kv_heads;
  uint32_t landed_uses = 0;  // bit st: parity of the next phase of v_landed[st]
  // The block each stage's K / V tiles hold: (cache row of the page's head) << 8 | keys inside the request (the V rows
  // past them are zeros, FP8 / NVFP4 converted with them); -1: none yet.
  int64_t held[kStages];
#pragma unroll
  for (int st = 0; st < kStages; ++st) held[st] = -1;
  // bf16: the V load of the previous item, issued after this item's Q|K
  struct PendingValues {
    bool any, load_kv;
    int st, kv_row, n_keys;
    uint32_t phase;
  } pending{false, false, 0, 0, 0, 0u};
  auto load_values = [&](const PendingValues& pv) {
    SharedStorage::Stage& sg = s.stage[pv.st];
    ClusterBarrier::wait(&s.v_empty[pv.st], pv.phase ^ 1);
    // A block that ends inside the page (the request's last) lands on v_landed first: its V rows past the request are
    // zeroed here, then the consumers' v_full is released.
    const bool tail = pv.load_kv && pv.n_keys < kBlockKeys;
    uint64_t* landing = tail ? &s.v_landed[pv.st] : &s.v_full[pv.st];
    if (lane == 0) ClusterTransactionBarrier::arrive_and_expect_tx(landing, pv.load_kv ? kTileBytes : 0);
    __syncwarp();
    if (pv.load_kv && lane < 2)  // lane j: V column half j
      cute::SM90_TMA_LOAD_2D::copy(&a.kv_map, landing, kEvictNormal, sg.v + lane * kColumnHalfBytes,
                                   kHeadDim + lane * 64, pv.kv_row);
    if (tail) {
      ClusterBarrier::wait(&s.v_landed[pv.st], (landed_uses >> pv.st) & 1);
      landed_uses ^= 1u << pv.st;
      zero_value_rows(sg.v, pv.n_keys, lane);
      cutlass::arch::fence_view_async_shared();  // generic-proxy writes before the consumers' wgmma reads them
      __syncwarp();
      if (lane == 0) ClusterBarrier::arrive(&s.v_full[pv.st]);
    }
  };
  // The plan entries, read ahead (see ProducerLoads): at the top of turn w, `next` holds item w, `loads_ahead` item
  // w + 1's loads and `raw_ahead` item w + 2's raw entry; the turn's end finishes w + 1, issues w + 2's loads and
  // reads w + 3's raw entry.
  auto raw_at = [&](int w) { return w < items.end ? plan.raw_item(w) : RawWorkItem{0, 0, 0, 0}; };
  ProducerItem next = finish_item(p, load_item(p, plan, true, plan.item(items.begin), lane), lane);  // (not empty)
  ProducerLoads loads_ahead =
      load_item(p, plan, items.begin + 1 < items.end, plan.decode(raw_at(items.begin + 1)), lane);
  RawWorkItem raw_ahead = raw_at(items.begin + 2);
  int k = 0;
  for (int w = items.begin; w < items.end; ++w, ++k) {
    const ProducerItem r = next;
    const cuda::ItemView& v = r.v;
    const int st = k % kStages;
    const uint32_t phase = (k / kStages) & 1;
    const int kv_row = int((v.page * p.num_kv_heads + v.item.head) * kBlockKeys);
    const int64_t block_key = (int64_t(kv_row) << 8) | v.n_keys;
    // load: the item needs the block; load_kv: and the stage does not hold it yet. (An item nobody sees leaves the
    // stage's tiles, and what they hold, as they are.)
    const bool load = r.visible_max > 0;
    bool load_kv = false;
#pragma unroll
    for (int i = 0; i < kStages; ++i) {
      if (i == st) {
        load_kv = load && held[i] != block_key;
        if (load) held[i] = block_key;
      }
    }
    SharedStorage::Stage& sg = s.stage[st];

    ClusterBarrier::wait(&s.qk_empty[st], phase ^ 1);  // a fresh barrier counts as free (parity 1 is complete)
    TileMeta& m = s.meta[st];
    if (lane < r.count) {
      m.query[lane] = r.token;
      m.rank[lane] = r.rank;
      m.visible[lane] = r.visible;
    }
    if (lane == 0) {
      m.head = v.item.head;
      m.count = r.count;
      m.visible_max = r.visible_max;
    }
    __syncwarp();
    const int q_bytes = r.count * group * kRowBytes;
    if (lane == 0)  // release: the meta above is visible to whoever acquires the barrier's phase
      ClusterTransactionBarrier::arrive_and_expect_tx(&s.qk_full[st],
                                                      (load ? q_bytes : 0) + (!kRaw && load_kv ? kTileBytes : 0));
    __syncwarp();
    if (load && lane < r.count) {
      const int row = r.token * p.num_q_heads + v.item.head * group;
#pragma unroll
      for (int h = 0; h < 2; ++h)
        cute::SM90_TMA_LOAD_2D::copy(&a.q_map, &s.qk_full[st], kEvictNormal,
                                     sg.q + h * kColumnHalfBytes + lane * group * 128, h * 64, row);
    }
    if constexpr (kRaw) {
      // lane 0: the block's K bytes into raw[0], then its V bytes into raw[1]
#pragma unroll
      for (int kv = 0; kv < 2; ++kv) {
        ClusterBarrier::wait(&storage.raw_empty[kv], (k & 1) ^ 1);
        if (lane == 0) {
          storage.raw_load[kv] = load_kv;
          storage.raw_n_keys[kv] = v.n_keys;
          ClusterTransactionBarrier::arrive_and_expect_tx(&storage.raw_full[kv], load_kv ? kRawTileBytes<F> : 0);
          if (load_kv) {
            if constexpr (F == KvFormat::kNvfp4) {
              const uint8_t* slot = static_cast<const uint8_t*>(p.kv_cache) +
                                    ((v.page * p.num_kv_heads + v.item.head) * 2 + kv) * int64_t(kRawTileBytes<F>);
              cute::SM90_BULK_COPY_G2S::copy(slot, &storage.raw_full[kv], storage.raw[kv], kRawTileBytes<F>);
            } else {
              cute::SM90_TMA_LOAD_2D::copy(&a.kv_map, &storage.raw_full[kv], kEvictNormal, storage.raw[kv],
                                           kv * kHeadDim, kv_row);
            }
          }
        }
        __syncwarp();
      }
    } else {
      if (load_kv && lane < 2)  // lane j: K column half j
        cute::SM90_TMA_LOAD_2D::copy(&a.kv_map, &s.qk_full[st], kEvictNormal, sg.k + lane * kColumnHalfBytes,
                                     lane * 64, kv_row);
      if (pending.any) load_values(pending);
      pending = {true, load_kv, st, kv_row, v.n_keys, phase};
    }
    if (w + 1 < items.end) {
      next = finish_item(p, loads_ahead, lane);
      loads_ahead = load_item(p, plan, w + 2 < items.end, plan.decode(raw_ahead), lane);
      raw_ahead = raw_at(w + 3);
    }
  }
  if constexpr (!kRaw)
    if (pending.any) load_values(pending);
}

// ---- consumers: two warpgroups, 64 tile rows each -------------------------------------------------------------------

// What a consumer thread keeps of one work item: how many keys of the block its two rows see (causal; 0 past the
// tile's tokens) and where their partials go (-1: no token).
struct ItemRows {
  int vis[2];
  int64_t slot[2];  // partial row: the plan's (token, KV head, rank) slot * G + head in the group
};

// P = exp2(S - m) in the register A layout of m64nNk16: ((2, 2, 2), 1, 4) holds an m64n64 accumulator's values in the
// same order.
using PLayout = cute::Layout<cute::Shape<cute::Shape<cute::_2, cute::_2, cute::_2>, cute::_1, cute::_4>>;

// Waits for the Q|K of this CTA's k-th item and reads its rows from the tile's queries (before the stage is released:
// the producer rewrites the meta with the stage).
__device__ __forceinline__ ItemRows wait_item(const PrefillParams& p, const PlanView& plan, SharedStorage& s, int k,
                                              const int (&tok)[2], const int (&head_in_group)[2], int group) {
  const int st = k % kStages;
  ItemRows it;
  ClusterBarrier::wait(&s.qk_full[st], (k / kStages) & 1);
  const TileMeta& m = s.meta[st];
  const int count = m.count, head = m.head;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const bool ok = tok[r] < count;
    it.vis[r] = ok ? m.visible[tok[r]] : 0;
    it.slot[r] = ok ? plan.partial_index(m.query[tok[r]], head, m.rank[tok[r]], p.num_kv_heads) * group +
                          head_in_group[r]
                    : -1;
  }
  return it;
}

// S = Q K^T of both halves of a stage as one wgmma group (keys nobody sees are masked later). No wgmma sits under a
// data-dependent branch: ptxas would serialize them.
template <class ThrS, class TS>
__device__ __forceinline__ void issue_scores(const SharedStorage::Stage& sg, int wg, MmaS& mma_s, ThrS& thr_s,
                                             TS& tSrS0, TS& tSrS1) {
  using namespace cute;
  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<const Element*>(sg.q)), TileLayout{});
  Tensor sK = make_tensor(make_smem_ptr(reinterpret_cast<const Element*>(sg.k)), TileLayout{});
  Tensor tSrQ = thr_s.partition_fragment_A(local_tile(sQ, Shape<_64, _128>{}, make_coord(wg, 0)));  // (MMA, 1, 8)
  warpgroup_fence_operand(tSrS0);
  warpgroup_fence_operand(tSrS1);
  warpgroup_arrive();
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    Tensor tSrK = thr_s.partition_fragment_B(local_tile(sK, Shape<_64, _128>{}, make_coord(h, 0)));
    TS& tSrS = h == 0 ? tSrS0 : tSrS1;
    mma_s.accumulate_ = GMMA::ScaleOut::Zero;
#pragma unroll
    for (int kb = 0; kb < size<2>(tSrQ); ++kb) {
      cute::gemm(mma_s, tSrQ(_, _, kb), tSrK(_, _, kb), tSrS);
      mma_s.accumulate_ = GMMA::ScaleOut::One;
    }
  }
  warpgroup_commit_batch();
}

// The softmax of this thread's two rows over the block, in place: S -> exp2(S scale_log2 - m) (fp32), m the row max in
// log2 units (-inf for a row that sees nothing) and l this lane's share of the row sum. Element 4 j + e of a half: row
// (e / 2) of the pair, key 64 h + 8 j + c2 + e % 2 (the m64nNk16 accumulator layout).
// One arithmetic for every row, whatever its warp-mates see (a row's bits must not depend on which other tokens share
// its warp: G = 8 puts two tokens in a warp, and the tokens of a tile follow from the batch). With a positive scale
// (monotone rounding: max_i fl(S_i scale) = fl(max_i S_i scale)) keys a row does not see are set to -inf, the max is
// taken over the raw scores and the scale goes into one FFMA a score; a warp whose rows all see the whole block (not
// on a request's diagonal or last block, no row past the tile's tokens, a valid page) skips the selects, which would
// keep every score. Otherwise (a non-positive scale, a whole call's choice) each score is scaled, then masked. Masked
// keys hold whatever the stage's K tile held, possibly the page's non-finite bytes past the request: the select
// drops them.
template <class TS>
__device__ __forceinline__ void softmax_in_place(const ItemRows& it, int c2, float scale_log2, TS& tSrS0, TS& tSrS1,
                                                 float (&m)[2], float (&l)[2]) {
  const bool positive = scale_log2 > 0.0f;
  const bool whole = __all_sync(0xffffffffu, it.vis[0] == kBlockKeys && it.vis[1] == kBlockKeys);
  const float scale = positive ? scale_log2 : 1.0f;  // what the max is multiplied by, and the scores in the FFMA
  if (!whole || !positive) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      TS& tSrS = h == 0 ? tSrS0 : tSrS1;
#pragma unroll
      for (int i = 0; i < 32; ++i) {  // i = 4 j + e
        const int key = h * kHalfKeys + 8 * (i >> 2) + c2 + (i & 1);
        const float s = positive ? tSrS(i) : tSrS(i) * scale_log2;
        tSrS(i) = key < it.vis[(i >> 1) & 1] ? s : -INFINITY;
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < 8; ++j)
      mx = fmaxf(mx, fmaxf(fmaxf(tSrS0(4 * j + 2 * r), tSrS0(4 * j + 2 * r + 1)),
                           fmaxf(tSrS1(4 * j + 2 * r), tSrS1(4 * j + 2 * r + 1))));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    m[r] = mx * scale;
    l[r] = 0.0f;
  }
  const float base[2] = {m[0] == -INFINITY ? 0.0f : m[0], m[1] == -INFINITY ? 0.0f : m[1]};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    TS& tSrS = h == 0 ? tSrS0 : tSrS1;
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const int r = (i >> 1) & 1;
      const float pr = exp2_approx(fmaf(tSrS(i), scale, -base[r]));
      l[r] += pr;
      tSrS(i) = pr;
    }
  }
}

// P = bf16(exp2(S - m)): the A operand of O = P V, element for element. Elements 2 k and 2 k + 1 (one row, two
// adjacent keys) share a 32-bit register of the A fragment, so each pair is one cvt.rn.bf16x2 written straight into
// it. (Converted element by element, ptxas paired element i of both halves in one F2FP and then moved the halves into
// place with 32 PRMTs right before the O wgmma.)
template <class TS, class TP>
__device__ __forceinline__ void convert_probabilities(const TS& tSrS0, const TS& tSrS1, TP& tOrP0, TP& tOrP1) {
  auto words0 = cute::recast<uint32_t>(tOrP0);
  auto words1 = cute::recast<uint32_t>(tOrP1);
  static_assert(cute::size(decltype(words0){}) == 16);
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    words0(k) = sm80::pack_bf16x2(tSrS0(2 * k), tSrS0(2 * k + 1));
    words1(k) = sm80::pack_bf16x2(tSrS1(2 * k), tSrS1(2 * k + 1));
  }
}

// O = P V over both halves (the first k-block overwrites O; P = 0 on keys nobody sees): one wgmma group.
template <class ThrO, class TP, class TO>
__device__ __forceinline__ void issue_values(const uint8_t* v_tile, MmaO& mma_o, ThrO& thr_o, TP& tOrP0, TP& tOrP1,
                                             TO& tOrO) {
  using namespace cute;
  Tensor sVt = make_tensor(make_smem_ptr(reinterpret_cast<const Element*>(v_tile)), VtLayout{});
  warpgroup_fence_operand(tOrP0);  // P's registers are written before the wgmma reads them
  warpgroup_fence_operand(tOrP1);
  warpgroup_fence_operand(tOrO);
  warpgroup_arrive();
  mma_o.accumulate_ = GMMA::ScaleOut::Zero;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    Tensor tOrV = thr_o.partition_fragment_B(local_tile(sVt, Shape<_128, _64>{}, make_coord(0, h)));  // (MMA, 1, 4)
    TP& tOrP = h == 0 ? tOrP0 : tOrP1;
#pragma unroll
    for (int kb = 0; kb < size<2>(tOrV); ++kb) {
      cute::gemm(mma_o, tOrP(_, _, kb), tOrV(_, _, kb), tOrO);
      mma_o.accumulate_ = GMMA::ScaleOut::One;
    }
  }
  warpgroup_commit_batch();
}

// Normalized bf16 partials (times v_scale) and lse of this thread's two rows at their slots (the G rows of one token
// are G consecutive slots). A row that saw nothing: O = 0 (whatever V held: P = 0 times a NaN is NaN), lse = -inf.
// (ptxas turns the warp-uniform any_empty test into a select a value either way; a separate path without it measured
// no faster on the H200, fifteenth session.) Natural column order: 16 4-byte stores a row (columns
// 8 j + c2, +1; a lane quad's store covers 16 contiguous bytes); fragment order (kFragmentOrder, the host's
// p.partial_fragment_order; common/partial_order.h): four 16-byte stores a row, a quad's store 64 contiguous bytes.
// kBulk (kBulkPartialStores, fragment order): the same four 16-byte stores a row go to the warp's staging buffer
// (`buffer`: row (lane / 4) + 8 r of the warp's 16 at 256 B a row), and lane 0 copies each token's G rows (the warp's
// 16 rows are one token for G = 16, two for G = 8; lane 0's rows 0 and 8 are a token's head 0) to their G consecutive
// slots with one bulk copy. The buffer is written again only once the previous item's copies have read it.
template <bool kFragmentOrder, bool kBulk, class TO>
__device__ __forceinline__ void store_partials(const PrefillParams& p, const ItemRows& it, int lane, int group,
                                               float v_scale, TO& tOrO, const float (&m)[2], float (&l)[2],
                                               uint8_t* buffer) {
  static_assert(!kBulk || kFragmentOrder, "bulk partial stores stage fragment-order rows");
  const int c2 = (lane & 3) * 2;
  auto partial_lse = [&](int r) { return !(l[r] > 0.0f) ? -INFINITY : (m[r] + log2f(l[r])) * sm80::kLn2; };
  if constexpr (kBulk) {
    if (lane == 0) cute::tma_store_wait<0>();  // the copies have read the buffer (issued an iteration ago)
    __syncwarp();
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
  const bool any_empty = __any_sync(0xffffffffu, (it.slot[0] >= 0 && !(l[0] > 0.0f)) ||
                                                     (it.slot[1] >= 0 && !(l[1] > 0.0f)));
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (it.slot[r] < 0) continue;
    const int64_t slot = it.slot[r];
    const bool empty = !(l[r] > 0.0f);
    const float inv = empty ? 0.0f : v_scale / l[r];
    // columns 8 j + c2, +1 of row r, normalized, as bf16x2
    auto normalized_pair = [&](int j) {
      float o0 = tOrO(4 * j + 2 * r) * inv, o1 = tOrO(4 * j + 2 * r + 1) * inv;
      if (any_empty) {
        o0 = empty ? 0.0f : o0;
        o1 = empty ? 0.0f : o1;
      }
      return sm80::pack_bf16x2(o0, o1);
    };
    if constexpr (kBulk) {
      // the same positions in the warp's row (lane / 4) + 8 r of the buffer
      uint8_t* dst = buffer + ((lane >> 2) + 8 * r) * kRowBytes + 2 * partial_order::fragment_position(c2);
#pragma unroll
      for (int i = 0; i < 4; ++i)
        cuda::store_shared_16(dst + 64 * i, make_uint4(normalized_pair(4 * i), normalized_pair(4 * i + 1),
                                                       normalized_pair(4 * i + 2), normalized_pair(4 * i + 3)));
    } else if constexpr (kFragmentOrder) {
      static_assert(kHeadDim == partial_order::kRowColumns && partial_order::fragment_position(2) == 8 &&
                    partial_order::fragment_position(8) == 2 && partial_order::fragment_position(32) == 32);
      // j = 4 i .. 4 i + 3 of this lane at position 32 i + 8 (lane % 4): uint4 4 i past the lane's first
      uint4* dst = reinterpret_cast<uint4*>(static_cast<uint16_t*>(p.partial_o) + slot * kHeadDim +
                                            partial_order::fragment_position(c2));  // + 8 (lane % 4)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        dst[4 * i] = make_uint4(normalized_pair(4 * i), normalized_pair(4 * i + 1), normalized_pair(4 * i + 2),
                                normalized_pair(4 * i + 3));
    } else {
      uint16_t* dst = static_cast<uint16_t*>(p.partial_o) + slot * kHeadDim + c2;
#pragma unroll
      for (int j = 0; j < 16; ++j) *reinterpret_cast<uint32_t*>(dst + 8 * j) = normalized_pair(j);
    }
    if (!kBulk && (lane & 3) == 0) p.partial_lse[slot] = partial_lse(r);
  }
  if constexpr (kBulk) {
    bulk_store::fence_shared_for_async();
    __syncwarp();
    if (lane == 0) {
      // G = 16: rows 0-15, one token; G = 8: rows 0-7 and 8-15, two (the sm90 kernel takes G in {8, 16} only)
#pragma unroll
      for (int r = 0; r < 2; ++r)
        if ((r == 0 || group <= 8) && it.slot[r] >= 0)
          cute::SM90_BULK_COPY_S2G::copy(buffer + 8 * r * kRowBytes,
                                         static_cast<uint16_t*>(p.partial_o) + it.slot[r] * kHeadDim,
                                         min(group, kWarpPartialRows) * kRowBytes);
      cute::tma_store_arrive();  // commit
    }
    // the lse after the fence, which would otherwise wait for these global stores too
#pragma unroll
    for (int r = 0; r < 2; ++r)
      if (it.slot[r] >= 0 && (lane & 3) == 0) p.partial_lse[it.slot[r]] = partial_lse(r);
  }
}

// The items of this CTA's range, software-pipelined so that the tensor cores have the next MMA queued while a
// consumer works on registers (FA3's intra-warpgroup overlap, across work items): item j + 1's S = Q K^T runs while
// item j - 1's partials are stored, item j's O = P V while item j + 1's softmax runs. Iteration j:
//   issue S(j + 1)  ->  store partials(j - 1)  ->  issue O(j)  ->  wait S(j + 1)  ->  softmax(j + 1) in place
//   ->  wait O(j)  ->  P(j + 1) = bf16
// Both groups are committed and waited inside the iteration, S before O (wait<1> completes the S alone): ptxas keeps
// the wgmma pipeline only for waits it can match to their groups, not across a loop's back edge. A stage's Q|K is
// released once its S is done, its V once its O is done. FP8: k_scale goes into the softmax scale, v_scale into the
// normalization.
template <KvFormat F, bool kFragmentOrder>
__device__ __forceinline__ void consume_items(const TmaPrefillArgs& a, SharedStorage& s, const PlanView& plan,
                                              ItemRange items, int wg, uint8_t* partial_buffers) {
  using namespace cute;
  const PrefillParams& p = a.p;
  const int consumer_tid = threadIdx.x - kWarpgroupThreads;  // 0..255 over both consumer warpgroups
  const int tid = consumer_tid - wg * kWarpgroupThreads;     // 0..127 within this warpgroup
  const int warp = tid >> 5, lane = tid & 31;
  const int group = p.num_q_heads / p.num_kv_heads;
  constexpr bool kScaled = F != KvFormat::kBf16;
  const float scale_log2 = p.softmax_scale * (kScaled ? *p.k_scale : 1.0f) * sm80::kLog2e;
  const float v_scale = kScaled ? *p.v_scale : 1.0f;
  // The two rows of the tile this thread holds in every accumulator: R = 64 wg + 16 warp + lane / 4 (+ 8).
  const int row0 = wg * kConsumerRows + warp * 16 + (lane >> 2);
  const int tok[2] = {row0 / group, (row0 + 8) / group};
  const int head_in_group[2] = {row0 % group, (row0 + 8) % group};
  const int c2 = (lane & 3) * 2;
  const int n = items.end - items.begin;
  constexpr bool kBulk = kBulkPartialStores<F> && kFragmentOrder;
  uint8_t* const buffer = kBulk ? partial_buffers + (wg * 4 + warp) * kWarpPartialBytes : nullptr;
  if constexpr (kBulk)
    if (group != 8 && group != 16) __trap();  // the copies take a warp's rows as 1 or 2 whole tokens (prefill_supports)

  MmaS mma_s;
  MmaO mma_o;
  auto thr_s = mma_s.get_slice(tid);
  auto thr_o = mma_o.get_slice(tid);
  Tensor tSrS0 = partition_fragment_C(mma_s, Shape<_64, _64>{});  // ((2, 2, 8), 1, 1): 32 fp32
  Tensor tSrS1 = partition_fragment_C(mma_s, Shape<_64, _64>{});
  Tensor tOrO = partition_fragment_C(mma_o, Shape<_64, _128>{});  // ((2, 2, 16), 1, 1): 64 fp32
  Tensor tOrP0 = make_tensor<Element>(PLayout{});
  Tensor tOrP1 = make_tensor<Element>(PLayout{});

  // Ping-pong (kConsumerPingPong): the warpgroups take turns issuing, two turns an iteration each: S(j + 1), then
  // O(j), so the tensor cores run S0 S1 O0 O1 ... and one warpgroup's softmax overlaps the other's MMAs; the partial
  // stores and the V wait lie between a warpgroup's two turns, outside them. Warpgroup 1 hands warpgroup 0 the first
  // turn; both walk the same items, so the turns pair up; warpgroup 1 skips its last hand-over, which nobody would
  // wait for.
  if constexpr (kConsumerPingPong)
    if (wg == 1) cutlass::arch::NamedBarrier::arrive(kConsumerTurnThreads, kConsumerTurn + 0);
  auto release = [&](uint64_t* barrier) {
    __syncwarp();
    if (lane == 0) ClusterBarrier::arrive(barrier);
  };

  // Item 0: S, softmax, P.
  ItemRows prev{}, cur = wait_item(p, plan, s, 0, tok, head_in_group, group);
  issue_scores(s.stage[0], wg, mma_s, thr_s, tSrS0, tSrS1);
  warpgroup_wait<0>();
  warpgroup_fence_operand(tSrS0);
  warpgroup_fence_operand(tSrS1);
  release(&s.qk_empty[0]);  // this warp no longer reads the stage's Q and K
  float m[2], l[2], m_prev[2] = {0.0f, 0.0f}, l_prev[2] = {0.0f, 0.0f};
  softmax_in_place(cur, c2, scale_log2, tSrS0, tSrS1, m, l);
  convert_probabilities(tSrS0, tSrS1, tOrP0, tOrP1);

  for (int j = 0;; ++j) {
    const int st = j % kStages, st1 = (j + 1) % kStages;
    const bool more = j + 1 < n;
    ItemRows next = cur;
    if (more) next = wait_item(p, plan, s, j + 1, tok, head_in_group, group);  // (the producer is normally ahead)
    if constexpr (kConsumerPingPong) cutlass::arch::NamedBarrier::sync(kConsumerTurnThreads, kConsumerTurn + wg);
    // S of item j + 1 (after the last item: a harmless product of a stage nobody refills, never read)
    issue_scores(s.stage[st1], wg, mma_s, thr_s, tSrS0, tSrS1);
    if constexpr (kConsumerPingPong) cutlass::arch::NamedBarrier::arrive(kConsumerTurnThreads, kConsumerTurn + (1 - wg));
    if (j > 0) store_partials<kFragmentOrder, kBulk>(p, prev, lane, group, v_scale, tOrO, m_prev, l_prev, buffer);
    ClusterBarrier::wait(&s.v_full[st], (j / kStages) & 1);
    if constexpr (kConsumerPingPong) cutlass::arch::NamedBarrier::sync(kConsumerTurnThreads, kConsumerTurn + wg);
    issue_values(s.stage[st].v, mma_o, thr_o, tOrP0, tOrP1, tOrO);
    if constexpr (kConsumerPingPong)
      if (wg == 0 || more) cutlass::arch::NamedBarrier::arrive(kConsumerTurnThreads, kConsumerTurn + (1 - wg));
    warpgroup_wait<1>();  // S of item j + 1
    warpgroup_fence_operand(tSrS0);
    warpgroup_fence_operand(tSrS1);
    float m_next[2], l_next[2];
    if (more) {
      release(&s.qk_empty[st1]);
      softmax_in_place(next, c2, scale_log2, tSrS0, tSrS1, m_next, l_next);
    }
    warpgroup_wait<0>();  // O of item j
    warpgroup_fence_operand(tOrO);
    release(&s.v_empty[st]);  // this warp no longer reads the stage's V
    if (!more) break;
    convert_probabilities(tSrS0, tSrS1, tOrP0, tOrP1);
    prev = cur;
    cur = next;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      m_prev[r] = m[r];
      l_prev[r] = l[r];
      m[r] = m_next[r];
      l[r] = l_next[r];
    }
  }
  store_partials<kFragmentOrder, kBulk>(p, cur, lane, group, v_scale, tOrO, m, l, buffer);
  if constexpr (kBulk)
    if (lane == 0) bulk_store::wait_all();  // the buffer stays until its copies are done
}

// kFragmentOrder: the column order of the bf16 partial rows (common/partial_order.h); true is the default (fragment
// order), false the natural order (JAX_MSA_PARTIAL_FRAGMENT_ORDER=0).
template <KvFormat F, bool kFragmentOrder>
__global__ void __launch_bounds__(kThreads, 1) sparse_prefill_wgmma_kernel(const __grid_constant__ TmaPrefillArgs a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr bool kRaw = kConverted<F>;
  extern __shared__ uint8_t smem_raw[];
  Storage<F>& storage = shared_storage<F>(smem_raw);
  SharedStorage& s = shared_part(storage);
  const PlanView plan = PlanView::from(a.p);
  const ItemRange items = ItemRange::of_cta(plan.work_count());
  if (items.begin >= items.end) return;  // uniform over the CTA
  if (threadIdx.x == 0) {
#pragma unroll
    for (int st = 0; st < kStages; ++st) {
      ClusterBarrier::init(&s.qk_full[st], kRaw ? 1 + kConverterWarps : 1);
      ClusterBarrier::init(&s.qk_empty[st], kConsumerWarps);
      ClusterBarrier::init(&s.v_full[st], kRaw ? kConverterWarps : 1);
      ClusterBarrier::init(&s.v_empty[st], kConsumerWarps);
      ClusterBarrier::init(&s.v_landed[st], 1);
    }
    if constexpr (kRaw) {
#pragma unroll
      for (int kv = 0; kv < 2; ++kv) {
        ClusterBarrier::init(&storage.raw_full[kv], 1);
        ClusterBarrier::init(&storage.raw_empty[kv], kConverterWarps);
      }
    }
    cutlass::arch::fence_barrier_init();
    cute::prefetch_tma_descriptor(&a.q_map);
    // (not encoded for an empty cache, nor for NVFP4, whose slots arrive by bulk copies)
    if (a.p.num_pages > 0 && F != KvFormat::kNvfp4) cute::prefetch_tma_descriptor(&a.kv_map);
  }
  __syncthreads();
  // warp-uniform by construction (a shuffle from lane 0): the consumers' wgmma descriptors, which depend on it, can
  // then live in uniform registers instead of being moved there (R2UR) before every wgmma
  const int wg = cutlass::canonical_warp_group_idx();
  if (wg == 0) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters>();
    const int warp = threadIdx.x / 32;
    if (warp == 0) {
      produce_items<F>(a, storage, plan, items);
    } else if constexpr (kRaw) {
      convert_items<F>(s, storage, items, warp - 1);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegisters>();
    consume_items<F, kFragmentOrder>(a, s, plan, items, wg - 1, partial_buffers<F>(storage));
  }
#else
  __trap();  // no sm_90a code in this architecture's image: fail loudly rather than leave the partials unwritten
#endif
}

}  // namespace jax_msa::sm90::prefill
