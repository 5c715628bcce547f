// tcgen05 (sm_100a) sparse prefill kernel, UNVERIFIED (see config.h): one plan work item a CTA; writes one normalized
// bf16 partial and its lse per (query, selected block), merged afterwards by the shared combine kernel. Reads the
// plan only through PlanView / cuda::ItemView. On any other architecture the kernel only traps (the dispatch picks
// it on compute capability 10.x alone, unless JAX_MSA_FORCE_COMPUTE_CAPABILITY misleads it).
#pragma once
#include <cuda_bf16.h>

#include <cute/tensor.hpp>

#include "common/params.h"
#include "common/plan_view.h"
#include "cuda/prefill_work_item.cuh"
#include "cuda/shared_memory.cuh"
#include "sm100/common/tcgen05.cuh"
#include "sm100/prefill/config.h"
#include "sm100/prefill/operand_load.cuh"

namespace jax_msa::sm100::prefill {

template <KvFormat F>
__global__ void __launch_bounds__(kThreads, 1) sparse_prefill_tcgen05_kernel(const PrefillParams p) {
#if defined(JAX_MSA_SM100_TCGEN05)
  using namespace cute;
  extern __shared__ uint8_t smem_raw[];
  __shared__ cuda::TileQueries s_tq;
  __shared__ alignas(8) uint64_t s_mma_done;
  __shared__ uint32_t s_tmem_base;

  const PlanView plan = PlanView::from(p);
  if (int(blockIdx.x) >= plan.work_count()) return;  // static-capacity grid: the count is read on device
  const cuda::ItemView v = cuda::ItemView::make(p, plan, blockIdx.x);
  const int tid = threadIdx.x, warp = tid >> 5;
  const int g = v.item.head, group = v.group;

  uint8_t* smem = cuda::align_shared<SharedPlan::kAlign>(smem_raw);
  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Bf16*>(smem + SharedPlan::kQOffset)), LayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(reinterpret_cast<Bf16*>(smem + SharedPlan::kKOffset)), LayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(reinterpret_cast<Bf16*>(smem + SharedPlan::kVOffset)), LayoutV{});
  Tensor sP = make_tensor(make_smem_ptr(reinterpret_cast<Bf16*>(smem + SharedPlan::kPOffset)), LayoutP{});

  // ---- 1. the tile's queries; TMEM and the MMA barrier
  cuda::gather_tile_queries(s_tq, p, plan, v);
  const uint32_t tmem = tmem_alloc_and_init_barrier(TmemPlan::kColumns, &s_tmem_base, &s_mma_done);
  int phase = 0;
  const int tile_visible = cuda::tile_visible_keys(s_tq, v.count);

  // ---- 2. operands into shared memory (generic proxy), then visible to the tensor cores (async proxy)
  load_block<F>(sK, sV, p, v, tile_visible);
  load_query_tile(sQ, p, s_tq, v.count, group, g);
  cutlass::arch::fence_view_async_shared();
  __syncthreads();

  // ---- 3. S = Q K^T into TMEM columns [0, 128), issued by warp 0
  MmaQK mma_qk;
  if (warp == 0) issue_mma(mma_qk, sQ, sK, TileShape{}, tmem + TmemPlan::kSColumn, false, &s_mma_done);
  wait_mma(&s_mma_done, phase);

  // ---- 4. softmax of row R = tid over the keys its query sees (log2 units), P (bf16) into sP
  const bool quantized = F != KvFormat::kBf16;
  const float q_scale = p.q_is_fp8 ? *p.q_scale : 1.0f;
  const float k_scale = quantized ? *p.k_scale : 1.0f;
  const float v_scale = quantized ? *p.v_scale : 1.0f;
  const float scale_log2 = p.softmax_scale * q_scale * k_scale * kLog2e;
  const int row = tid, qi = row / group;
  const bool row_ok = qi < v.count;
  const int vis = row_ok ? s_tq.visible[qi] : 0;
  const uint32_t lane_addr = tmem + (uint32_t(warp * 32) << 16);  // TMEM address: lane << 16 | column
  float m = -INFINITY;
#pragma unroll 1
  for (int c = 0; c < kBlockKeys / 32; ++c) {
    float x[32];
    tmem_load_row32(lane_addr + TmemPlan::kSColumn + 32 * c, x);
#pragma unroll
    for (int j = 0; j < 32; ++j)
      if (32 * c + j < vis) m = fmaxf(m, x[j] * scale_log2);
  }
  float l = 0.0f;
#pragma unroll 1
  for (int c = 0; c < kBlockKeys / 32; ++c) {
    float x[32];
    tmem_load_row32(lane_addr + TmemPlan::kSColumn + 32 * c, x);
    uint32_t packed[16];
#pragma unroll
    for (int j = 0; j < 32; j += 2) {
      const float p0 = 32 * c + j < vis ? exp2f(x[j] * scale_log2 - m) : 0.0f;
      const float p1 = 32 * c + j + 1 < vis ? exp2f(x[j + 1] * scale_log2 - m) : 0.0f;
      l += p0 + p1;
      packed[j / 2] = pack_bf16x2(p0, p1);
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int key = 32 * c + 8 * u;
      cuda::store_shared_16(&sP(make_coord(make_coord(row, key % 16), 0, key / 16)),
                            make_uint4(packed[4 * u], packed[4 * u + 1], packed[4 * u + 2], packed[4 * u + 3]));
    }
  }
  cutlass::arch::fence_view_async_shared();
  tcgen05_before_thread_sync();
  __syncthreads();

  // ---- 5. O = P V into TMEM columns [128, 256)
  MmaPV mma_pv;
  if (warp == 0) issue_mma(mma_pv, sP, sV, TileShape{}, tmem + TmemPlan::kOColumn, false, &s_mma_done);
  wait_mma(&s_mma_done, phase);

  // ---- 6. the row's normalized partial (bf16) and lse at the plan's slot
  const bool empty = !(l > 0.0f);
  const float inv = empty ? 0.0f : v_scale / l;
  int64_t slot = 0;
  if (row_ok) slot = plan.partial_index(s_tq.query[qi], g, s_tq.rank[qi], p.num_kv_heads) * group + row % group;
#pragma unroll 1
  for (int c = 0; c < kHeadDim / 32; ++c) {
    float x[32];
    tmem_load_row32(lane_addr + TmemPlan::kOColumn + 32 * c, x);  // every lane of the warp takes part
    if (row_ok) {
      uint32_t packed[16];
#pragma unroll
      for (int j = 0; j < 32; j += 2) packed[j / 2] = pack_bf16x2(x[j] * inv, x[j + 1] * inv);
      uint4* dst = reinterpret_cast<uint4*>(static_cast<uint16_t*>(p.partial_o) + slot * kHeadDim + 32 * c);
#pragma unroll
      for (int u = 0; u < 4; ++u)
        dst[u] = make_uint4(packed[4 * u], packed[4 * u + 1], packed[4 * u + 2], packed[4 * u + 3]);
    }
  }
  if (row_ok) p.partial_lse[slot] = empty ? -INFINITY : (m + log2f(l)) * kLn2;

  tmem_free(tmem, TmemPlan::kColumns);
#else
  __trap();  // no tcgen05 on this architecture (e.g. a forced compute capability): fail, never write garbage
#endif
}

}  // namespace jax_msa::sm100::prefill
