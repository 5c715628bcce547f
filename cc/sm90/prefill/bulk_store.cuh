// What the bulk partial stores (config.h, kBulkPartialStores) need beyond CuTe's SM90_BULK_COPY_S2G, tma_store_arrive
// (commit) and tma_store_wait (read): the writers' async-proxy fence with a "memory" clobber, so the compiler keeps the
// shared-memory stores before it (CuTe's tma_store_fence has none), and the wait for the copies' completion (their
// global writes) before the CTA exits (CuTe waits for the reads only).
#pragma once

namespace jax_msa::sm90::prefill::bulk_store {

// Every thread that wrote the buffer, before the barrier after which one thread issues the copy: makes its
// generic-proxy shared-memory stores visible to the async proxy that the copy reads with.
__device__ __forceinline__ void fence_shared_for_async() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Waits until this thread's committed copies are complete: before the CTA exits.
__device__ __forceinline__ void wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

}  // namespace jax_msa::sm90::prefill::bulk_store
