// tcgen05 (sm_100a) sparse decode kernel, UNVERIFIED (see config.h). Semantics: MSA.md section 2, as the warp-MMA
// decode (holes, ids out of range, blocks beyond the causal position and invalid pages are skipped before any read;
// duplicates count once). On any other architecture the kernel only traps (see the prefill kernel).
#pragma once
#include <cuda_bf16.h>

#include <cute/tensor.hpp>

#include "common/numeric.h"
#include "common/params.h"
#include "cuda/shared_memory.cuh"
#include "sm100/common/kv_unit.cuh"
#include "sm100/common/tcgen05.cuh"
#include "sm100/decode/config.h"

namespace jax_msa::sm100::decode {

struct BlockRef {
  int64_t page;
  int visible;  // 1..128 keys of the block are attended
};

// Per-head reduction over the CTA's 128 threads (max or sum), through shared memory s_red[kWarps][kHeads].
template <bool kMax>
__device__ __forceinline__ void reduce_heads(float (&v)[kHeads], float (*s_red)[kHeads]) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
  for (int h = 0; h < kHeads; ++h) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const float o = __shfl_xor_sync(0xffffffffu, v[h], off);
      v[h] = kMax ? fmaxf(v[h], o) : v[h] + o;
    }
  }
  __syncthreads();  // s_red is free (a previous reduction's readers are done)
  if (lane == 0) {
#pragma unroll
    for (int h = 0; h < kHeads; ++h) s_red[warp][h] = v[h];
  }
  __syncthreads();
#pragma unroll
  for (int h = 0; h < kHeads; ++h) {
    float r = s_red[0][h];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) r = kMax ? fmaxf(r, s_red[w][h]) : r + s_red[w][h];
    v[h] = r;
  }
}

template <KvFormat F>
__global__ void __launch_bounds__(kThreads, 1) sparse_decode_tcgen05_kernel(const DecodeParams p) {
#if defined(JAX_MSA_SM100_TCGEN05)
  using namespace cute;
  extern __shared__ uint8_t smem_raw[];
  __shared__ BlockRef s_blocks[kMaxTopk];
  __shared__ int s_num_blocks;
  __shared__ float s_red[kWarps][kHeads];
  __shared__ alignas(8) uint64_t s_mma_done;
  __shared__ uint32_t s_tmem_base;

  const int split = blockIdx.x, g = blockIdx.y, t = blockIdx.z;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int b = t / p.q_len;
  const int seq_len = p.seq_lens[b];
  const int pos = seq_len - p.q_len + t % p.q_len;
  const int64_t tokens = int64_t(p.batch) * p.q_len;

  uint8_t* smem = cuda::align_shared<SharedPlan::kAlign>(smem_raw);
  Tensor sK = make_tensor(make_smem_ptr(reinterpret_cast<Bf16*>(smem + SharedPlan::kKVOffset)), LayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(reinterpret_cast<Bf16*>(smem + SharedPlan::kKVOffset)), LayoutV{});
  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Bf16*>(smem + SharedPlan::kQOffset)), LayoutQ{});
  auto sP = [&](int i) {
    return make_tensor(make_smem_ptr(reinterpret_cast<Bf16*>(smem + SharedPlan::kPOffset + i * SharedPlan::kPBytes)),
                       LayoutP{});
  };

  // ---- 1. the valid, deduplicated blocks of (t, g) (one warp ballot) and this split's share; Q; TMEM; barrier
  if (warp == 0) {
    const int n_blocks = min((seq_len + kPageSize - 1) / kPageSize, p.max_blocks);
    const int32_t* row = p.topk_ids + (int64_t(g) * tokens + t) * p.topk;
    const int id = lane < p.topk ? row[lane] : -1;
    bool valid = id >= 0 && id < n_blocks && pos >= 0 && id <= pos / kPageSize;
    for (int j = 0; j < lane && j < p.topk; ++j) valid = valid && row[j] != id;  // first copy only
    const int64_t page = valid ? p.block_table[int64_t(b) * p.max_blocks + id] : -1;
    valid = valid && page >= 0 && page < p.num_pages;
    const unsigned mask = __ballot_sync(0xffffffffu, valid);
    const int n = __popc(mask);
    const int splits = p.num_splits > 1 ? p.num_splits : 1;
    const int first = split * n / splits, last = (split + 1) * n / splits;
    const int rank = __popc(mask & ((1u << lane) - 1u));
    if (valid && rank >= first && rank < last)
      s_blocks[rank - first] = BlockRef{page, min(kPageSize, pos - id * kPageSize + 1)};
    if (lane == 0) s_num_blocks = last - first;  // <= kMaxBlocks: decode_supports checks ceil(K / splits)
  }
  // Q rows (heads of (t, g); rows >= G zero) as bf16 into sQ
  for (int i = tid; i < kHeads * kUnitsPerRow; i += kThreads) {
    const int h = i / kUnitsPerRow, u = i % kUnitsPerRow;
    uint4 val = make_uint4(0u, 0u, 0u, 0u);
    if (h < group) {
      const int64_t elem = (int64_t(t) * p.num_q_heads + int64_t(g) * group + h) * kHeadDim + 8 * u;
      val = p.q_is_fp8 ? e4m3x8_to_bf16x8(*reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(p.q) + elem))
                       : *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.q) + elem);
    }
    const int d = 8 * u;
    cuda::store_shared_16(&sQ(make_coord(make_coord(h, d % 16), 0, d / 16)), val);
  }
  const uint32_t tmem = tmem_alloc_and_init_barrier(TmemPlan::kColumns, &s_tmem_base, &s_mma_done);
  const int n = s_num_blocks;
  int phase = 0;

  // Loads block i's K (kv = 0, into sK) or V (kv = 1, into sV) as bf16, keys beyond its visible ones zero, then
  // hands the buffer to the tensor cores.
  auto load_block = [&](int i, int kv) {
    const BlockRef ref = s_blocks[i];
    for (int j = tid; j < kBlockKeys * kUnitsPerRow; j += kThreads) {
      const int key = j / kUnitsPerRow, u = j % kUnitsPerRow, d = 8 * u;
      const uint4 val = key < ref.visible ? load_kv_unit<F>(p.kv_cache, p.num_kv_heads, ref.page, g, key, kv, u)
                                          : make_uint4(0u, 0u, 0u, 0u);
      if (kv == 0) cuda::store_shared_16(&sK(make_coord(make_coord(key, d % 16), 0, d / 16)), val);
      else cuda::store_shared_16(&sV(make_coord(make_coord(d, key % 16), 0, key / 16)), val);
    }
    cutlass::arch::fence_view_async_shared();
    tcgen05_before_thread_sync();
    __syncthreads();
  };
  // ---- 2. S^T of every block into TMEM columns [16 i, 16 i + 16)
  MmaS mma_s;
  for (int i = 0; i < n; ++i) {
    load_block(i, 0);
    if (warp == 0) issue_mma(mma_s, sK, sQ, KeysByHeads{}, tmem + kHeads * i, false, &s_mma_done);
    wait_mma(&s_mma_done, phase);  // the K / V buffer is free again
  }

  // ---- 3. exact softmax over the split's keys (log2 units): thread = key lane of every block
  const bool quantized = F != KvFormat::kBf16;
  // b / requests_per_scale (0 but under jax.vmap's fold of per-layer scales), as one multiply (params.h)
  const int scale_entry = int((uint64_t(b) * p.scale_entry_magic) >> 32);
  const float q_scale = p.q_is_fp8 ? p.q_scale[scale_entry] : 1.0f;
  const float k_scale = quantized ? p.k_scale[scale_entry] : 1.0f;
  const float v_scale = quantized ? p.v_scale[scale_entry] : 1.0f;
  const float scale_log2 = p.softmax_scale * q_scale * k_scale * kLog2e;
  const uint32_t lane_addr = tmem + (uint32_t(warp * 32) << 16);
  float m[kHeads], l[kHeads];
#pragma unroll
  for (int h = 0; h < kHeads; ++h) m[h] = -INFINITY, l[h] = 0.0f;
  for (int i = 0; i < n; ++i) {
    float s[kHeads];
    tmem_load_row16(lane_addr + kHeads * i, s);
    if (tid < s_blocks[i].visible) {
#pragma unroll
      for (int h = 0; h < kHeads; ++h) m[h] = fmaxf(m[h], s[h] * scale_log2);
    }
  }
  reduce_heads<true>(m, s_red);
  for (int i = 0; i < n; ++i) {
    float s[kHeads];
    tmem_load_row16(lane_addr + kHeads * i, s);
    const bool live = tid < s_blocks[i].visible;
    Tensor sPi = sP(i);
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
      const float pr = live && m[h] != -INFINITY ? exp2f(s[h] * scale_log2 - m[h]) : 0.0f;
      l[h] += pr;
      cuda::store_shared_2(&sPi(make_coord(make_coord(h, tid % 16), 0, tid / 16)), Bf16(pr).raw());
    }
  }
  reduce_heads<false>(l, s_red);
  cutlass::arch::fence_view_async_shared();
  tcgen05_before_thread_sync();
  __syncthreads();  // every thread's scores are read: TMEM columns [0, 16) take O^T

  // ---- 4. O^T = sum over blocks of V^T P^T into TMEM columns [0, 16)
  MmaO mma_o;
  for (int i = 0; i < n; ++i) {
    load_block(i, 1);
    if (warp == 0) issue_mma(mma_o, sV, sP(i), DimsByHeads{}, tmem + TmemPlan::kOColumn, i > 0, &s_mma_done);
    wait_mma(&s_mma_done, phase);
  }

  // ---- 5. thread = dim d: the heads' outputs (0 and lse -inf for an empty selection)
  float o[kHeads];
  if (n > 0) tmem_load_row16(lane_addr + TmemPlan::kOColumn, o);
  const int d = tid;
  const int64_t row_base = int64_t(t) * p.num_q_heads + int64_t(g) * group;
#pragma unroll
  for (int h = 0; h < kHeads; ++h) {
    if (h >= group) break;
    const bool empty = n == 0 || !(l[h] > 0.0f);
    const float val = empty ? 0.0f : o[h] * (v_scale / l[h]);
    const float lse = empty ? -INFINITY : (m[h] + log2f(l[h])) * kLn2;
    const int64_t out_row = row_base + h;
    if (p.num_splits <= 1) {
      const __nv_bfloat16 bv = __float2bfloat16_rn(val);
      p.out[out_row * kHeadDim + d] = *reinterpret_cast<const uint16_t*>(&bv);
      if (d == 0) p.lse[out_row] = lse;
    } else {
      const int64_t prow = int64_t(split) * tokens * p.num_q_heads + out_row;
      p.partial_o[prow * kHeadDim + d] = val;
      if (d == 0) p.partial_lse[prow] = lse;
    }
  }

  tmem_free(tmem, TmemPlan::kColumns);
#else
  __trap();  // no tcgen05 on this architecture (e.g. a forced compute capability): fail, never write garbage
#endif
}

}  // namespace jax_msa::sm100::decode
