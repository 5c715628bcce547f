// The CPU extension module: XLA FFI handlers for platform "cpu" and their registration capsules.
// Target names are shared with the CUDA module (cc/ffi/cuda_module.cc).
#include <nanobind/nanobind.h>

#include <optional>

#include "cpu/handlers.h"
#include "ffi/bindings.h"
#include "ffi/module_common.h"

namespace ffi = xla::ffi;
namespace fb = jax_msa::ffi_bind;

namespace {

// The prefill of p (bound by make_prefill_params: a whole call or one query window).
ffi::Error run_prefill(const jax_msa::PrefillParams& p) {
  if (p.total_q > 0 && p.partial_o_bf16) return fb::invalid("the CPU prefill handler takes float32 partial_o");
  jax_msa::cpu::prefill(p);
  return ffi::Error::Success();
}

ffi::Error prefill_cpu_impl(ffi::AnyBuffer q, ffi::AnyBuffer cache, fb::F32Buffer q_scale, fb::F32Buffer k_scale,
                            fb::F32Buffer v_scale, fb::I32Buffer cu_seqlens_q, fb::I32Buffer seq_lens,
                            fb::I32Buffer block_table, fb::I32Buffer row_ptr, fb::I32Buffer edge_query,
                            fb::I32Buffer edge_rank, fb::I32Buffer query_edge_count,
                            fb::I32Buffer work, fb::I32Buffer num_work, ffi::ResultBuffer<ffi::BF16> out,
                            ffi::ResultBuffer<ffi::F32> lse, ffi::Result<ffi::AnyBuffer> partial_o,
                            ffi::ResultBuffer<ffi::F32> partial_lse, float softmax_scale, int32_t kv_format) {
  jax_msa::PrefillParams p;
  if (auto e = fb::make_prefill_params(p, q, cache, {q_scale, k_scale, v_scale}, cu_seqlens_q, seq_lens, block_table,
                                       row_ptr, edge_query, edge_rank, query_edge_count, work, num_work, out,
                                       lse, partial_o, partial_lse, softmax_scale, kv_format);
      e.failure())
    return e;
  return run_prefill(p);
}

// One query window of sparse_attention(query_chunk_size=...), written into the whole out / lse in place (the
// optional out_in / lse_in are those buffers, aliased to the results: nothing to read from them).
ffi::Error prefill_window_cpu_impl(ffi::AnyBuffer q, ffi::AnyBuffer cache, fb::F32Buffer q_scale,
                                   fb::F32Buffer k_scale, fb::F32Buffer v_scale,
                                   fb::I32Buffer cu_seqlens_q, fb::I32Buffer seq_lens, fb::I32Buffer block_table,
                                   fb::I32Buffer row_ptr, fb::I32Buffer edge_query, fb::I32Buffer edge_rank,
                                   fb::I32Buffer query_edge_count, fb::I32Buffer work, fb::I32Buffer num_work,
                                   std::optional<ffi::Buffer<ffi::BF16>>, std::optional<fb::F32Buffer>,
                                   ffi::ResultBuffer<ffi::BF16> out, ffi::ResultBuffer<ffi::F32> lse,
                                   ffi::Result<ffi::AnyBuffer> partial_o, ffi::ResultBuffer<ffi::F32> partial_lse,
                                   float softmax_scale, int32_t kv_format, int32_t window_start) {
  jax_msa::PrefillParams p;
  if (auto e = fb::make_prefill_params(p, q, cache, {q_scale, k_scale, v_scale}, cu_seqlens_q, seq_lens, block_table,
                                       row_ptr, edge_query, edge_rank, query_edge_count, work, num_work, out,
                                       lse, partial_o, partial_lse, softmax_scale, kv_format, window_start);
      e.failure())
    return e;
  return run_prefill(p);
}

ffi::Error decode_cpu_impl(ffi::AnyBuffer q, ffi::AnyBuffer cache, fb::F32Buffer q_scale, fb::F32Buffer k_scale,
                           fb::F32Buffer v_scale, fb::I32Buffer topk, fb::I32Buffer seq_lens,
                           fb::I32Buffer block_table, ffi::ResultBuffer<ffi::BF16> out,
                           ffi::ResultBuffer<ffi::F32> lse, ffi::ResultBuffer<ffi::F32> partial_o,
                           ffi::ResultBuffer<ffi::F32> partial_lse, float softmax_scale, int32_t kv_format,
                           int32_t decode_query_len) {
  jax_msa::DecodeParams p;
  if (auto e = fb::make_decode_params(p, q, cache, {q_scale, k_scale, v_scale}, topk, seq_lens, block_table, out, lse,
                                      partial_o, partial_lse, softmax_scale, kv_format, decode_query_len);
      e.failure())
    return e;
  jax_msa::cpu::decode(p);
  return ffi::Error::Success();
}

ffi::Error write_kv_cpu_impl(ffi::AnyBuffer cache_in, ffi::Buffer<ffi::BF16> k, ffi::Buffer<ffi::BF16> v,
                             fb::I32Buffer slot_mapping, fb::F32Buffer k_scale, fb::F32Buffer v_scale,
                             ffi::Result<ffi::AnyBuffer> cache_out, int32_t kv_format) {
  jax_msa::WriteKvParams p;
  if (auto e = fb::make_write_kv_params(p, cache_in, k, v, slot_mapping, k_scale, v_scale, cache_out, kv_format);
      e.failure())
    return e;
  jax_msa::cpu::write_kv(p);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMsaPrefillCpu, prefill_cpu_impl, fb::prefill_signature(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMsaPrefillWindowCpu, prefill_window_cpu_impl,
                              fb::prefill_window_signature(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMsaDecodeCpu, decode_cpu_impl, fb::decode_signature(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMsaWriteKvCpu, write_kv_cpu_impl, fb::write_kv_signature(ffi::Ffi::Bind()));

NB_MODULE(_jax_msa_cpu, m) {
  m.def("registrations", []() {
    nanobind::dict d;
    d["jax_msa_prefill"] = jax_msa::ffi_bind::capsule(JaxMsaPrefillCpu);
    d["jax_msa_prefill_window"] = jax_msa::ffi_bind::capsule(JaxMsaPrefillWindowCpu);
    d["jax_msa_decode"] = jax_msa::ffi_bind::capsule(JaxMsaDecodeCpu);
    d["jax_msa_write_kv"] = jax_msa::ffi_bind::capsule(JaxMsaWriteKvCpu);
    return d;
  });
  jax_msa::ffi_bind::add_version_info(m);
}
