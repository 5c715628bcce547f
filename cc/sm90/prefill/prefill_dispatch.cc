// Hopper (sm_90a) sparse prefill: what it serves, the TMA descriptors of the call, the kernel, then the combine.
#include <cstdint>

#include "common/kv_format.h"
#include "cuda/env_flag.h"
#include "cuda/tensor_map.h"
#include "sm80/prefill/prefill.h"
#include "sm90/prefill/prefill.h"

namespace jax_msa::sm90::prefill {

namespace {
constexpr int kHeadDim = 128;  // (config.h's, without pulling CuTe into this host file); kPageSize: common/kv_format.h
}  // namespace

bool fp8_prefill_enabled() {
  static const bool on = !cuda::env_equals("JAX_MSA_SM90_FP8_PREFILL", "0");
  return on;
}

bool nvfp4_prefill_enabled() {
  static const bool on = !cuda::env_equals("JAX_MSA_SM90_NVFP4_PREFILL", "0");
  return on;
}

bool prefill_supports(const PrefillParams& p, const char** why) {
  const int group = p.num_kv_heads > 0 ? p.num_q_heads / p.num_kv_heads : 0;
  const char* reason = nullptr;
  if (p.kv_format == KvFormat::kFp8 && !fp8_prefill_enabled())
    reason = "FP8 KV on the wgmma prefill is switched off (JAX_MSA_SM90_FP8_PREFILL=0)";
  else if (p.kv_format == KvFormat::kNvfp4 && !nvfp4_prefill_enabled())
    reason = "NVFP4 KV on the wgmma prefill is switched off (JAX_MSA_SM90_NVFP4_PREFILL=0)";
  else if (p.kv_format == KvFormat::kNvfp4 && reinterpret_cast<uintptr_t>(p.kv_cache) % 16 != 0)
    reason = "the NVFP4 cache must be 16-byte aligned (bulk copies of its slots)";
  else if (p.q_is_fp8) reason = "the wgmma prefill takes bf16 queries";
  else if (p.head_dim != kHeadDim) reason = "head_dim must be 128";
  else if (group != 8 && group != 16) reason = "the wgmma prefill packs G = 8 or 16 query heads a token";
  else if (p.total_q > 0 && (p.partial_o == nullptr || p.partial_lse == nullptr)) reason = "partial workspaces missing";
  else if (p.num_pages * p.num_kv_heads * kPageSize >= (int64_t(1) << 31) ||
           int64_t(p.total_q) * p.num_q_heads >= (int64_t(1) << 31))
    reason = "TMA row coordinates beyond int32";
  if (why) *why = reason;
  return reason == nullptr;
}

cudaError_t sparse_prefill(const PrefillParams& p, cudaStream_t stream) {
  if (p.total_q == 0) return cudaSuccess;
  TmaPrefillArgs args{};
  args.p = p;
  // The kernel writes its bf16 partial rows in fragment order (4 16-byte stores a row, a lane quad's covering 64
  // contiguous bytes, instead of 16 half-sector ones) and the combine reads them so; JAX_MSA_PARTIAL_FRAGMENT_ORDER=0
  // keeps the natural column order. Read when the call runs (before XLA's command buffer records it), so one process
  // can time both.
  args.p.partial_fragment_order = !cuda::env_equals("JAX_MSA_PARTIAL_FRAGMENT_ORDER", "0");
  const int group = p.num_q_heads / p.num_kv_heads;
  if (cudaError_t e = cuda::encode_bf16_tensor_map_2d(&args.q_map, p.q, uint64_t(p.total_q) * p.num_q_heads, kHeadDim,
                                                      kHeadDim * 2, uint32_t(group), 64);
      e != cudaSuccess)
    return e;
  const bool fp8 = p.kv_format == KvFormat::kFp8;
  if (p.num_pages > 0 && p.kv_format != KvFormat::kNvfp4) {
    const uint64_t rows = uint64_t(p.num_pages) * p.num_kv_heads * kPageSize;
    if (cudaError_t e = fp8 ? cuda::encode_u8_tensor_map_2d(&args.kv_map, p.kv_cache, rows, 2 * kHeadDim, 2 * kHeadDim,
                                                            uint32_t(kPageSize), kHeadDim)
                            : cuda::encode_bf16_tensor_map_2d(&args.kv_map, p.kv_cache, rows, 2 * kHeadDim,
                                                              2 * kHeadDim * 2, uint32_t(kPageSize), 64);
        e != cudaSuccess)
      return e;
  }
  cudaError_t launched = cudaSuccess;
  switch (p.kv_format) {
    case KvFormat::kBf16: launched = launch_sparse_prefill_bf16(args, stream); break;
    case KvFormat::kFp8: launched = launch_sparse_prefill_fp8(args, stream); break;
    case KvFormat::kNvfp4: launched = launch_sparse_prefill_nvfp4(args, stream); break;
  }
  if (launched != cudaSuccess) return launched;
  return sm80::prefill::launch_combine_partials(args.p, stream);
}

}  // namespace jax_msa::sm90::prefill
