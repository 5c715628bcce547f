// Bulk copies from shared to global memory (cp.async.bulk, sm_90): the consumers' partial rows staged in shared memory
// and written by one copy a token (config.h, kBulkPartialStores). Each wrapper carries a "memory" clobber, so the
// compiler keeps the shared-memory stores before the fence and the buffer's next stores after the wait (CuTe's
// tma_store_fence has none).
#pragma once
#include <cstdint>

namespace jax_msa::sm90::prefill::bulk_store {

// Every thread that wrote the buffer, before the barrier after which one thread issues the copy: makes its generic-proxy
// shared-memory stores visible to the async proxy that the copy reads with.
__device__ __forceinline__ void fence_shared_for_async() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// `bytes` (a multiple of 16; both addresses 16-byte aligned) from shared `src` to global `dst`, in this thread's
// current bulk group.
__device__ __forceinline__ void copy(const void* src, void* dst, uint32_t bytes) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(src));
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(s), "r"(bytes)
               : "memory");
}

// Closes this thread's current bulk group.
__device__ __forceinline__ void commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Waits until this thread's committed copies have read their shared sources (the buffer may be written again).
__device__ __forceinline__ void wait_read_all() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }

// Waits until this thread's committed copies are complete (their global writes done): before the CTA exits.
__device__ __forceinline__ void wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

}  // namespace jax_msa::sm90::prefill::bulk_store
