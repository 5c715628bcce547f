// Helpers shared by the two nanobind extension modules: handler capsules and the build's ABI facts.
#pragma once
#include <nanobind/nanobind.h>

#include <type_traits>

#include "xla/ffi/api/c_api.h"

namespace jax_msa::ffi_bind {

// jax.ffi.register_ffi_target takes a PyCapsule wrapping the handler's function pointer.
template <typename Fn>
nanobind::capsule capsule(Fn* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, Fn, XLA_FFI_CallFrame*>, "not an XLA FFI handler");
  return nanobind::capsule(reinterpret_cast<void*>(fn));
}

// The version of the custom calls' operand lists (cc/ffi/bindings.h), raised whenever one changes; jax_msa/_ffi.py
// builds the calls for FFI_SIGNATURES of the same value. 3: the decode's and write_kv's scales may be [L] vectors,
// entry l for the l-th of L equal slices of the requests / tokens (jax.vmap's fold of per-layer scales; 2026-12-06).
// 2: the scales as scalar operands of their own (2026-12-06). 1, implicit: one [3] buffer.
inline constexpr int kFfiSignatures = 3;

// The XLA FFI API version these handlers were compiled against and their operand lists' version; the import-time
// guard in jax_msa/_ffi.py compares them with the running jaxlib's and its own before anything is registered.
inline void add_version_info(nanobind::module_& m) {
  m.attr("XLA_FFI_API_MAJOR") = int(XLA_FFI_API_MAJOR);
  m.attr("XLA_FFI_API_MINOR") = int(XLA_FFI_API_MINOR);
  m.attr("FFI_SIGNATURES") = kFfiSignatures;
}

}  // namespace jax_msa::ffi_bind
