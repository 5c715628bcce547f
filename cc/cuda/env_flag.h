// Opt-in / opt-out switches of the CUDA handlers: an environment variable counts as set when it is exactly "1".
// Callers read it once (a function-local static) so a call never pays for getenv.
#pragma once
#include <cstdlib>

namespace jax_msa::cuda {

inline bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] == '1' && v[1] == '\0';
}

}  // namespace jax_msa::cuda
