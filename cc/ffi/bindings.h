// XLA FFI signatures of the four custom calls and their translation into the flat params structs.
// One signature per target, shared by the CPU and the CUDA registration (the CUDA one adds a stream); the prefill's
// two targets (a whole call, one query window in place) share their argument and result lists.
// Python side: jax_msa/_ffi.py is the only module that builds these calls; argument order, dtypes and
// attribute names here and there must agree.
#pragma once
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "common/params.h"
#include "xla/ffi/api/ffi.h"

namespace jax_msa::ffi_bind {

namespace ffi = xla::ffi;

using I32Buffer = ffi::Buffer<ffi::S32>;
using F32Buffer = ffi::Buffer<ffi::F32>;

inline int64_t dim(const ffi::AnyBuffer& b, int i) { return b.dimensions()[i]; }
inline int rank(const ffi::AnyBuffer& b) { return int(b.dimensions().size()); }

inline ffi::Error invalid(const std::string& what) { return ffi::Error::InvalidArgument("jax_msa: " + what); }

inline bool is_fp8(const ffi::AnyBuffer& b) { return b.element_type() == ffi::DataType::F8E4M3FN; }

using NamedScale = std::pair<const F32Buffer*, const char*>;

// The fp32 scales, each an operand of its own: a model's per-layer scales (parameters) then reach the call as they
// are, where stacking them into one buffer would cost an XLA kernel a call.
struct ScaleBuffers {
  F32Buffer q, k, v;

  std::array<NamedScale, 3> named() const { return {{{&q, "q_scale"}, {&k, "k_scale"}, {&v, "v_scale"}}}; }

  template <typename P>
  void point(P& p) const {
    p.q_scale = q.typed_data();
    p.k_scale = k.typed_data();
    p.v_scale = v.typed_data();
  }
};

inline ffi::Error check_scalar(const F32Buffer& b, const char* name) {
  return b.element_count() == 1 ? ffi::Error::Success() : invalid(std::string(name) + " must be an fp32 scalar");
}

// The prefill's scales: one scalar each.
template <typename P>
ffi::Error bind_scales(P& p, const ScaleBuffers& s) {
  for (auto [buffer, name] : s.named())
    if (auto e = check_scalar(*buffer, name); e.failure()) return e;
  s.point(p);
  return ffi::Error::Success();
}

// The decode's and write_kv's scales (a range of NamedScale): each a scalar or [L], the same L for all, L dividing the
// call's `items` (decode: requests, write_kv: tokens); item i reads entry i / (items / L). jax.vmap's fold of
// per-layer scales (jax_msa/_batching.py) stacks L layers of items / L each into one call.
template <typename Scales>
ffi::Error group_scales(const Scales& scales, int64_t items, const char* item_name, int& items_per_scale) {
  const int64_t n = scales.begin()->first->element_count();
  for (auto [buffer, name] : scales) {
    if (buffer->dimensions().size() > 1) return invalid(std::string(name) + " must be an fp32 scalar or vector");
    if (buffer->element_count() != n) return invalid("the scales must have the same number of entries");
  }
  if (n < 1 || items % n != 0)
    return invalid("the scales' number of entries must divide the number of " + std::string(item_name));
  items_per_scale = items > 0 ? int(items / n) : 1;
  return ffi::Error::Success();
}

// Checks the query and cache (format, rank, dtype, head_dim); fills q/cache fields shared by the ops.
template <typename P>
ffi::Error bind_q_and_cache(P& p, const ffi::AnyBuffer& q, const ffi::AnyBuffer& cache, int32_t kv_format) {
  if (rank(q) != 3) return invalid("q must be [tokens, Hq, D]");
  if (q.element_type() != ffi::DataType::BF16 && !is_fp8(q)) return invalid("q must be bf16 or float8_e4m3fn");
  if (rank(cache) != 4 || dim(cache, 2) != kPageSize) return invalid("kv_cache must be [pages, heads, 128, bytes]");
  p.q = q.untyped_data();
  p.q_is_fp8 = is_fp8(q);
  p.kv_cache = cache.untyped_data();
  p.num_q_heads = int(dim(q, 1));
  p.head_dim = int(dim(q, 2));
  p.num_pages = dim(cache, 0);
  p.kv_format = KvFormat(kv_format);
  const int64_t D = p.head_dim;
  switch (p.kv_format) {
    case KvFormat::kBf16:
    case KvFormat::kFp8:
      if (cache.element_type() != (p.kv_format == KvFormat::kBf16 ? ffi::DataType::BF16 : ffi::DataType::F8E4M3FN))
        return invalid("kv_cache dtype does not match kv_format");
      if (dim(cache, 3) != 2 * D) return invalid("kv_cache last dim must be 2*D");
      p.num_kv_heads = int(dim(cache, 1));
      break;
    case KvFormat::kNvfp4:
      if (cache.element_type() != ffi::DataType::U8) return invalid("an NVFP4 kv_cache must be uint8");
      if (D % 16 != 0 || dim(cache, 3) != D / 2 + D / 16 || dim(cache, 1) % 2 != 0)
        return invalid("an NVFP4 kv_cache must be [pages, 2*Hkv, 128, D/2 + D/16]");
      p.num_kv_heads = int(dim(cache, 1) / 2);
      break;
    default:
      return invalid("unknown kv_format");
  }
  if (p.num_kv_heads <= 0 || p.num_q_heads % p.num_kv_heads != 0) return invalid("Hq must be a multiple of Hkv");
  return ffi::Error::Success();
}

// ---- prefill ------------------------------------------------------------------------------------------
// args: q, kv_cache, q_scale[], k_scale[], v_scale[] (fp32), cu_seqlens_q[B+1], seq_lens[B], block_table[B,MB],
//       row_ptr, edge_query, edge_rank, query_edge_count, work, num_work
template <typename B>
auto prefill_args(B&& b) {  // by reference: a Binding does not move into a parameter
  return std::move(b).template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<F32Buffer>()
      .template Arg<F32Buffer>()
      .template Arg<F32Buffer>()
      .template Arg<I32Buffer>()
      .template Arg<I32Buffer>()
      .template Arg<I32Buffer>()
      .template Arg<I32Buffer>()
      .template Arg<I32Buffer>()
      .template Arg<I32Buffer>()
      .template Arg<I32Buffer>()
      .template Arg<I32Buffer>()
      .template Arg<I32Buffer>();
}

// rets: out[T,Hq,D] bf16, lse[T,Hq] f32, partial_o[T,Hkv,K,G,D] f32 or bf16 (the handler says which),
//       partial_lse[T,Hkv,K,G] f32
template <typename B>
auto prefill_rets(B&& b) {  // by reference: a Binding does not move into a parameter
  return std::move(b).template Ret<ffi::Buffer<ffi::BF16>>()
      .template Ret<F32Buffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<F32Buffer>();
}

// attrs: softmax_scale (f32), kv_format (i32)
template <typename B>
auto prefill_signature(B b) {
  return prefill_rets(prefill_args(std::move(b)))
      .template Attr<float>("softmax_scale")
      .template Attr<int32_t>("kv_format");
}

// ---- prefill of one query window, in place (sparse_attention(query_chunk_size=...)) ----------------------
// args: the prefill's, with q WHOLE [T_all, Hq, D] and the window's cu_seqlens_q / seq_lens / plan (T = the plan's
//       tokens), then optionally out_in [T_all, Hq, D] bf16 and lse_in [T_all, Hq] f32: the previous window's results,
//       aliased to out / lse (absent for the first window: rows outside this one are then left as XLA allocated them)
// rets: out [T_all, Hq, D], lse [T_all, Hq] (this window's rows written: [window_start, window_start + T)),
//       partial_o / partial_lse as the prefill's, of the window's size
// attrs: softmax_scale (f32), kv_format (i32), window_start (i32)
template <typename B>
auto prefill_window_signature(B b) {
  return prefill_rets(prefill_args(std::move(b))
                          .template OptionalArg<ffi::Buffer<ffi::BF16>>()
                          .template OptionalArg<F32Buffer>())
      .template Attr<float>("softmax_scale")
      .template Attr<int32_t>("kv_format")
      .template Attr<int32_t>("window_start");
}

// No window_start: the whole call (T = q's tokens). With one: the window [window_start, window_start + T) of
// q / out / lse, T the plan's tokens (query_edge_count [Hkv, T]); p's q / out / lse point at the window's first row.
inline ffi::Error make_prefill_params(
    PrefillParams& p, ffi::AnyBuffer q, ffi::AnyBuffer cache, const ScaleBuffers& scales, I32Buffer cu_seqlens_q,
    I32Buffer seq_lens, I32Buffer block_table, I32Buffer row_ptr, I32Buffer edge_query, I32Buffer edge_rank,
    I32Buffer query_edge_count, I32Buffer work, I32Buffer num_work, ffi::ResultBuffer<ffi::BF16> out,
    ffi::ResultBuffer<ffi::F32> lse, ffi::Result<ffi::AnyBuffer> partial_o, ffi::ResultBuffer<ffi::F32> partial_lse,
    float softmax_scale, int32_t kv_format, std::optional<int64_t> window_start = std::nullopt) {
  p = PrefillParams{};
  if (auto e = bind_q_and_cache(p, q, cache, kv_format); e.failure()) return e;
  const int64_t q_rows = dim(q, 0);
  p.total_q = int(q_rows);
  if (window_start) {
    if (*window_start < 0) return invalid("window_start must be >= 0");
    if (query_edge_count.dimensions().size() != 2) return invalid("plan.query_edge_count must be [Hkv, T]");
    const int64_t window = query_edge_count.dimensions()[1];
    if (*window_start + window > q_rows) return invalid("the query window reaches past q's tokens");
    p.total_q = int(window);
  }
  p.batch = int(seq_lens.dimensions()[0]);
  if (cu_seqlens_q.dimensions()[0] != p.batch + 1) return invalid("cu_seqlens_q must be [B+1]");
  if (block_table.dimensions().size() != 2 || block_table.dimensions()[0] != p.batch)
    return invalid("block_table must be [B, max_blocks]");
  p.max_blocks = int(block_table.dimensions()[1]);
  if (edge_query.dimensions().size() != 2 || edge_query.dimensions()[0] != p.num_kv_heads)
    return invalid("plan.edge_query must be [Hkv, T*K]");
  p.topk = p.total_q > 0 ? int(edge_query.dimensions()[1] / p.total_q) : 0;
  if (row_ptr.dimensions()[1] != int64_t(p.batch) * p.max_blocks + 1) return invalid("plan.row_ptr must be [Hkv, R+1]");
  if (work.dimensions().size() != 2 || work.dimensions()[1] != 4) return invalid("plan.work must be [W, 4]");
  p.work_capacity = int(work.dimensions()[0]);
  if (edge_rank.element_count() != edge_query.element_count() ||
      query_edge_count.element_count() != int64_t(p.num_kv_heads) * p.total_q || num_work.element_count() != 1)
    return invalid("plan arrays do not match [Hkv, T*K] / [Hkv, T] / [1]");
  const int64_t G = p.num_q_heads / p.num_kv_heads;
  const int64_t partials = int64_t(p.total_q) * p.num_kv_heads * p.topk * G;
  if (partial_lse->element_count() != partials || partial_o->element_count() != partials * p.head_dim)
    return invalid("prefill partial workspaces must be [T, Hkv, K, G(, D)]");
  if (partial_o->element_type() != ffi::DataType::F32 && partial_o->element_type() != ffi::DataType::BF16)
    return invalid("prefill partial_o must be float32 or bfloat16");
  if (out->element_count() != q_rows * p.num_q_heads * p.head_dim || lse->element_count() != q_rows * p.num_q_heads)
    return invalid("out / lse must be [T, Hq, D] / [T, Hq] (T: q's tokens)");
  if (auto e = bind_scales(p, scales); e.failure()) return e;
  p.cu_seqlens_q = cu_seqlens_q.typed_data();
  p.seq_lens = seq_lens.typed_data();
  p.block_table = block_table.typed_data();
  p.row_ptr = row_ptr.typed_data();
  p.edge_query = edge_query.typed_data();
  p.edge_rank = edge_rank.typed_data();
  p.query_edge_count = query_edge_count.typed_data();
  p.work = work.typed_data();
  p.num_work = num_work.typed_data();
  const int64_t first_row = window_start.value_or(0);
  p.q = static_cast<const char*>(p.q) + first_row * p.num_q_heads * p.head_dim * (p.q_is_fp8 ? 1 : 2);
  p.out = reinterpret_cast<uint16_t*>(out->typed_data()) + first_row * p.num_q_heads * p.head_dim;
  p.lse = lse->typed_data() + first_row * p.num_q_heads;
  p.partial_o = partial_o->untyped_data();
  p.partial_o_bf16 = partial_o->element_type() == ffi::DataType::BF16;
  p.partial_lse = partial_lse->typed_data();
  p.softmax_scale = softmax_scale;
  return ffi::Error::Success();
}

// ---- decode -------------------------------------------------------------------------------------------
// args: q[B*QL,Hq,D], kv_cache, q_scale[L], k_scale[L], v_scale[L] (fp32; L divides B; scalars: L = 1),
//       topk[Hkv,B*QL,K], seq_lens[B], block_table[B,MB]
// rets: out[B*QL,Hq,D] bf16, lse[B*QL,Hq] f32, partial_o[S,B*QL,Hq,D] f32, partial_lse[S,B*QL,Hq] f32
// attrs: softmax_scale (f32), kv_format (i32), decode_query_len (i32)
template <typename B>
auto decode_signature(B b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<F32Buffer>()
      .template Arg<F32Buffer>()
      .template Arg<F32Buffer>()
      .template Arg<I32Buffer>()
      .template Arg<I32Buffer>()
      .template Arg<I32Buffer>()
      .template Ret<ffi::Buffer<ffi::BF16>>()
      .template Ret<F32Buffer>()
      .template Ret<F32Buffer>()
      .template Ret<F32Buffer>()
      .template Attr<float>("softmax_scale")
      .template Attr<int32_t>("kv_format")
      .template Attr<int32_t>("decode_query_len");
}

inline ffi::Error make_decode_params(DecodeParams& p, ffi::AnyBuffer q, ffi::AnyBuffer cache,
                                     const ScaleBuffers& scales, I32Buffer topk, I32Buffer seq_lens,
                                     I32Buffer block_table,
                                     ffi::ResultBuffer<ffi::BF16> out, ffi::ResultBuffer<ffi::F32> lse,
                                     ffi::ResultBuffer<ffi::F32> partial_o, ffi::ResultBuffer<ffi::F32> partial_lse,
                                     float softmax_scale, int32_t kv_format, int32_t decode_query_len) {
  p = DecodeParams{};
  if (auto e = bind_q_and_cache(p, q, cache, kv_format); e.failure()) return e;
  p.batch = int(seq_lens.dimensions()[0]);
  p.q_len = decode_query_len;
  if (p.q_len < 1 || int64_t(p.batch) * p.q_len != dim(q, 0)) return invalid("q must be [B*decode_query_len, Hq, D]");
  if (topk.dimensions().size() != 3 || topk.dimensions()[0] != p.num_kv_heads || topk.dimensions()[1] != dim(q, 0))
    return invalid("topk must be [Hkv, B*decode_query_len, K]");
  p.topk = int(topk.dimensions()[2]);
  if (block_table.dimensions().size() != 2 || block_table.dimensions()[0] != p.batch)
    return invalid("block_table must be [B, max_blocks]");
  p.max_blocks = int(block_table.dimensions()[1]);
  p.num_splits = partial_lse->dimensions().size() == 3 ? int(partial_lse->dimensions()[0]) : 0;
  const int64_t rows = dim(q, 0) * p.num_q_heads;
  if (p.num_splits > 1 && (partial_lse->element_count() != p.num_splits * rows ||
                           partial_o->element_count() != p.num_splits * rows * p.head_dim))
    return invalid("decode split workspaces must be [S, B*QL, Hq(, D)]");
  if (out->element_count() != rows * p.head_dim || lse->element_count() != rows)
    return invalid("out / lse must be [B*QL, Hq, D] / [B*QL, Hq]");
  if (auto e = group_scales(scales.named(), p.batch, "requests", p.requests_per_scale); e.failure()) return e;
  p.scale_entry_magic = ((uint64_t(1) << 32) + p.requests_per_scale - 1) / uint64_t(p.requests_per_scale);
  scales.point(p);
  p.topk_ids = topk.typed_data();
  p.seq_lens = seq_lens.typed_data();
  p.block_table = block_table.typed_data();
  p.out = out->typed_data();
  p.lse = lse->typed_data();
  p.partial_o = partial_o->typed_data();
  p.partial_lse = partial_lse->typed_data();
  p.softmax_scale = softmax_scale;
  return ffi::Error::Success();
}

// ---- write_kv -----------------------------------------------------------------------------------------
// args: kv_cache (aliased to ret 0), k[N,Hkv,D] bf16, v[N,Hkv,D] bf16, slot_mapping[N] i32, k_scale[L], v_scale[L]
//       (fp32; L divides N; scalars: L = 1)
// rets: kv_cache
// attrs: kv_format (i32)
template <typename B>
auto write_kv_signature(B b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::BF16>>()
      .template Arg<ffi::Buffer<ffi::BF16>>()
      .template Arg<I32Buffer>()
      .template Arg<F32Buffer>()
      .template Arg<F32Buffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Attr<int32_t>("kv_format");
}

// Both handlers trust every extent they index, so the buffers are checked against each other here.
inline ffi::Error check_write_kv_buffers(const jax_msa::WriteKvParams& p, const ffi::AnyBuffer& cache,
                                  const ffi::Buffer<ffi::BF16>& v, const I32Buffer& slot_mapping) {
  using jax_msa::KvFormat;
  const int64_t N = p.num_tokens, Hkv = p.num_kv_heads, D = p.head_dim;
  if (v.dimensions().size() != 3 || v.dimensions()[0] != N || v.dimensions()[1] != Hkv || v.dimensions()[2] != D)
    return invalid("v must have k's shape [N, Hkv, D]");
  if (slot_mapping.dimensions().size() != 1 || slot_mapping.dimensions()[0] != N)
    return invalid("slot_mapping must be [N]");
  if (Hkv <= 0 || D <= 0) return invalid("write_kv needs Hkv > 0 and head_dim > 0");
  // [pages..., heads, 128, bytes]: dimension i of the page's [heads, 128, bytes]
  const auto page_dim = [&](int i) { return dim(cache, rank(cache) - 3 + i); };
  if (rank(cache) < 4 || page_dim(1) != jax_msa::kPageSize)
    return invalid("kv_cache must be [pages..., heads, 128, bytes]");
  switch (p.kv_format) {
    case KvFormat::kBf16:
    case KvFormat::kFp8: {
      const auto want = p.kv_format == KvFormat::kBf16 ? ffi::DataType::BF16 : ffi::DataType::F8E4M3FN;
      if (cache.element_type() != want) return invalid("kv_cache dtype does not match kv_format");
      if (page_dim(0) != Hkv || page_dim(2) != 2 * D)
        return invalid("a bf16 / FP8 kv_cache must be [pages, Hkv, 128, 2*D] for k [N, Hkv, D]");
      break;
    }
    case KvFormat::kNvfp4:
      if (cache.element_type() != ffi::DataType::U8) return invalid("an NVFP4 kv_cache must be uint8");
      if (D % 16 != 0) return invalid("an NVFP4 kv_cache needs head_dim % 16 == 0");
      if (page_dim(0) != 2 * Hkv || page_dim(2) != D / 2 + D / 16)
        return invalid("an NVFP4 kv_cache must be [pages, 2*Hkv, 128, D/2 + D/16] for k [N, Hkv, D]");
      break;
    default:
      return invalid("unknown kv_format");
  }
  return ffi::Error::Success();
}

inline ffi::Error make_write_kv_params(WriteKvParams& p, ffi::AnyBuffer cache_in, ffi::Buffer<ffi::BF16> k,
                                       ffi::Buffer<ffi::BF16> v, I32Buffer slot_mapping, F32Buffer k_scale,
                                       F32Buffer v_scale, ffi::Result<ffi::AnyBuffer> cache_out,
                                       int32_t kv_format) {
  p = WriteKvParams{};
  if (cache_out->untyped_data() != cache_in.untyped_data())
    return invalid("write_kv expects its cache output aliased to its cache input");
  if (k.dimensions().size() != 3) return invalid("k must be [N, Hkv, D]");
  // Leading dimensions past the first are more pages: jax.vmap's fold (jax_msa/_batching.py) hands over a stacked
  // cache [L, pages, ...] as it is, since a reshape in front of the aliased custom call made XLA copy the cache.
  if (rank(cache_in) < 4) return invalid("kv_cache must be [pages..., heads, 128, bytes]");
  p.kv_cache = cache_out->untyped_data();
  p.k = k.typed_data();
  p.v = v.typed_data();
  p.slot_mapping = slot_mapping.typed_data();
  p.k_scale = k_scale.typed_data();
  p.v_scale = v_scale.typed_data();
  p.num_tokens = int(k.dimensions()[0]);
  p.num_kv_heads = int(k.dimensions()[1]);
  p.head_dim = int(k.dimensions()[2]);
  p.num_pages = 1;
  for (int i = 0; i + 3 < rank(cache_in); ++i) p.num_pages *= dim(cache_in, i);
  p.kv_format = KvFormat(kv_format);
  if (kv_format < 0 || kv_format > 2) return invalid("unknown kv_format");
  const std::array<NamedScale, 2> scales{{{&k_scale, "k_scale"}, {&v_scale, "v_scale"}}};
  if (auto e = group_scales(scales, p.num_tokens, "tokens", p.tokens_per_scale); e.failure()) return e;
  return check_write_kv_buffers(p, cache_in, v, slot_mapping);
}

}  // namespace jax_msa::ffi_bind
