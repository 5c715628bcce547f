// XLA FFI handler of jax_msa_decode for platform CUDA: binds the buffers into DecodeParams and launches a decode
// kernel on XLA's stream: the warp-MMA one (cc/sm80), or the tcgen05 one (cc/sm100, unverified) where the dispatch
// table selects it and it serves the call. No host sync, no allocation (the split-K partials arrive as extra
// results), so it is safe inside XLA command buffers.
#include <cuda_runtime.h>

#include <string>
#include <utility>

#include "ffi/bindings.h"
#include "ffi/cuda_handlers.h"
#include "ffi/debug_poison.h"
#include "ffi/kernel_path_check.h"
#include "sm100/decode/decode.h"
#include "sm80/decode/decode.h"

namespace ffi = xla::ffi;
namespace fb = jax_msa::ffi_bind;

namespace {

ffi::Error decode_cuda_impl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer cache, fb::F32Buffer q_scale,
                            fb::F32Buffer k_scale, fb::F32Buffer v_scale, fb::I32Buffer topk, fb::I32Buffer seq_lens,
                            fb::I32Buffer block_table,
                            ffi::ResultBuffer<ffi::BF16> out, ffi::ResultBuffer<ffi::F32> lse,
                            ffi::ResultBuffer<ffi::F32> partial_o, ffi::ResultBuffer<ffi::F32> partial_lse,
                            float softmax_scale, int32_t kv_format, int32_t decode_query_len) {
  jax_msa::DecodeParams p;
  if (auto e = fb::make_decode_params(p, q, cache, {q_scale, k_scale, v_scale}, topk, seq_lens, block_table, out, lse,
                                      partial_o, partial_lse, softmax_scale, kv_format, decode_query_len);
      e.failure())
    return e;
  jax_msa::cuda::KernelPath path;
  if (auto e = fb::select_attention_kernels("decode", &path); e.failure()) return e;
  // The tcgen05 decode (unverified) where selected and able to serve the call; the warp-MMA decode otherwise.
  const bool tcgen05 =
      path == jax_msa::cuda::KernelPath::kSm100 && jax_msa::sm100::decode::decode_supports(p, nullptr);
  const char* why = nullptr;
  if (!tcgen05 && !jax_msa::sm80::decode::decode_supports(p, &why))
    return fb::invalid(std::string("the CUDA decode kernel does not serve this call: ") + why);
  for (auto [ptr, bytes] : {std::pair<void*, size_t>{p.out, out->size_bytes()}, {p.lse, lse->size_bytes()},
                            {p.partial_o, partial_o->size_bytes()}, {p.partial_lse, partial_lse->size_bytes()}})
    if (cudaError_t e = fb::poison(ptr, bytes, stream); e != cudaSuccess)
      return ffi::Error::Internal(std::string("jax_msa decode poison failed: ") + cudaGetErrorString(e));
  if (cudaError_t e = tcgen05 ? jax_msa::sm100::decode::sparse_decode(p, stream)
                               : jax_msa::sm80::decode::sparse_decode(p, stream);
      e != cudaSuccess)
    return fb::launch_failure("decode", e);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMsaDecodeCuda, decode_cuda_impl,
                              fb::decode_signature(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
