// XLA FFI handlers of jax_msa_prefill and jax_msa_prefill_window (one query window, in place) for platform CUDA:
// bind the buffers (plan included) into PrefillParams and launch the prefill and combine kernels on XLA's stream: the
// wgmma prefill (cc/sm90) on the sm90 path where it serves the call, the warp-MMA ones (cc/sm80), or the tcgen05
// prefill (cc/sm100, unverified) where the dispatch table selects it. No host sync, no allocation (the partials
// arrive as extra results), so they are safe inside XLA command buffers.
#include <cuda_runtime.h>

#include <optional>
#include <string>
#include <utility>

#include "ffi/bindings.h"
#include "ffi/cuda_handlers.h"
#include "ffi/debug_poison.h"
#include "ffi/kernel_path_check.h"
#include "sm100/prefill/prefill.h"
#include "sm80/prefill/prefill.h"
#include "sm90/prefill/prefill.h"

namespace ffi = xla::ffi;
namespace fb = jax_msa::ffi_bind;

namespace {

// Picks the kernels for p (bound by make_prefill_params) and launches them on XLA's stream. The debug poison covers
// the rows of out / lse that p's call writes (a window's only: the rest belongs to other windows).
ffi::Error launch_prefill(cudaStream_t stream, const jax_msa::PrefillParams& p, ffi::Result<ffi::AnyBuffer>& partial_o,
                          ffi::ResultBuffer<ffi::F32>& partial_lse) {
  if (p.total_q > 0 && !p.partial_o_bf16) return fb::invalid("the CUDA prefill handler takes bf16 partial_o");
  jax_msa::cuda::KernelPath path;
  if (auto e = fb::select_attention_kernels("prefill", &path); e.failure()) return e;
  const bool tcgen05 = path == jax_msa::cuda::KernelPath::kSm100;
  // sm90 path: the wgmma kernel where it serves the call, the warp-MMA kernel otherwise
  const bool wgmma = path == jax_msa::cuda::KernelPath::kSm90 && jax_msa::sm90::prefill::prefill_supports(p, nullptr);
  const char* why = nullptr;
  const bool supported = tcgen05 ? jax_msa::sm100::prefill::prefill_supports(p, &why)
                         : wgmma ? true
                                 : jax_msa::sm80::prefill::prefill_supports(p, &why);
  if (!supported)
    return fb::invalid(std::string("the CUDA prefill kernel does not serve this call: ") + why);
  const size_t rows = size_t(p.total_q) * p.num_q_heads;
  for (auto [ptr, bytes] : {std::pair<void*, size_t>{p.out, rows * p.head_dim * 2}, {p.lse, rows * sizeof(float)},
                            {p.partial_o, partial_o->size_bytes()}, {p.partial_lse, partial_lse->size_bytes()}})
    if (cudaError_t e = fb::poison(ptr, bytes, stream); e != cudaSuccess)
      return ffi::Error::Internal(std::string("jax_msa prefill poison failed: ") + cudaGetErrorString(e));
  if (cudaError_t e = tcgen05 ? jax_msa::sm100::prefill::sparse_prefill(p, stream)
                       : wgmma   ? jax_msa::sm90::prefill::sparse_prefill(p, stream)
                                 : jax_msa::sm80::prefill::sparse_prefill(p, stream);
      e != cudaSuccess)
    return fb::launch_failure("prefill", e);
  return ffi::Error::Success();
}

ffi::Error prefill_cuda_impl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer cache, fb::F32Buffer q_scale,
                             fb::F32Buffer k_scale, fb::F32Buffer v_scale,
                             fb::I32Buffer cu_seqlens_q, fb::I32Buffer seq_lens, fb::I32Buffer block_table,
                             fb::I32Buffer row_ptr, fb::I32Buffer edge_query, fb::I32Buffer edge_rank,
                             fb::I32Buffer query_edge_count, fb::I32Buffer work, fb::I32Buffer num_work,
                             ffi::ResultBuffer<ffi::BF16> out, ffi::ResultBuffer<ffi::F32> lse,
                             ffi::Result<ffi::AnyBuffer> partial_o, ffi::ResultBuffer<ffi::F32> partial_lse,
                             float softmax_scale, int32_t kv_format) {
  jax_msa::PrefillParams p;
  if (auto e = fb::make_prefill_params(p, q, cache, {q_scale, k_scale, v_scale}, cu_seqlens_q, seq_lens, block_table,
                                       row_ptr, edge_query, edge_rank, query_edge_count, work, num_work, out,
                                       lse, partial_o, partial_lse, softmax_scale, kv_format);
      e.failure())
    return e;
  return launch_prefill(stream, p, partial_o, partial_lse);
}

// One query window of sparse_attention(query_chunk_size=...), written into the whole out / lse in place (the
// optional out_in / lse_in are those buffers, aliased to the results: nothing to read from them).
ffi::Error prefill_window_cuda_impl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer cache,
                                    fb::F32Buffer q_scale, fb::F32Buffer k_scale, fb::F32Buffer v_scale,
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
  return launch_prefill(stream, p, partial_o, partial_lse);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMsaPrefillCuda, prefill_cuda_impl,
                              fb::prefill_signature(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMsaPrefillWindowCuda, prefill_window_cuda_impl,
                              fb::prefill_window_signature(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
