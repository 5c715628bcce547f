// The CUDA extension module: XLA FFI handlers for platform "CUDA" and their registration capsules.
// Target names are shared with the CPU module (cc/ffi/cpu_module.cc); signatures come from bindings.h with
// the platform stream bound first. Handlers enqueue work on XLA's stream only: no host synchronisation and
// no allocation, so they are command-buffer (CUDA graph) compatible.
//
// cudart is linked statically: this module imports on machines without a GPU (its registrations are then
// simply never called).
#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "common/kv_format.h"
#include "cuda/kernel_path.h"
#include "cuda/write_kv.h"
#include "ffi/bindings.h"
#include "ffi/cuda_handlers.h"
#include "ffi/module_common.h"
#include "sm80/decode/cluster_launch.h"

#ifndef JAX_MSA_SM90_PREFILL_PINGPONG  // (CMake defines it as 1 when the build switch is on)
#define JAX_MSA_SM90_PREFILL_PINGPONG 0
#endif
#ifndef JAX_MSA_SM90_PREFILL_BULK_STORE  // (likewise)
#define JAX_MSA_SM90_PREFILL_BULK_STORE 0
#endif
#ifndef JAX_MSA_DECODE_TIMELINE  // (likewise)
#define JAX_MSA_DECODE_TIMELINE 0
#endif
#ifndef JAX_MSA_CUDA_ARCHS_CSV
#error "JAX_MSA_CUDA_ARCHS_CSV (the CMAKE_CUDA_ARCHITECTURES list, comma-separated) must be defined by CMake"
#endif

namespace ffi = xla::ffi;
namespace fb = jax_msa::ffi_bind;

namespace {

ffi::Error cuda_failure(const char* what, cudaError_t err) {
  return ffi::Error::Internal(std::string("jax_msa: ") + what + ": " + cudaGetErrorName(err) + " (" +
                             cudaGetErrorString(err) + ")");
}

ffi::Error write_kv_cuda_impl(cudaStream_t stream, ffi::AnyBuffer cache_in, ffi::Buffer<ffi::BF16> k,
                              ffi::Buffer<ffi::BF16> v, fb::I32Buffer slot_mapping, fb::F32Buffer k_scale,
                              fb::F32Buffer v_scale, ffi::Result<ffi::AnyBuffer> cache_out, int32_t kv_format) {
  jax_msa::WriteKvParams p;
  if (auto e = fb::make_write_kv_params(p, cache_in, k, v, slot_mapping, k_scale, v_scale, cache_out, kv_format);
      e.failure())
    return e;
  // the kernel's 16-value chunks (ops.py sends it nothing else: _cuda_write_kv_supported)
  if (p.head_dim % 16 != 0 || p.head_dim > 256)
    return fb::invalid("the CUDA write_kv needs head_dim % 16 == 0 and head_dim <= 256");
  // its row and token indices are 32-bit (cc/cuda/write_kv.cu's MagicDivisor)
  if (int64_t(p.num_tokens) * p.num_kv_heads >= (int64_t(1) << 32))
    return fb::invalid("the CUDA write_kv takes fewer than 2^32 (token, KV head) rows a call");
  if (const cudaError_t err = jax_msa::cuda::launch_write_kv(p, stream); err != cudaSuccess)
    return cuda_failure("write_kv kernel launch failed", err);
  return ffi::Error::Success();
}

// "90a-real,100a-real" -> {"90a", "100a"}: the CMAKE_CUDA_ARCHITECTURES entries without -real / -virtual.
std::vector<std::string> compiled_archs() {
  std::vector<std::string> archs;
  const std::string csv = JAX_MSA_CUDA_ARCHS_CSV;
  size_t begin = 0;
  while (begin <= csv.size()) {
    size_t end = csv.find(',', begin);
    if (end == std::string::npos) end = csv.size();
    std::string arch = csv.substr(begin, end - begin);
    if (const size_t dash = arch.find('-'); dash != std::string::npos) arch.resize(dash);
    if (!arch.empty()) archs.push_back(arch);
    begin = end + 1;
  }
  return archs;
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMsaWriteKvCuda, write_kv_cuda_impl,
                              fb::write_kv_signature(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

NB_MODULE(_jax_msa_cuda, m) {
  m.def("registrations", []() {
    nanobind::dict d;
    d["jax_msa_write_kv"] = jax_msa::ffi_bind::capsule(JaxMsaWriteKvCuda);
    d["jax_msa_decode"] = jax_msa::ffi_bind::capsule(JaxMsaDecodeCuda);
    d["jax_msa_prefill"] = jax_msa::ffi_bind::capsule(JaxMsaPrefillCuda);
    d["jax_msa_prefill_window"] = jax_msa::ffi_bind::capsule(JaxMsaPrefillWindowCuda);
    return d;
  });
  m.def("compiled_archs", &compiled_archs, "CUDA architectures compiled into this module, e.g. ['90a'].");
  m.def(
      "select_kernel_path",
      [](int major, int minor, bool sm100_enabled, bool sm90_enabled) {
        return std::string(jax_msa::cuda::kernel_path_name(jax_msa::cuda::select_kernel_path(
            major, minor, jax_msa::cuda::sm100_kernels_built_for(minor), sm100_enabled,
            jax_msa::cuda::kSm90KernelsBuilt, sm90_enabled)));
      },
      nanobind::arg("major"), nanobind::arg("minor"), nanobind::arg("sm100_enabled"), nanobind::arg("sm90_enabled"),
      "The attention kernels the CUDA handlers pick for a device of this compute capability (cuda/kernel_path.h): "
      "'warp_mma', 'sm90', 'sm100' or 'unsupported'.");
  m.def(
      "build_options",
      []() {
        nanobind::dict d;
        d["sm90_prefill_pingpong"] = bool(JAX_MSA_SM90_PREFILL_PINGPONG);
        d["sm90_prefill_bulk_store"] = bool(JAX_MSA_SM90_PREFILL_BULK_STORE);
        d["decode_timeline"] = bool(JAX_MSA_DECODE_TIMELINE);
        return d;
      },
      "Build switches compiled into this module: {'sm90_prefill_pingpong': bool, 'sm90_prefill_bulk_store': bool, "
      "'decode_timeline': bool} (CMake JAX_MSA_SM90_PREFILL_PINGPONG and JAX_MSA_SM90_PREFILL_BULK_STORE, experiments; "
      "JAX_MSA_DECODE_TIMELINE, a diagnostic; all off by default).");
  m.def(
      "decode_merge_launches",
      []() {
        using jax_msa::sm80::decode::DecodeMerge;
        const auto counts = jax_msa::sm80::decode::decode_merge_counts();
        nanobind::dict d;
        d["combine_kernel"] = counts[int(DecodeMerge::kCombineKernel)];
        d["cluster"] = counts[int(DecodeMerge::kCluster)];
        d["teams"] = counts[int(DecodeMerge::kTeams)];
        d["teams_two_per_sm"] = counts[int(DecodeMerge::kTeamsTwoPerSm)];
        return d;
      },
      "Split-K launches of the warp-MMA decode since the module loaded, by how their splits were merged: "
      "{'combine_kernel': n, 'cluster': n, 'teams': n, 'teams_two_per_sm': n} (sm80/decode/cluster_launch.h; the "
      "last two: the teams of one CTA, at one CTA an SM or at two). A handler counts when it "
      "enqueues, so a call replayed from a captured command buffer is not counted again.");
  jax_msa::ffi_bind::add_version_info(m);
}
