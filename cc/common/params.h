// Flat parameter structs of the three custom calls. Every pointer names its shape and dtype; sizes are
// plain ints. Filled once per call by cc/ffi/bindings.h from the XLA FFI buffers; read by the CPU
// handlers (cc/cpu) and the CUDA kernels (cc/cuda, cc/sm80) alike.
//
// Notation: T = total_q, Hq = query heads, Hkv = KV heads, G = Hq / Hkv, D = head_dim, K = top-k,
// B = requests, MB = max_blocks (block_table width), P = pages, R = B * MB (plan rows), S = split-K splits,
// L = entries of a scale (1: a scalar; more when jax.vmap folds per-layer scales into one call).
#pragma once
#include <cstdint>

#include "common/kv_format.h"

namespace jax_msa {

struct PrefillParams {
  // ---- inputs
  const void* q;                    // [T, Hq, D] bf16 bits, or e4m3 when q_is_fp8 (q = e4m3 * q_scale)
  const void* kv_cache;             // see kv_format.h; format = kv_format
  const float* q_scale;             // [] fp32, read only when q_is_fp8
  const float* k_scale;             // [] fp32: K = stored value * k_scale (FP8 / NVFP4 caches; unread for bf16)
  const float* v_scale;             // [] fp32: V = stored value * v_scale (likewise)
  const int32_t* cu_seqlens_q;      // [B + 1]
  const int32_t* seq_lens;          // [B] total KV length per request (new tokens included)
  const int32_t* block_table;       // [B, MB] logical block -> physical page
  // ---- the KV-block-major plan (jax_msa/plan.py; read only through PlanView in plan_view.h)
  const int32_t* row_ptr;           // [Hkv, R + 1] CSR row pointers; row = b * MB + block
  const int32_t* edge_query;        // [Hkv, T * K] query token of each edge, CSR order
  const int32_t* edge_rank;         // [Hkv, T * K] partial slot of each edge within its query
  const int32_t* query_edge_count;  // [Hkv, T] partials per (head, query)
  const int32_t* work;              // [W, 4] (head, row, edge_begin, edge_count), in the plan's work_order
  const int32_t* num_work;          // [1] valid work items (read on device)
  // ---- outputs
  uint16_t* out;                    // [T, Hq, D] bf16 bits
  float* lse;                       // [T, Hq] natural log; -inf for empty selections
  void* partial_o;                  // [T, Hkv, K, G, D] normalized partial outputs: fp32 (CPU handler) or
                                    // bf16 bits (CUDA handler), partial_o_bf16 says which
  bool partial_o_bf16;
  bool partial_fragment_order = false;  // bf16 partial rows in fragment order (common/partial_order.h), set by the
                                        // sm90 host for its kernel and the combine (its default; the warp-MMA
                                        // kernels write the natural order)
  float* partial_lse;               // [T, Hkv, K, G]   fp32 workspace
  // ---- sizes
  int total_q, num_q_heads, num_kv_heads, head_dim, topk;
  int batch, max_blocks, work_capacity;
  int64_t num_pages;
  float softmax_scale;
  KvFormat kv_format;
  bool q_is_fp8;
};

struct DecodeParams {
  // ---- inputs
  const void* q;                    // [B * QL, Hq, D] bf16 bits, or e4m3 when q_is_fp8
  const void* kv_cache;             // see kv_format.h
  // The scales, [L] fp32 each (L = 1: one scalar for the call): request b reads entry b / requests_per_scale.
  // L > 1 comes from jax.vmap's fold of per-layer scales (jax_msa/_batching.py): L layers of B / L requests each.
  const float* q_scale;             // [L] fp32, read only when q_is_fp8
  const float* k_scale;             // [L] fp32: K = stored value * k_scale (FP8 / NVFP4 caches; unread for bf16)
  const float* v_scale;             // [L] fp32: V = stored value * v_scale (likewise)
  const int32_t* topk_ids;          // [Hkv, B * QL, K] request-local block ids, -1 = hole
  const int32_t* seq_lens;          // [B]
  const int32_t* block_table;       // [B, MB]
  // ---- outputs
  uint16_t* out;                    // [B * QL, Hq, D] bf16 bits
  float* lse;                       // [B * QL, Hq]
  float* partial_o;                 // [S, B * QL, Hq, D] fp32 split-K workspace (GPU; S = num_splits)
  float* partial_lse;               // [S, B * QL, Hq]
  // ---- sizes
  int batch, q_len, num_q_heads, num_kv_heads, head_dim, topk, max_blocks, num_splits;
  int requests_per_scale;           // B / L (>= 1)
  uint64_t scale_entry_magic;       // ceil(2^32 / requests_per_scale): the CUDA kernels take request b's entry as
                                    // (b * magic) >> 32, one multiply for a division; exact while b * B <= 2^32
                                    // (their dispatch's B * QL <= 65535)
  int64_t num_pages;
  float softmax_scale;
  KvFormat kv_format;
  bool q_is_fp8;
};

struct WriteKvParams {
  void* kv_cache;                   // the cache, updated in place (aliased input 0 -> output 0)
  const uint16_t* k;                // [N, Hkv, D] bf16 bits
  const uint16_t* v;                // [N, Hkv, D] bf16 bits
  const int32_t* slot_mapping;      // [N] page * 128 + offset; negative or beyond the cache = skip
  // [L] fp32 each (L = 1: one scalar; L > 1 from jax.vmap's fold of per-layer scales): token n reads entry
  // n / tokens_per_scale
  const float* k_scale;             // [L] fp32: stored value = k / k_scale (FP8; NVFP4's global scale; unread for bf16)
  const float* v_scale;             // [L] fp32: likewise for v
  int num_tokens, num_kv_heads, head_dim;
  int tokens_per_scale;             // N / L (>= 1)
  int64_t num_pages;
  KvFormat kv_format;
};

}  // namespace jax_msa
