// Switches of the CUDA handlers read from the environment: a variable counts as set to a value when it is exactly
// that string. Opt-in flags are "1" (env_flag), opt-out switches of a default path "0" (env_equals); callers of those
// read them once (a function-local static) so a call never pays for getenv. A switch meant to be flipped between
// calls of one process (to compare two paths in a test) is read per call with env_equals.
#pragma once
#include <cstdlib>
#include <cstring>

namespace jax_msa::cuda {

inline bool env_equals(const char* name, const char* value) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, value) == 0;
}

inline bool env_flag(const char* name) { return env_equals(name, "1"); }

}  // namespace jax_msa::cuda
