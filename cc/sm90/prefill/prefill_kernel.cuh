// Hopper (sm_90a) sparse prefill kernel: a persistent, warp-specialized CTA (see config.h) = a TMA producer warp that
// stages each work item's block and query tile, and two wgmma consumer warpgroups that attend the tile's 128 rows
// over the block and write one normalized partial and its lse per (query, selected block). Reads the plan only through
// PlanView; included by prefill_bf16.cu alone.
#pragma once
#include <cuda_bf16.h>

#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "common/params.h"
#include "common/plan_view.h"
#include "cuda/prefill_work_item.cuh"
#include "sm80/common/register_pack.cuh"
#include "sm80/common/warp_mma.cuh"
#include "sm90/prefill/config.h"
#include "sm90/prefill/prefill.h"

namespace jax_msa::sm90::prefill {

using cutlass::arch::ClusterBarrier;
using cutlass::arch::ClusterTransactionBarrier;

// The dynamic shared memory, its base rounded up to 1 KB (the 128-byte swizzle pattern repeats every 1 KB, and TMA and
// wgmma both derive it from the address).
__device__ __forceinline__ SharedStorage& shared_storage(uint8_t* raw) {
  const uintptr_t aligned = (reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023);
  return *reinterpret_cast<SharedStorage*>(aligned);
}

constexpr uint64_t kEvictNormal = uint64_t(cute::TMA::CacheHintSm90::EVICT_NORMAL);

// Rows [n_keys, 128) of a stage's V tile: zero (whatever the page holds past the request; the warp's 32 lanes).
__device__ __forceinline__ void zero_value_rows(uint8_t* v_tile, int n_keys, int lane) {
  const int units = (kBlockKeys - n_keys) * 16;  // 16-byte units: 8 a row in each of the two column halves
  for (int u = lane; u < units; u += 32) {
    const int row = n_keys + (u >> 4), half = (u >> 3) & 1, unit = u & 7;
    *reinterpret_cast<uint4*>(v_tile + half * kColumnHalfBytes + row * 128 + unit * 16) = make_uint4(0u, 0u, 0u, 0u);
  }
}

// ---- producer: one warp ------------------------------------------------------------------------------------------
// Per item: wait for the stage to be free, write the tile's queries (lane i: token i of the tile) into the stage's
// TileMeta, arm the full barrier with the transaction bytes, then lanes < count load their token's G query rows (two
// 64-dim boxes) and lanes 0-3 the block's K and V column halves. An item nobody sees (invalid page) loads nothing.
__device__ __forceinline__ void produce_items(const TmaPrefillArgs& a, SharedStorage& s, const PlanView& plan,
                                              int n_items) {
  const PrefillParams& p = a.p;
  const int lane = threadIdx.x & 31;
  const int group = p.num_q_heads / p.num_kv_heads;
  uint32_t landed_uses = 0;  // bit st: parity of the next phase of landed[st]
  int k = 0;
  for (int w = blockIdx.x; w < n_items; w += gridDim.x, ++k) {
    const int st = k % kStages;
    const uint32_t phase = (k / kStages) & 1;
    ClusterBarrier::wait(&s.empty[st], phase ^ 1);  // a fresh barrier counts as free (parity 1 is complete)

    const cuda::ItemView v = cuda::ItemView::make(p, plan, w);
    const int count = min(v.count, kMaxTokens);
    TileMeta& m = s.meta[st];
    int token = 0, visible = 0;
    if (lane < count) {
      const int e = v.item.edge_begin + lane;
      token = plan.query(v.item.head, e);
      const int pos = query_position(p.cu_seqlens_q, p.seq_lens, v.item.request, token);
      visible = v.page_ok ? max(0, min(v.n_keys, pos - v.block_key0 + 1)) : 0;
      m.query[lane] = token;
      m.rank[lane] = plan.rank(v.item.head, e);
      m.visible[lane] = visible;
    }
    int visible_max = visible;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) visible_max = max(visible_max, __shfl_xor_sync(0xffffffffu, visible_max, off));
    if (lane == 0) {
      m.count = count;
      m.visible_max = visible_max;
      m.n_keys = v.n_keys;
    }
    __syncwarp();
    const bool load = visible_max > 0;
    // A block that ends inside the page (the request's last) lands on `landed` first: its V rows past the request are
    // zeroed here (0 * NaN would poison O), then the consumers' full barrier is released.
    const bool tail = load && v.n_keys < kBlockKeys;
    uint64_t* landing = tail ? &s.landed[st] : &s.full[st];
    if (lane == 0)  // release: the meta above is visible to whoever acquires the full barrier's phase
      ClusterTransactionBarrier::arrive_and_expect_tx(landing, load ? kKvBytes + count * group * kRowBytes : 0);
    __syncwarp();
    if (!load) continue;
    SharedStorage::Stage& sg = s.stage[st];
    if (lane < count) {
      const int row = token * p.num_q_heads + v.item.head * group;
#pragma unroll
      for (int h = 0; h < 2; ++h)
        cute::SM90_TMA_LOAD_2D::copy(&a.q_map, landing, kEvictNormal, sg.q + h * kColumnHalfBytes + lane * group * 128,
                                     h * 64, row);
    }
    if (lane < 4) {  // lane j: K column half j (j < 2), V column half j - 2
      const int kv_row = int((v.page * p.num_kv_heads + v.item.head) * kBlockKeys);
      uint8_t* dst = (lane < 2 ? sg.k : sg.v) + (lane & 1) * kColumnHalfBytes;
      cute::SM90_TMA_LOAD_2D::copy(&a.kv_map, landing, kEvictNormal, dst, lane * 64, kv_row);
    }
    if (tail) {
      ClusterBarrier::wait(&s.landed[st], (landed_uses >> st) & 1);
      landed_uses ^= 1u << st;
      zero_value_rows(sg.v, v.n_keys, lane);
      cutlass::arch::fence_view_async_shared();  // generic-proxy writes before the consumers' wgmma reads them
      __syncwarp();
      if (lane == 0) ClusterBarrier::arrive(&s.full[st]);
    }
  }
}

// ---- consumers: two warpgroups, 64 tile rows each -------------------------------------------------------------------

// What a consumer thread keeps of one work item: its two rows' queries and visibility, and the block's halves.
struct ItemRows {
  int head;       // KV head g
  int count;      // tokens in the tile
  int halves;     // 64-key halves any token sees: 0, 1 or 2
  int n_keys;     // keys of the block inside the request (V rows past it are zeroed before use)
  int vis[2], query[2], rank[2];
};

// P = exp2(S - m) in the register A layout of m64nNk16: ((2, 2, 2), 1, 4) holds an m64n64 accumulator's values in the
// same order.
using PLayout = cute::Layout<cute::Shape<cute::Shape<cute::_2, cute::_2, cute::_2>, cute::_1, cute::_4>>;

// Waits for item w's stage (k-th of this CTA) and reads the tile's queries.
__device__ __forceinline__ ItemRows wait_item(SharedStorage& s, const PlanView& plan, int w, int k,
                                              const int (&tok)[2]) {
  const int st = k % kStages;
  ItemRows it;
  it.head = plan.item(w).head;
  ClusterBarrier::wait(&s.full[st], (k / kStages) & 1);
  const TileMeta& m = s.meta[st];
  it.count = m.count;
  it.halves = m.visible_max > kHalfKeys ? 2 : (m.visible_max > 0 ? 1 : 0);
  it.n_keys = m.n_keys;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const bool ok = tok[r] < it.count;
    it.vis[r] = ok ? m.visible[tok[r]] : 0;
    it.query[r] = ok ? m.query[tok[r]] : 0;
    it.rank[r] = ok ? m.rank[tok[r]] : 0;
  }
  return it;
}

// S = Q K^T of both halves of a stage as one wgmma group (keys nobody sees are masked later). No wgmma sits under a
// data-dependent branch and no barrier wait runs while one is in flight: either makes ptxas wait for the group.
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

// Causal mask (key < the row's visible keys) and the row max over the visible halves, then P = exp2(S - m) in bf16 and
// this lane's share of the row sums. Element 4 j + e of a half: row (e / 2) of the pair, key 64 h + 8 j + c2 + e % 2
// (the m64nNk16 accumulator layout). m in log2 units, -inf for a row that sees nothing.
template <class TS, class TP>
__device__ __forceinline__ void probabilities(const ItemRows& it, int c2, float scale_log2, TS& tSrS0, TS& tSrS1,
                                              TP& tOrP0, TP& tOrP1, float (&m)[2], float (&l)[2]) {
  float sc[2][8][4];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = h * kHalfKeys + 8 * j + c2 + (e & 1);
        const float raw = h == 0 ? tSrS0(4 * j + e) : tSrS1(4 * j + e);
        sc[h][j][e] = (h < it.halves && key < it.vis[e >> 1]) ? raw * scale_log2 : -INFINITY;
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = -INFINITY;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int j = 0; j < 8; ++j) mx = fmaxf(mx, fmaxf(sc[h][j][2 * r], sc[h][j][2 * r + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    m[r] = mx;
    l[r] = 0.0f;
  }
  const float base[2] = {m[0] == -INFINITY ? 0.0f : m[0], m[1] == -INFINITY ? 0.0f : m[1]};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float pr = exp2f(sc[h][j][e] - base[e >> 1]);
        l[e >> 1] += pr;
        if (h == 0) tOrP0(4 * j + e) = Element(pr);
        else tOrP1(4 * j + e) = Element(pr);
      }
    }
  }
}

// O = P V over both halves (the first k-block overwrites O; P = 0 on keys nobody sees): one wgmma group.
template <class ThrO, class TP, class TO>
__device__ __forceinline__ void issue_values(const uint8_t* v_tile, MmaO& mma_o, ThrO& thr_o, TP& tOrP0, TP& tOrP1,
                                             TO& tOrO) {
  using namespace cute;
  Tensor sVt = make_tensor(make_smem_ptr(reinterpret_cast<const Element*>(v_tile)), VtLayout{});
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

// Normalized bf16 partials and lse of this thread's two rows at the plan's slots (the G rows of one token are G
// consecutive slots). A row that saw nothing: O = 0, lse = -inf.
template <class TO>
__device__ __forceinline__ void store_partials(const PrefillParams& p, const PlanView& plan, const ItemRows& it,
                                               const int (&tok)[2], const int (&head_in_group)[2], int group, int lane,
                                               TO& tOrO, const float (&m)[2], float (&l)[2]) {
  const int c2 = (lane & 3) * 2;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (tok[r] >= it.count) continue;
    const int64_t slot = plan.partial_index(it.query[r], it.head, it.rank[r], p.num_kv_heads) * group + head_in_group[r];
    const bool empty = !(l[r] > 0.0f);
    const float inv = empty ? 0.0f : 1.0f / l[r];
    uint16_t* dst = static_cast<uint16_t*>(p.partial_o) + slot * kHeadDim + c2;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const float o0 = empty ? 0.0f : tOrO(4 * j + 2 * r) * inv, o1 = empty ? 0.0f : tOrO(4 * j + 2 * r + 1) * inv;
      *reinterpret_cast<uint32_t*>(dst + 8 * j) = sm80::pack_bf16x2(o0, o1);
    }
    if ((lane & 3) == 0) p.partial_lse[slot] = empty ? -INFINITY : (m[r] + log2f(l[r])) * sm80::kLn2;
  }
}

// Per item: S (issued one item ahead), softmax, O = P V; then the next item's S is issued before this item's O is
// waited for, so the tensor cores compute it while this item's partials are stored.
__device__ __forceinline__ void consume_items(const TmaPrefillArgs& a, SharedStorage& s, const PlanView& plan,
                                              int n_items, int wg) {
  using namespace cute;
  const PrefillParams& p = a.p;
  const int consumer_tid = threadIdx.x - kWarpgroupThreads;  // 0..255 over both consumer warpgroups
  const int tid = consumer_tid - wg * kWarpgroupThreads;     // 0..127 within this warpgroup
  const int warp = tid >> 5, lane = tid & 31;
  const int group = p.num_q_heads / p.num_kv_heads;
  const float scale_log2 = p.softmax_scale * sm80::kLog2e;
  // The two rows of the tile this thread holds in every accumulator: R = 64 wg + 16 warp + lane / 4 (+ 8).
  const int row0 = wg * kConsumerRows + warp * 16 + (lane >> 2);
  const int tok[2] = {row0 / group, (row0 + 8) / group};
  const int head_in_group[2] = {row0 % group, (row0 + 8) % group};
  const int c2 = (lane & 3) * 2;

  MmaS mma_s;
  MmaO mma_o;
  auto thr_s = mma_s.get_slice(tid);
  auto thr_o = mma_o.get_slice(tid);
  Tensor tSrS0 = partition_fragment_C(mma_s, Shape<_64, _64>{});  // ((2, 2, 8), 1, 1): 32 fp32
  Tensor tSrS1 = partition_fragment_C(mma_s, Shape<_64, _64>{});
  Tensor tOrO = partition_fragment_C(mma_o, Shape<_64, _128>{});  // ((2, 2, 16), 1, 1): 64 fp32
  Tensor tOrP0 = make_tensor<Element>(PLayout{});
  Tensor tOrP1 = make_tensor<Element>(PLayout{});

  int w = blockIdx.x, k = 0;
  ItemRows cur = wait_item(s, plan, w, k, tok);
  issue_scores(s.stage[0], wg, mma_s, thr_s, tSrS0, tSrS1);
  while (true) {
    const int st = k % kStages;
    warpgroup_wait<0>();  // S of the current item; nothing in flight
    warpgroup_fence_operand(tSrS0);
    warpgroup_fence_operand(tSrS1);
    float m[2], l[2];
    probabilities(cur, c2, scale_log2, tSrS0, tSrS1, tOrP0, tOrP1, m, l);
    const int w_next = w + int(gridDim.x);
    const bool more = w_next < n_items;
    ItemRows next = cur;
    if (more) next = wait_item(s, plan, w_next, k + 1, tok);  // (the producer is normally ahead: no wait)
    issue_values(s.stage[st].v, mma_o, thr_o, tOrP0, tOrP1, tOrO);
    // the next item's S (after the last item: a harmless product of the other, idle stage, never read)
    issue_scores(s.stage[(k + 1) % kStages], wg, mma_s, thr_s, tSrS0, tSrS1);
    warpgroup_wait<1>();  // O of the current item; the next S may still run
    warpgroup_fence_operand(tOrO);
    __syncwarp();
    if (lane == 0) ClusterBarrier::arrive(&s.empty[st]);  // this warp no longer reads the stage
    store_partials(p, plan, cur, tok, head_in_group, group, lane, tOrO, m, l);
    if (!more) break;
    cur = next;
    w = w_next;
    ++k;
  }
  warpgroup_wait<0>();
}

__global__ void __launch_bounds__(kThreads, 1) sparse_prefill_wgmma_kernel(const __grid_constant__ TmaPrefillArgs a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  SharedStorage& s = shared_storage(smem_raw);
  const PlanView plan = PlanView::from(a.p);
  const int n_items = plan.work_count();
  if (int(blockIdx.x) >= n_items) return;  // uniform over the CTA
  if (threadIdx.x == 0) {
#pragma unroll
    for (int st = 0; st < kStages; ++st) {
      ClusterBarrier::init(&s.full[st], 1);
      ClusterBarrier::init(&s.empty[st], kConsumerWarps);
      ClusterBarrier::init(&s.landed[st], 1);
    }
    cutlass::arch::fence_barrier_init();
    cute::prefetch_tma_descriptor(&a.q_map);
    if (a.p.num_pages > 0) cute::prefetch_tma_descriptor(&a.kv_map);  // (not encoded for an empty cache)
  }
  __syncthreads();
  const int wg = threadIdx.x / kWarpgroupThreads;
  if (wg == 0) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters>();
    if (threadIdx.x < 32) produce_items(a, s, plan, n_items);
  } else {
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegisters>();
    consume_items(a, s, plan, n_items, wg - 1);
  }
#else
  __trap();  // no sm_90a code in this architecture's image: fail loudly rather than leave the partials unwritten
#endif
}

}  // namespace jax_msa::sm90::prefill
