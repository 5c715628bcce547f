"""The indexer's paged key cache: bf16 [pages, 1, 128, index_head_dim], one shared index-key head, paged
exactly like the KV cache (same pages, same block table, slot = page * 128 + offset)."""

from __future__ import annotations

import jax.numpy as jnp

from jax_msa.kv_cache import PAGE_SIZE


def allocate_index_cache(num_pages: int, index_head_dim: int = 128):
    return jnp.zeros((num_pages, 1, PAGE_SIZE, index_head_dim), jnp.bfloat16)


def write_index_keys(index_cache, k_idx, slot_mapping):
    """Scatters k_idx [N, index_head_dim] (rounded to bf16) at slot_mapping [N]; a negative slot or one
    beyond the cache is skipped (as jax_msa.write_kv). Returns the updated cache."""
    pages, _, _, d = index_cache.shape
    slot = slot_mapping.astype(jnp.int32)
    ok = (slot >= 0) & (slot < pages * PAGE_SIZE)
    rows = jnp.where(ok, slot, pages * PAGE_SIZE)  # out of range -> dropped
    flat = index_cache.reshape(pages * PAGE_SIZE, d)
    flat = flat.at[rows].set(k_idx.astype(jnp.bfloat16), mode="drop")
    return flat.reshape(index_cache.shape)
