// CPU implementations of the three custom calls (registered for platform "cpu" in cc/ffi/cpu_module.cc).
#pragma once
#include "common/params.h"

namespace jax_msa::cpu {

// KV-block-major prefill over the jnp plan: one partial per (query, selected block), then the lse merge.
void prefill(const PrefillParams& p);
// Query-major decode: each (token, KV head) merges its selected blocks on the fly.
void decode(const DecodeParams& p);
// Quantize-on-write of new tokens into the cache (in place).
void write_kv(const WriteKvParams& p);

}  // namespace jax_msa::cpu
