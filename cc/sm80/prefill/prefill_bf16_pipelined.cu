// Warp-MMA (sm_80+) sparse prefill, bf16 KV cache, persistent and software-pipelined: opt-in and unverified
// (JAX_MSA_PREFILL_PIPELINED=1; see PipelinedPlan in config.h). The one kernel of this translation unit.
#include "cuda/launch_config.h"
#include "sm80/prefill/prefill.h"
#include "sm80/prefill/prefill_kernel.cuh"

namespace jax_msa::sm80::prefill {

// Opt-in, unverified: the persistent, software-pipelined variant of sparse_prefill_kernel for bf16 KV (config.h,
// PipelinedPlan). CTA c takes work items c, c + gridDim.x, ...; while it attends item i from stage i % 2, the cp.async
// copies of item i + gridDim.x's block and query tile fill the other stage.
__device__ __forceinline__ void issue_bf16_item_loads(uint8_t* stage, const PrefillParams& p, const ItemView& v,
                                                      const TileQueries& tq, int tile_visible) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int half = warp >> 2, key0 = (warp & 3) * kKeysPerWarp;
  const int half_visible = max(0, min(kChunkKeys, tile_visible - half * kChunkKeys));
  const ChunkRef ref{v.page_ok ? v.page : 0, half, half_visible};
  if (half_visible > 0)
    ChunkIO<KvFormat::kBf16>::load(stage + half * SharedPlan<KvFormat::kBf16>::kTileHalfBytes, p.kv_cache,
                                   p.num_kv_heads, v.item.head, ref, key0, lane);
  load_query_tile(stage + SharedPlan<KvFormat::kBf16>::kQueryOffset, p, tq.query, v.count, v.group, v.item.head);
}

__global__ void __launch_bounds__(kThreads, 1) sparse_prefill_pipelined_kernel(const PrefillParams p) {
  constexpr KvFormat F = KvFormat::kBf16;
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ TileQueries s_tq[PipelinedPlan::kStages];

  const PlanView plan = PlanView::from(p);
  const int n = plan.work_count();
  int w = blockIdx.x;
  if (w >= n) return;  // uniform over the CTA
  ItemView cur = ItemView::make(p, plan, w);
  gather_tile_queries(s_tq[0], p, plan, cur);
  __syncthreads();
  int cur_visible = tile_visible_keys(s_tq[0], cur.count);
  issue_bf16_item_loads(smem, p, cur, s_tq[0], cur_visible);
  cute::cp_async_fence();

  for (int i = 0; w < n; ++i, w += gridDim.x) {
    const int stage = i & 1;
    const int w_next = w + int(gridDim.x);
    ItemView next = cur;
    int next_visible = 0;
    // s_tq[stage ^ 1] and the other stage were last read by the previous iteration's attend_tile (barrier below)
    if (w_next < n) {
      next = ItemView::make(p, plan, w_next);
      gather_tile_queries(s_tq[stage ^ 1], p, plan, next);
    }
    __syncthreads();  // s_tq[stage ^ 1] complete
    if (w_next < n) {
      next_visible = tile_visible_keys(s_tq[stage ^ 1], next.count);
      issue_bf16_item_loads(smem + (stage ^ 1) * PipelinedPlan::kStageBytes, p, next, s_tq[stage ^ 1], next_visible);
    }
    cute::cp_async_fence();    // one group per iteration (possibly empty): the counting stays uniform
    cute::cp_async_wait<1>();  // this thread's copies of the current stage have landed
    __syncthreads();           // everyone's
    const uint8_t* cur_stage = smem + stage * PipelinedPlan::kStageBytes;
    attend_tile<F>(p, plan, cur, s_tq[stage], cur_visible, cur_stage,
                   cur_stage + SharedPlan<F>::kQueryOffset);
    __syncthreads();  // the current stage and s_tq[stage] are free for the item after next
    cur = next;
    cur_visible = next_visible;
  }
  cute::cp_async_wait<0>();
}

cudaError_t launch_sparse_prefill_pipelined(const PrefillParams& p, cudaStream_t stream) {
  constexpr int kSmem = PipelinedPlan::kBytes;
  if (cudaError_t e = cuda::ensure_dynamic_smem<sparse_prefill_pipelined_kernel>(kSmem); e != cudaSuccess) return e;
  int sms = 0;
  if (cudaError_t e = cuda::current_sm_count(&sms); e != cudaSuccess) return e;
  const int grid = min(p.work_capacity, sms);  // persistent: one CTA an SM
  if (grid > 0) sparse_prefill_pipelined_kernel<<<unsigned(grid), kThreads, kSmem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jax_msa::sm80::prefill
