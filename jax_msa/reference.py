"""Pure-jnp oracle of MSA (``../shared/spec/MSA.md`` section 2), with the public ops' signatures.

Query-major and gather-based: for each query token and KV head, the (deduplicated, valid) selected
blocks are gathered from the paged cache and attended with an fp32 softmax. This is the reference
twin of every custom call; it is also the fallback of ``impl="auto"`` where no kernel exists.

``precision="fp32"`` (default) is the oracle. ``precision="bf16"`` is what a same-precision jnp
implementation of a bf16 kernel reaches (bf16 operands for both products, fp32 accumulation and
softmax, P rounded to bf16): the tests bound kernel errors by a multiple of its error.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_msa import kv_cache as kvc

PAGE_SIZE = kvc.PAGE_SIZE
_BIG = jnp.iinfo(jnp.int32).max


def token_requests(cu_seqlens_q, total_q: int):
    """(request [T] int32, in_batch [T] bool) of every query token under varlen packing."""
    t = jnp.arange(total_q, dtype=jnp.int32)
    cu = cu_seqlens_q.astype(jnp.int32)
    b = jnp.searchsorted(cu[1:], t, side="right", method="scan_unrolled").astype(jnp.int32)
    nb = cu.shape[0] - 1
    in_batch = (t >= cu[0]) & (b < nb)
    return jnp.clip(b, 0, nb - 1), in_batch


def prefill_positions(cu_seqlens_q, seq_lens, total_q: int):
    """(request [T], position [T], in_batch [T]): pos = seq_len_b - q_len_b + i (bottom-right)."""
    b, in_batch = token_requests(cu_seqlens_q, total_q)
    if seq_lens.shape[0] == 0:  # no requests: every token is padding
        return b, jnp.zeros((total_q,), jnp.int32), in_batch
    cu = cu_seqlens_q.astype(jnp.int32)
    q_len = cu[b + 1] - cu[b]
    pos = seq_lens.astype(jnp.int32)[b] - q_len + (jnp.arange(total_q, dtype=jnp.int32) - cu[b])
    return b, pos, in_batch


def decode_positions(seq_lens, decode_query_len: int, total_q: int):
    t = jnp.arange(total_q, dtype=jnp.int32)
    b = t // decode_query_len
    pos = seq_lens.astype(jnp.int32)[b] - decode_query_len + t % decode_query_len
    return b, pos, jnp.ones((total_q,), bool)


def selected_blocks(ids, n_blocks, pos):
    """Set semantics for one token's top-k rows.

    ids [Hkv, K] int32; n_blocks, pos scalars (n_blocks already capped at the block-table width).
    Returns (sorted ids [Hkv, K] with holes as a large sentinel, valid [Hkv, K]): a block is valid when
    0 <= id < n_blocks, its first key is causally visible (128 * id <= pos), and it is the first copy.
    """
    valid = (ids >= 0) & (ids < n_blocks) & (ids <= jnp.floor_divide(pos, PAGE_SIZE))
    s = jnp.sort(jnp.where(valid, ids, _BIG), axis=-1)
    first = jnp.concatenate([jnp.ones_like(s[:, :1], bool), s[:, 1:] != s[:, :-1]], axis=-1)
    return s, (s != _BIG) & first


def _attend_tokens(q, k_pages, v_pages, topk, req, pos, in_batch, seq_lens, block_table, scale,
                   precision, chunk):
    """Core: q [T, Hq, D] fp32; k_pages/v_pages [P, Hkv, 128, D] fp32; topk [Hkv, T, K]."""
    t_total, hq, d = q.shape
    hkv = topk.shape[0]
    g_size = hq // hkv
    num_pages = k_pages.shape[0]
    max_blocks = block_table.shape[1]
    seq_lens = seq_lens.astype(jnp.int32)
    block_table = block_table.astype(jnp.int32)
    if t_total == 0 or seq_lens.shape[0] == 0:  # an empty batch: no token has a request, every row is empty
        return jnp.zeros((t_total, hq, d), jnp.float32), jnp.full((t_total, hq), -jnp.inf, jnp.float32)

    def one(args):
        q_t, ids, b, p, ok = args  # [Hq, D], [Hkv, K], (), (), ()
        n_blk = jnp.minimum((seq_lens[b] + PAGE_SIZE - 1) // PAGE_SIZE, max_blocks)
        n_blk = jnp.where(ok, n_blk, 0)
        blk, valid = selected_blocks(ids, n_blk, p)
        page = block_table[b, jnp.clip(blk, 0, max_blocks - 1)]  # [Hkv, K]
        valid = valid & (page >= 0) & (page < num_pages)  # a bad page is a hole, never read
        page = jnp.where(valid, page, 0)
        g = jnp.arange(hkv)[:, None]
        keys = k_pages[page, g]  # [Hkv, K, 128, D]
        vals = v_pages[page, g]
        kpos = jnp.where(valid, blk, 0)[..., None] * PAGE_SIZE + jnp.arange(PAGE_SIZE)  # [Hkv, K, 128]
        mask = valid[..., None] & (kpos <= p)
        vals = jnp.where(mask[..., None], vals, 0.0)  # keys never attended (past the sequence too) never reach O
        qg = q_t.reshape(hkv, g_size, d)
        if precision == "bf16":
            s = jnp.einsum("ghd,gkjd->ghkj", qg.astype(jnp.bfloat16), keys.astype(jnp.bfloat16),
                           preferred_element_type=jnp.float32)
        else:
            s = jnp.einsum("ghd,gkjd->ghkj", qg, keys, precision=jax.lax.Precision.HIGHEST)
        s = jnp.where(mask[:, None], s * scale, -jnp.inf)
        m = jnp.max(s, axis=(-2, -1), keepdims=True)
        m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
        e = jnp.exp(s - m_safe)  # exactly 0 where masked
        l = jnp.sum(e, axis=(-2, -1))
        if precision == "bf16":
            o = jnp.einsum("ghkj,gkjd->ghd", e.astype(jnp.bfloat16), vals.astype(jnp.bfloat16),
                           preferred_element_type=jnp.float32)
        else:
            o = jnp.einsum("ghkj,gkjd->ghd", e, vals, precision=jax.lax.Precision.HIGHEST)
        empty = l == 0
        o = jnp.where(empty[..., None], 0.0, o / jnp.where(empty, 1.0, l)[..., None])
        lse = jnp.where(empty, -jnp.inf, m_safe[..., 0, 0] + jnp.log(jnp.where(empty, 1.0, l)))
        return o.reshape(hq, d), lse.reshape(hq)

    xs = (q, jnp.moveaxis(topk.astype(jnp.int32), 1, 0), req, pos, in_batch)
    out, lse = jax.lax.map(one, xs, batch_size=min(chunk, max(t_total, 1)))
    return out, lse


def _query_fp32(q, q_scale):
    if jnp.dtype(q.dtype) == jnp.float8_e4m3fn:
        return q.astype(jnp.float32) * jnp.asarray(1.0 if q_scale is None else q_scale, jnp.float32)
    return q.astype(jnp.float32)


def _finish(out, lse, return_lse, out_dtype=jnp.bfloat16):
    out = out.astype(out_dtype)
    return (out, lse) if return_lse else out


def sparse_attention(q, kv_cache, topk, *, cu_seqlens_q, seq_lens, block_table, scale=None,
                     return_lse=False, plan=None, impl="reference", k_scale=None, v_scale=None,
                     q_scale=None, precision="fp32", chunk=64):
    """MSA prefill / chunked prefill over a varlen batch. Same arguments as jax_msa.sparse_attention
    (``plan`` and ``impl`` are accepted and ignored). Returns bf16 out [T, Hq, D] (and fp32 lse [T, Hq])."""
    del plan, impl
    d = q.shape[-1]
    scale = d**-0.5 if scale is None else scale
    k, v = kvc.dequantize_cache(kv_cache, d, 1.0 if k_scale is None else k_scale,
                                1.0 if v_scale is None else v_scale)
    b, pos, in_batch = prefill_positions(cu_seqlens_q, seq_lens, q.shape[0])
    out, lse = _attend_tokens(_query_fp32(q, q_scale), k, v, topk, b, pos, in_batch, seq_lens,
                              block_table, scale, precision, chunk)
    return _finish(out, lse, return_lse)


def sparse_decode(q, kv_cache, topk, *, seq_lens, block_table, decode_query_len=1, scale=None,
                  return_lse=False, impl="reference", k_scale=None, v_scale=None, q_scale=None,
                  precision="fp32", chunk=64):
    """MSA decode: q [B * decode_query_len, Hq, D]; token i of request b sits at
    seq_len_b - decode_query_len + i. Same arguments as jax_msa.sparse_decode."""
    del impl
    d = q.shape[-1]
    scale = d**-0.5 if scale is None else scale
    k, v = kvc.dequantize_cache(kv_cache, d, 1.0 if k_scale is None else k_scale,
                                1.0 if v_scale is None else v_scale)
    b, pos, in_batch = decode_positions(seq_lens, decode_query_len, q.shape[0])
    out, lse = _attend_tokens(_query_fp32(q, q_scale), k, v, topk, b, pos, in_batch, seq_lens,
                              block_table, scale, precision, chunk)
    return _finish(out, lse, return_lse)


def write_kv(kv_cache, k, v, slot_mapping, *, k_scale=None, v_scale=None, impl="reference"):
    """The jnp twin of jax_msa.write_kv."""
    del impl
    return kvc.write_kv_reference(kv_cache, k, v, slot_mapping,
                                  k_scale=1.0 if k_scale is None else k_scale,
                                  v_scale=1.0 if v_scale is None else v_scale)
