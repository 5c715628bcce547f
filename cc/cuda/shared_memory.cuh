// Shared memory through generic pointers, kept in the shared address space: the dynamic base rounded up to an
// alignment (TMA and the tensor cores' swizzled operands need 1 KB: the 128-byte swizzle pattern repeats every 1 KB and
// both derive it from the address), and stores through a pointer the compiler can no longer see is shared.
#pragma once
#include <cstdint>

namespace jax_msa::cuda {

// The padding comes from the base's offset in the shared window and is added to the pointer itself. Rounding the
// generic address through an integer would lose the shared address space: every access through the result would
// compile to a generic LD / ST instead of LDS / STS.
template <uint32_t kAlign>
__device__ __forceinline__ uint8_t* align_shared(uint8_t* raw) {
  static_assert(kAlign > 0 && (kAlign & (kAlign - 1)) == 0, "a power of two");
  const uint32_t offset = static_cast<uint32_t>(__cvta_generic_to_shared(raw));
  return raw + ((kAlign - (offset & (kAlign - 1))) & (kAlign - 1));
}

// A 16-byte store to shared memory through a generic pointer into it, as an STS. Meant for the element addresses of
// CuTe's swizzled shared tensors: the swizzle XORs bits of the 64-bit address, after which the compiler no longer
// knows the pointer is shared and a plain store compiles to a generic ST.
__device__ __forceinline__ void store_shared_16(void* smem_ptr, uint4 v) {
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(smem_ptr));
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(address), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// The same for 2 bytes (one bf16 / f16 element's bits).
__device__ __forceinline__ void store_shared_2(void* smem_ptr, uint16_t bits) {
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(smem_ptr));
  asm volatile("st.shared.b16 [%0], %1;" ::"r"(address), "h"(bits) : "memory");
}

}  // namespace jax_msa::cuda
