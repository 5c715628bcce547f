"""Dense causal GQA over the paged KV cache (M3 layers 0-2), with jax.nn.dot_product_attention.

The dense layers read the same paged cache as the sparse ones (after write_kv), so prefill, chunked
prefill and decode are one code path: each query token attends to every key of its request at a position
<= its own (bottom-right causal alignment, MSA.md section 2). Keys are gathered per request from its
block table; keys past seq_len, and pages outside the cache, are zeroed and masked, so stale or poisoned
cache content never reaches the output. Tokens outside the batch get out = 0. bf16 caches only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_msa.kv_cache import PAGE_SIZE


def request_keys_values(kv_cache, seq_lens, block_table):
    """(K, V [B, S, Hkv, D] bf16, valid [B, S] bool) with S = max_blocks * 128, zero where not valid."""
    if kv_cache.dtype != jnp.bfloat16:
        raise ValueError(f"dense attention reads a bf16 cache; got {kv_cache.dtype}")
    num_pages, hkv, _, two_d = kv_cache.shape
    d = two_d // 2
    b, max_blocks = block_table.shape
    page_ok = (block_table >= 0) & (block_table < num_pages)  # [B, MB]
    pages = kv_cache[jnp.where(page_ok, block_table, 0)]  # [B, MB, Hkv, 128, 2D]
    pages = jnp.moveaxis(pages, 2, 3).reshape(b, max_blocks * PAGE_SIZE, hkv, two_d)
    kpos = jnp.arange(max_blocks * PAGE_SIZE, dtype=jnp.int32)
    valid = jnp.repeat(page_ok, PAGE_SIZE, axis=1) & (kpos[None, :] < seq_lens[:, None])
    pages = jnp.where(valid[..., None, None], pages, jnp.zeros((), pages.dtype))
    return pages[..., :d], pages[..., d:], valid


def dense_paged_attention(q, kv_cache, *, req, pos, in_batch, seq_lens, block_table, scale: float,
                          chunk: int = 16):
    """q [T, Hq, D] bf16 -> out [T, Hq, D] bf16: causal GQA of each token over its request's cached keys."""
    t_total, hq, d = q.shape
    if t_total == 0 or seq_lens.shape[0] == 0:
        return jnp.zeros((t_total, hq, d), jnp.bfloat16)
    keys, values, valid = request_keys_values(kv_cache, seq_lens.astype(jnp.int32), block_table.astype(jnp.int32))
    kpos = jnp.arange(keys.shape[1], dtype=jnp.int32)

    def one(args):
        q_t, b, p, ok = args
        mask = valid[b] & (kpos <= p) & ok  # [S]
        out = jax.nn.dot_product_attention(q_t[None, None], keys[b][None], values[b][None], scale=scale,
                                           mask=mask[None, None, None, :], implementation="xla")[0, 0]
        return jnp.where(jnp.any(mask), out, jnp.zeros((), out.dtype))

    out = jax.lax.map(one, (q, req, pos, in_batch), batch_size=min(chunk, t_total))
    return out.astype(jnp.bfloat16)
