// Warp-MMA (sm_80+) sparse decode kernel (split-K over the selected blocks); the split combine is combine_splits.cu.
// Layout and roles: see config.h. Semantics: MSA.md section 2 (holes, ids out of range, blocks beyond the
// causal position and invalid pages are skipped before any read; duplicates count once).
#pragma once
#include <cuda_bf16.h>

#include <type_traits>

#include <cute/arch/copy_sm80.hpp>

#include "common/params.h"
#include "sm80/common/online_softmax.cuh"
#include "sm80/common/warp_mma.cuh"
#include "sm80/decode/chunk_io.cuh"
#include "sm80/decode/cluster_merge.cuh"
#include "sm80/decode/config.h"
#include "sm80/decode/query_fragments.cuh"
#include "sm80/decode/timeline.cuh"

namespace jax_msa::sm80::decode {

// Float offset of dims [4 u, 4 u + 4) of row `row` of warp `warp`'s partial output in the merge area ([warp][row][d]
// fp32, rows of 512 B): the 16-byte unit index is XORed, inside its 128-byte bank line, with (2 row + line) % 8, so
// that the fragment stores of both paths (lanes 32 dims or 8 dims apart) and the merge's row reads spread over the
// banks instead of landing 8-32 lanes on one.
__device__ __forceinline__ int merge_offset(int warp, int row, int u) {
  return (warp * kRows + row) * kHeadDim + 4 * (u ^ ((2 * row + (u >> 3)) & 7));
}

// sm_90+: one thread asks L2 for request b's whole block-table row (one bulk prefetch, 16-byte aligned, inside the
// table), issued with the top-k row's load so that the page lookups that depend on it hit L2 instead of paying a
// second DRAM round trip. A hint: nothing waits for it.
__device__ __forceinline__ void prefetch_block_table_row(const DecodeParams& p, int b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uintptr_t table = reinterpret_cast<uintptr_t>(p.block_table);
  const uintptr_t table_end = (table + uintptr_t(p.batch) * p.max_blocks * sizeof(int32_t)) & ~uintptr_t(15);
  const uintptr_t row = table + uintptr_t(b) * p.max_blocks * sizeof(int32_t);
  const uintptr_t begin = row & ~uintptr_t(15);
  const uintptr_t row_end = (row + p.max_blocks * sizeof(int32_t) + 15) & ~uintptr_t(15);
  const uintptr_t end = row_end < table_end ? row_end : table_end;
  if (begin >= table && end > begin)
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(begin), "r"(uint32_t(end - begin)) : "memory");
#endif
}

// L (config.h, CtaLayout): kOneTeam, one split a CTA; kTeams / kTeamsTwoPerSm / kThreeTeams, the CTA's kTeams teams
// (FormatTraits<F>::kTeamSplits, or 3) run the (token, KV head)'s num_splits == kTeams splits and the CTA writes the
// output (no cluster, no combine kernel).
template <KvFormat F, CtaLayout L>
__global__ void __launch_bounds__(CtaShape<F, L>::kThreadsPerCta, register_budget_ctas<F, L>())
    sparse_decode_kernel(const DecodeParams p, bool merge_in_cluster) {
  using Traits = FormatTraits<F>;
  using Shape = CtaShape<F, L>;
  using Plan = SharedPlan<F, L>;
  constexpr int kTeams = Shape::kTeams;
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ ChunkRef s_chunks[kTeams][Shape::kMaxTeamChunks];
  __shared__ int s_num_chunks[kTeams];
  __shared__ float s_m[Shape::kWarpsPerCta][kRows], s_l[Shape::kWarpsPerCta][kRows];
  // dynamic + static shared memory within the 99 KB a block of sm_86 / sm_89 / sm_120, with room for the timeline
  // build's 256 B of stamps (config.h's 96 KB bound counts the dynamic bytes only)
  static_assert(Plan::kBytes + sizeof(s_chunks) + sizeof(s_num_chunks) + sizeof(s_m) + sizeof(s_l) + 256 <= 99 * 1024,
                "the CTA's shared memory fits every sm_80+ GPU");

  const int split = blockIdx.x, g = blockIdx.y, t = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // team = this warp's split among the CTA's kTeams (warp-uniform); team_warp = its warp index within the team
  const int team = kTeams == 1 ? 0 : warp / kWarps, team_warp = kTeams == 1 ? warp : warp % kWarps;
  if constexpr (kTeams > 1) merge_in_cluster = false;  // (the launcher passes false): no cluster code
  // the CTAs that stamp the phase timeline (timeline.cuh; only in its diagnostic build)
  const bool stamped = kTeams > 1 || merge_in_cluster;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int b = t / p.q_len;
  const int64_t tokens = int64_t(p.batch) * p.q_len;
  constexpr MmaOperand kOp = Traits::kOperand;
  constexpr bool kRegisterPath = Traits::kRegisterPath;
  const int64_t q_row_base = int64_t(t) * p.num_q_heads + int64_t(g) * group;
  timeline_mark(stamped, Phase::kEntry);

  // ---- 1. the loads that depend on nothing are issued first, so their latencies overlap: the query tile (one
  //         cp.async group, staged in the last pipeline stage, which the loop first fills at chunk 0), the top-k row
  //         (warp 0), the request's block-table row into L2 (warp 1) and the request's length
  uint8_t* stages = smem + Plan::kStagesOffset + team * Plan::kTeamStageBytes;  // this team's
  auto stage_ptr = [&](int c) { return stages + (c % Shape::kStages) * Traits::kStageBytes; };
  uint8_t* q_tile = smem + Plan::kQueryTileOffset;  // = team 0's stage_ptr(kStages - 1)
  load_q_tile<Shape::kThreadsPerCta>(q_tile, p, q_row_base, group);
  cute::cp_async_fence();
  const int32_t* topk_row = p.topk_ids + (int64_t(g) * tokens + t) * p.topk;
  const int id = team_warp == 0 && lane < p.topk ? topk_row[lane] : -1;  // each team's warp 0 reads the row
  if (warp == 1 && lane == 0) prefetch_block_table_row(p, b);
  const int seq_len = p.seq_lens[b];
  const int pos = seq_len - p.q_len + t % p.q_len;
  // scales: q_scale and k_scale fold into the softmax scale (log2 units), v_scale into the output; loaded here so
  // that their round trip overlaps the others
  const bool quantized = F != KvFormat::kBf16;
  // b / requests_per_scale (0 but under jax.vmap's fold of per-layer scales), as one multiply (params.h)
  const int scale_entry = int((uint64_t(b) * p.scale_entry_magic) >> 32);
  const float q_scale = p.q_is_fp8 ? p.q_scale[scale_entry] : 1.0f;
  // the register path's K and V values are the cache's times kRegisterValueFactor (NVFP4: 2^-7)
  constexpr float kUnscale = 1.0f / ChunkIO<F>::kRegisterValueFactor;
  const float k_scale = quantized ? p.k_scale[scale_entry] * kUnscale : 1.0f;
  const float v_scale = quantized ? p.v_scale[scale_entry] * kUnscale : 1.0f;

  // ---- 2. the valid, deduplicated blocks of (t, g): one warp ballot; this split's share; its chunks (each team's
  //         warp 0 builds its team's table, in parallel)
  if (team_warp == 0) {
    const int n_blocks = min((seq_len + kPageSize - 1) / kPageSize, p.max_blocks);
    const bool in_range = id >= 0 && id < n_blocks && pos >= 0 && id <= pos / kPageSize;
    // the page lookup is issued before the duplicate test so that its latency covers it (a duplicate reads the same
    // in-range entry as its first copy)
    const int64_t looked_up = in_range ? p.block_table[int64_t(b) * p.max_blocks + id] : -1;
    const unsigned same_id = __match_any_sync(0xffffffffu, id);
    bool valid = in_range && (same_id & ((1u << lane) - 1u)) == 0;  // first copy only: a lower lane's copy wins
    const int64_t page = valid ? looked_up : -1;
    valid = valid && page >= 0 && page < p.num_pages;
    const unsigned mask = __ballot_sync(0xffffffffu, valid);
    const int n = __popc(mask);
    const int splits = p.num_splits > 1 ? p.num_splits : 1;  // <= 1: one CTA takes every block
    const int part = split * kTeams + team;                    // kTeams > 1: the launch has num_splits == kTeams
    const int first = part * n / splits, last = (part + 1) * n / splits;
    const int rank = __popc(mask & ((1u << lane) - 1u));
    // chunk slots: block i of this split -> slots 2*(i-first), +1; compacted by a second ballot below
    const int visible = valid ? min(kPageSize, pos - id * kPageSize + 1) : 0;
    const bool mine = valid && rank >= first && rank < last;
    const bool second = mine && visible > kChunkKeys;
    const unsigned mine_mask = __ballot_sync(0xffffffffu, mine);
    const unsigned second_mask = __ballot_sync(0xffffffffu, second);
    if (mine) {
      const unsigned before = (1u << lane) - 1u;
      const int slot = __popc(mine_mask & before) + __popc(second_mask & before);
      s_chunks[team][slot] = ChunkRef{page, 0, min(visible, kChunkKeys)};
      if (second) s_chunks[team][slot + 1] = ChunkRef{page, 1, visible - kChunkKeys};
    }
    if (lane == 0) s_num_chunks[team] = __popc(mine_mask) + __popc(second_mask);
  }
  __syncthreads();
  const int n_chunks = s_num_chunks[team];
  timeline_mark(stamped, Phase::kChunkTable, n_chunks);

  // ---- 3. the first stages' KV loads, issued before the query conversion waits for the query
  const int key0 = team_warp * kKeysPerWarp;  // this warp's 16 keys of every chunk: it loads and reads only those
                                         // rows, so the loop synchronizes with __syncwarp alone
#pragma unroll
  for (int c = 0; c < Shape::kStages - 1; ++c) {
    if (c < n_chunks) ChunkIO<F>::load(stage_ptr(c), p.kv_cache, p.num_kv_heads, g, s_chunks[team][c], key0, lane);
    cute::cp_async_fence();
  }

  const float scale_log2 = p.softmax_scale * q_scale * k_scale * kLog2e;

  // ---- 4. Q fragments (A operand, 8 k-steps of 16 dims) for rows lane/4 and lane/4 + 8
  const int r0 = lane >> 2, c2 = (lane & 3) * 2;
  QFragmentSource<Shape::kQFragmentsInShared> q_source(smem + Plan::kQFragmentOffset, lane);
  float row_scale[2];
  // One straight-line path per query type (the type is uniform over the grid)
  auto prepare_q = [&](auto q_fp8) {
    constexpr bool kQFp8 = decltype(q_fp8)::value;
    cute::cp_async_wait<Shape::kStages - 1>();  // the query group (the oldest) has landed, the KV stages may not
    __syncthreads();                             // ... for every thread's units
    uint32_t q_raw[8][4];
    read_q_raw<Traits::kRegisterDims, kQFp8>(q_tile, lane, q_raw);
    uint32_t qf[8][4];
    if constexpr (Shape::kQFragmentsInShared) {  // converted before the barrier that publishes warp 0's copy
      q_fragments_from_raw<kOp, kQFp8>(q_raw, qf, row_scale);
      q_source.keep(qf, warp);
      __syncthreads();  // the tile is read (chunk 0 may refill its stage) and the shared fragments are written
    } else {
      __syncthreads();  // every warp has read the tile before any warp's chunk 0 refills its stage
      q_fragments_from_raw<kOp, kQFp8>(q_raw, qf, row_scale);
      q_source.keep(qf, warp);
    }
  };
  if (p.q_is_fp8) prepare_q(std::true_type{});
  else prepare_q(std::false_type{});
  row_scale[0] *= scale_log2;
  row_scale[1] *= scale_log2;

  float acc[16][4];  // O: 16 n-tiles of 8 dims; [0,1] row r0, [2,3] row r0 + 8
#pragma unroll
  for (int i = 0; i < 16; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
  OnlineSoftmax softmax;

  // The ldmatrix path's addresses in a stage: K as x4 (keys key0 + 8 (l / 16) + l % 8, unit 2 ks + (l / 8) % 2) and V
  // as x4.trans (keys key0 + 8 ((l / 8) % 2) + l % 8, unit 2 m + l / 16 for dims 16 m ..). Both rows have key % 8 =
  // l % 8, so the swizzled unit (2 m + h) ^ (l % 8) of step m + 4 is step m's plus 8 units (128 B): 4 lane offsets
  // each, the rest immediates. (They equal swizzled_offset(k_key / v_key, unit), written with l % 8, which ptxas
  // cannot derive from the key.)
  int k_ldsm[4], v_ldsm[4];
  if constexpr (!kRegisterPath) {
    const int k_key = key0 + ((lane >> 4) << 3) + (lane & 7), v_key = key0 + (((lane >> 3) & 1) << 3) + (lane & 7);
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      k_ldsm[m] = k_key * kBf16RowBytes + (((2 * m + ((lane >> 3) & 1)) ^ (lane & 7)) << 4);
      v_ldsm[m] = kBf16TileBytes + v_key * kBf16RowBytes + (((2 * m + (lane >> 4)) ^ (lane & 7)) << 4);
    }
  }

  // ---- 5. per-warp pipeline over the chunks; stage indices as wrapping counters (chunk c reads stage c % kStages,
  //         refills stage (c + kStages - 1) % kStages)
  int read_stage = 0, write_stage = Shape::kStages - 1;
  // NVFP4 (ChunkIO::kLaneLoads): the loads' lane-fixed addresses computed once; bf16 / FP8: load() at every chunk
  constexpr bool kLaneLoads = ChunkIO<F>::kLaneLoads;
  const auto lane_loads = [&] {
    if constexpr (kLaneLoads) return ChunkIO<F>::lane_loads(stages, p.kv_cache, p.num_kv_heads, g, key0, lane);
    else return 0;  // unused
  }();
  // With lane loads (issue-bound NVFP4, registers to spare) the lane's rows and columns of a stage are kept in
  // registers too: rebuilt from the thread index at every chunk they cost another dozen instructions a chunk
  auto keep = [](int x) { return kLaneLoads ? kept(x) : x; };
  const int lane_k = keep(lane);
  const int row_key = keep(key0 + r0), quad = keep(lane & 3), col_key = keep(key0 + c2);
  for (int c = 0; c < n_chunks; ++c) {
    cute::cp_async_wait<Shape::kStages - 2>();
    __syncwarp();  // the warp's rows of chunk c have landed; its rows of chunk c-1's stage are free
    const int next = c + Shape::kStages - 1;
    if (next < n_chunks) {
      if constexpr (kLaneLoads)
        ChunkIO<F>::load_chunk(lane_loads, write_stage * Traits::kStageBytes, s_chunks[team][next], lane_k);
      else
        ChunkIO<F>::load(stages + write_stage * Traits::kStageBytes, p.kv_cache, p.num_kv_heads, g,
                         s_chunks[team][next], key0, lane);
    }
    cute::cp_async_fence();
    const ChunkRef ref = s_chunks[team][c];
    const uint8_t* stage = stages + read_stage * Traits::kStageBytes;
    read_stage = read_stage == Shape::kStages - 1 ? 0 : read_stage + 1;
    write_stage = write_stage == Shape::kStages - 1 ? 0 : write_stage + 1;

    // S = Q K^T over the warp's 16 keys: 2 n-tiles (keys key0 + lane / 4, + 8) x 8 k-steps
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    if constexpr (kRegisterPath) {
      uint32_t k_regs[2][16];
      ChunkIO<F>::row_f16(stage, ref, 0, row_key, quad, k_regs[0]);
      ChunkIO<F>::row_f16(stage, ref, 0, row_key + 8, quad, k_regs[1]);
#pragma unroll
      for (int ks = 0; ks < 8; ++ks) {
        uint32_t qa[4];
        q_source.fetch(ks, qa);
        mma_16x8x16<kOp>(s[0], qa, k_regs[0][2 * ks], k_regs[0][2 * ks + 1]);
        mma_16x8x16<kOp>(s[1], qa, k_regs[1][2 * ks], k_regs[1][2 * ks + 1]);
      }
    } else {
#pragma unroll
      for (int ks = 0; ks < 8; ++ks) {
        uint32_t b00, b01, b10, b11;
        ldsm_x4(stage + k_ldsm[ks & 3] + (ks & 4) * 32, b00, b01, b10, b11);  // swizzled_offset(key, 2 ks + unit)
        uint32_t qa[4];
        q_source.fetch(ks, qa);
        mma_16x8x16<kOp>(s[0], qa, b00, b01);
        mma_16x8x16<kOp>(s[1], qa, b10, b11);
      }
    }
    // scale to log2 units, mask past the visible keys (only a chunk that has such keys: the test is warp-uniform),
    // online softmax per row
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] *= row_scale[e >> 1];
    }
    if (ref.visible < kChunkKeys) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (col_key + nt * 8 + (e & 1) >= ref.visible) s[nt][e] = -INFINITY;
        }
      }
    }
    float alpha[2];
    if (softmax.update(s, alpha)) rescale_rows(acc, alpha);
    // O += P V: P as the A operand (keys = k), V^T tiles via ldmatrix.trans (or movmatrix)
    const uint32_t pa[4] = {pack_operand_x2<kOp>(s[0][0], s[0][1]), pack_operand_x2<kOp>(s[0][2], s[0][3]),
                            pack_operand_x2<kOp>(s[1][0], s[1][1]), pack_operand_x2<kOp>(s[1][2], s[1][3])};
    if constexpr (kRegisterPath) {
      // V rows key0 + lane / 4 (keys 0-7 of the k-step) and + 8 as 8x8 tiles (keys x the lane's dims), transposed in
      // registers into B fragments; n-tile t holds the dims register_dim<kRegisterDims>(l, t, 0 / 1) of lane l
      // (config.h; see the epilogue)
      uint32_t v_regs[2][16];
      ChunkIO<F>::row_f16(stage, ref, 1, row_key, quad, v_regs[0]);
      ChunkIO<F>::row_f16(stage, ref, 1, row_key + 8, quad, v_regs[1]);
#pragma unroll
      for (int t = 0; t < 16; ++t) mma_16x8x16<kOp>(acc[t], pa, movmatrix_t(v_regs[0][t]), movmatrix_t(v_regs[1][t]));
    } else {
#pragma unroll
      for (int dn = 0; dn < 16; dn += 2) {
        uint32_t b00, b01, b10, b11;
        ldsm_x4_t(stage + v_ldsm[(dn >> 1) & 3] + (dn & 8) * 16, b00, b01, b10, b11);  // swizzled_offset(key, dn + unit)
        mma_16x8x16<kOp>(acc[dn], pa, b00, b01);
        mma_16x8x16<kOp>(acc[dn + 1], pa, b10, b11);
      }
    }
  }
  cute::cp_async_wait<0>();
  timeline_mark(stamped, Phase::kLoopDone);
  timeline_warp_mark(stamped, WarpPhase::kLoopDone);

  // ---- 6. merge the CTA's warps' (m, l, O) through shared memory (every team's: kTeams x 4 warps)
  softmax.reduce_row_sums();
  __syncthreads();  // every warp is done with the stages: reuse them for the partial outputs
  float* merge = reinterpret_cast<float*>(smem);  // [warp][row][d]
  if ((lane & 3) == 0) {
    s_m[warp][r0] = softmax.m[0];
    s_m[warp][r0 + 8] = softmax.m[1];
    s_l[warp][r0] = softmax.l[0];
    s_l[warp][r0 + 8] = softmax.l[1];
  }
  if constexpr (Traits::kRegisterDims == RegisterDims::kLaneSplitPairs) {
    // n-tiles 4 j + r hold dims 32 (l % 4) + 8 j + r (accumulator values 0, 2) and + 4 (1, 3): two float4 a row and j
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int u = (register_dim<RegisterDims::kLaneSplitPairs>(lane, 4 * j, h)) >> 2;
        *reinterpret_cast<float4*>(merge + merge_offset(warp, r0, u)) =
            make_float4(acc[4 * j][h], acc[4 * j + 1][h], acc[4 * j + 2][h], acc[4 * j + 3][h]);
        *reinterpret_cast<float4*>(merge + merge_offset(warp, r0 + 8, u)) =
            make_float4(acc[4 * j][2 + h], acc[4 * j + 1][2 + h], acc[4 * j + 2][2 + h], acc[4 * j + 3][2 + h]);
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) {  // n-tile i: dims i * 8 + 2 (l % 4), +1 (ldmatrix path) or 32 (l % 4) + 2 i, +1
      const int d = kRegisterPath ? register_dim<RegisterDims::kLanePairs>(lane, i, 0) : i * 8 + c2;
      float* w0 = merge + merge_offset(warp, r0, d >> 2) + (d & 3);
      float* w1 = merge + merge_offset(warp, r0 + 8, d >> 2) + (d & 3);
      *reinterpret_cast<float2*>(w0) = make_float2(acc[i][0], acc[i][1]);
      *reinterpret_cast<float2*>(w1) = make_float2(acc[i][2], acc[i][3]);
    }
  }
  timeline_warp_mark(stamped, WarpPhase::kStaged);
  __syncthreads();

  // thread -> (row, kDims dims): 16 rows x (128 / kDims) groups (one team: 16 dims, two: 8); rows past the group are
  // computed (on zero queries) but never stored
  constexpr int kDims = Shape::kMergeDims, kMergeWarps = Shape::kWarpsPerCta;
  constexpr int kGroupsPerRow = kHeadDim / kDims;
  const int row = threadIdx.x / kGroupsPerRow, d0 = (threadIdx.x % kGroupsPerRow) * kDims;
  const bool row_leader = threadIdx.x % kGroupsPerRow == 0;  // stores the row's lse
  const bool stored_row = row < group;
  if constexpr (Shape::kThreadsPerCta > Shape::kMergeThreads) {  // a three-team CTA: its last 128 threads are done
    if (threadIdx.x >= Shape::kMergeThreads) return;
  }
  if (!stored_row && !merge_in_cluster) return;
  float m_all = -INFINITY;
#pragma unroll
  for (int w = 0; w < kMergeWarps; ++w) m_all = fmaxf(m_all, s_m[w][row]);
  float wgt[kMergeWarps], l_all = 0.0f;
#pragma unroll
  for (int w = 0; w < kMergeWarps; ++w) {
    wgt[w] = m_all == -INFINITY ? 0.0f : exp2f(s_m[w][row] - m_all);
    l_all += s_l[w][row] * wgt[w];
  }
  float o[kDims];
#pragma unroll
  for (int j = 0; j < kDims; ++j) o[j] = 0.0f;
#pragma unroll
  for (int w = 0; w < kMergeWarps; ++w) {
#pragma unroll
    for (int u = 0; u < kDims / 4; ++u) {
      const float4 x = *reinterpret_cast<const float4*>(merge + merge_offset(w, row, (d0 >> 2) + u));
      o[4 * u] += wgt[w] * x.x;
      o[4 * u + 1] += wgt[w] * x.y;
      o[4 * u + 2] += wgt[w] * x.z;
      o[4 * u + 3] += wgt[w] * x.w;
    }
  }
  // the division after the partials' loads (its slow path is a call, which the loads would otherwise wait behind)
  const bool empty = !(l_all > 0.0f);
  const float inv = empty ? 0.0f : v_scale / l_all;
  const float lse = empty ? -INFINITY : (m_all + log2f(l_all)) * kLn2;
#pragma unroll
  for (int j = 0; j < kDims; ++j) o[j] *= inv;
  const int64_t out_row = q_row_base + row;
  if (merge_in_cluster) {  // every thread takes part in the cluster's barriers (never with kTeams > 1)
    ClusterPartial* part = reinterpret_cast<ClusterPartial*>(smem + Plan::kClusterPartialOffset);
    if (stored_row) {
      float4* dst = reinterpret_cast<float4*>(&part->o[row][d0]);
#pragma unroll
      for (int j = 0; j < 4; ++j) dst[j] = make_float4(o[4 * j], o[4 * j + 1], o[4 * j + 2], o[4 * j + 3]);
      if (row_leader) part->lse[row] = lse;
    }
    timeline_mark(stamped, Phase::kWarpMerge);
    merge_cluster_splits(p, part, reinterpret_cast<ClusterGather*>(merge), group, q_row_base);
  } else if (kTeams > 1 || p.num_splits <= 1) {  // the CTA holds every split of (t, g): the output itself
    uint32_t packed[kDims / 2];
#pragma unroll
    for (int j = 0; j < kDims / 2; ++j) packed[j] = pack_bf16x2(o[2 * j], o[2 * j + 1]);
    uint4* dst = reinterpret_cast<uint4*>(p.out + out_row * kHeadDim + d0);
#pragma unroll
    for (int j = 0; j < kDims / 8; ++j)
      dst[j] = make_uint4(packed[4 * j], packed[4 * j + 1], packed[4 * j + 2], packed[4 * j + 3]);
    if (row_leader) p.lse[out_row] = lse;
    if constexpr (kTeams > 1) {  // no cluster phases: thread 0's output stored ends them all
      timeline_mark_through(stamped, Phase::kWarpMerge, Phase::kExit);
      timeline_write(p, stamped);
    }
  } else {
    const int64_t prow = int64_t(split) * tokens * p.num_q_heads + out_row;
    float4* dst = reinterpret_cast<float4*>(p.partial_o + prow * kHeadDim + d0);
#pragma unroll
    for (int j = 0; j < 4; ++j) dst[j] = make_float4(o[4 * j], o[4 * j + 1], o[4 * j + 2], o[4 * j + 3]);
    if (row_leader) p.partial_lse[prow] = lse;
  }
}

}  // namespace jax_msa::sm80::decode
