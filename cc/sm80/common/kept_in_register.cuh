// kept(x): x, as a value the compiler cannot recompute. A loop that uses such a value reads it from the register it
// was left in before the loop, instead of rebuilding it at every use from the thread and block indices (which NVVM
// re-reads inside loops as if they were free). An empty asm move: no instruction in the SASS.
#pragma once
#include <cstdint>

namespace jax_msa::sm80 {

template <class T>
__device__ __forceinline__ T kept(T x) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "a 32- or 64-bit value");
  if constexpr (sizeof(T) == 8) {
    uint64_t v = reinterpret_cast<uint64_t&>(x);
    asm volatile("mov.b64 %0, %0;" : "+l"(v));
    return reinterpret_cast<T&>(v);
  } else {
    uint32_t v = reinterpret_cast<uint32_t&>(x);
    asm volatile("mov.b32 %0, %0;" : "+r"(v));
    return reinterpret_cast<T&>(v);
  }
}

}  // namespace jax_msa::sm80
