"""The MSA indexer of MiniMax-M3 in jnp: which KV blocks each query token attends to (MSA.md section 1).

For query token t at request-local position pos (MSA.md section 2) and index head j (one per KV head):

    score[j, t, blk] = max over keys kpos in block blk with kpos <= pos of  q_idx[t, j] . k_idx[kpos]

(-inf for a block with no causally visible key), where k_idx is the one shared index-key head read from
the paged index cache. The dot product takes bf16 operands (q_idx rounded to bf16, keys as stored) with
fp32 accumulation. Blocks ``blk == pos // 128`` (the local block) and ``blk < num_init_blocks`` are forced:
their score is +inf when they are visible. The row ``topk[j, t, :]`` is then the ids of the ``topk``
highest-scoring visible blocks in decreasing score order; among equal scores the lower block id comes
first (deterministic). Fewer than ``topk`` visible blocks: the remaining entries are -1. Tokens outside
the batch (padding) get an all -1 row. Output: int32 [Hkv, T, topk], the format jax_msa.sparse_attention
and jax_msa.sparse_decode take.

The new tokens' index keys must already be in the index cache (write them first with
``write_index_keys``), so prefill, chunked prefill over a cached prefix, and decode (with speculative
tokens) are the same computation over the cache. ``indexer_prefill`` / ``indexer_decode`` have the
argument conventions of the attention ops so that a kernel can replace them one for one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_msa import reference
from jax_msa.kv_cache import PAGE_SIZE


# Requests per call up to which block_scores compares every token with the keys of all the call's requests (one
# shared gather of their pages, then dense matmuls; work grows with the number of requests) instead of gathering
# each token's own request's keys (memory traffic grows with the number of tokens times the context).
DENSE_OVER_BATCH_MAX_REQUESTS = 4
_SCORE_CHUNK_BYTES = 256 << 20  # fp32 scores of one lax.map batch in the dense-over-batch form


def block_scores(q_idx, index_cache, *, req, pos, in_batch, block_table, chunk: int = 32):
    """Raw block scores [H, T, max_blocks] fp32 (-inf where a block has no causally visible key).

    q_idx [T, H, Didx]; index_cache bf16 [P, 1, 128, Didx]; req, pos [T] int32; in_batch [T] bool;
    block_table [B, max_blocks]. Blocks whose page is out of range are treated as having no keys. Batches of
    at most DENSE_OVER_BATCH_MAX_REQUESTS requests take the dense-over-batch form (the same scores)."""
    t_total, h, d = q_idx.shape
    max_blocks = block_table.shape[1]
    if t_total == 0:
        return jnp.zeros((h, 0, max_blocks), jnp.float32)
    if block_table.shape[0] <= DENSE_OVER_BATCH_MAX_REQUESTS:
        return _block_scores_dense_over_batch(q_idx, index_cache, req=req, pos=pos, in_batch=in_batch,
                                              block_table=block_table)
    return _block_scores_per_token(q_idx, index_cache, req=req, pos=pos, in_batch=in_batch,
                                   block_table=block_table, chunk=chunk)


def _block_scores_per_token(q_idx, index_cache, *, req, pos, in_batch, block_table, chunk):
    """Each token gathers its own request's keys [MB, 128, D] (lax.map over tokens, `chunk` at a time)."""
    t_total = q_idx.shape[0]
    num_pages = index_cache.shape[0]
    max_blocks = block_table.shape[1]
    keys_all = index_cache[:, 0]  # [P, 128, D] bf16
    kpos = jnp.arange(max_blocks, dtype=jnp.int32)[:, None] * PAGE_SIZE + jnp.arange(PAGE_SIZE, dtype=jnp.int32)

    def one(args):
        q_t, b, p, ok = args  # [H, D], (), (), ()
        pages = block_table[b]  # [MB]
        page_ok = (pages >= 0) & (pages < num_pages)
        keys = keys_all[jnp.where(page_ok, pages, 0)]  # [MB, 128, D]
        s = jnp.einsum("hd,mjd->hmj", q_t.astype(jnp.bfloat16), keys, preferred_element_type=jnp.float32)
        visible = ok & page_ok[:, None] & (kpos <= p)  # [MB, 128]
        s = jnp.where(visible[None], s, -jnp.inf)
        return jnp.max(s, axis=-1)  # [H, MB]

    scores = jax.lax.map(one, (q_idx, req, pos, in_batch), batch_size=min(chunk, t_total))  # [T, H, MB]
    return jnp.moveaxis(scores, 1, 0)


def _block_scores_dense_over_batch(q_idx, index_cache, *, req, pos, in_batch, block_table):
    """The keys of all B requests' pages are gathered once ([B * MB, 128, D]); every token is scored against all
    of them with one matmul and the keys of other requests are masked out (their max is -inf), so the per-token
    work is B times the per-token form's but it is a dense matmul instead of a gather per token."""
    t_total, h, _ = q_idx.shape
    num_pages = index_cache.shape[0]
    batch, max_blocks = block_table.shape
    pages = block_table.reshape(-1)
    page_ok = ((pages >= 0) & (pages < num_pages)).reshape(batch, max_blocks)
    keys = index_cache[jnp.where(page_ok.reshape(-1), pages, 0), 0]  # [B * MB, 128, D] bf16
    kpos = jnp.arange(max_blocks, dtype=jnp.int32)[:, None] * PAGE_SIZE + jnp.arange(PAGE_SIZE, dtype=jnp.int32)
    requests = jnp.arange(batch, dtype=req.dtype)

    def one(args):
        q_t, b, p, ok = args  # [H, D], (), (), ()
        s = jnp.einsum("hd,njd->hnj", q_t.astype(jnp.bfloat16), keys, preferred_element_type=jnp.float32)
        s = s.reshape(h, batch, max_blocks, PAGE_SIZE)
        visible = ((requests == b) & ok)[:, None, None] & page_ok[:, :, None] & (kpos <= p)[None]  # [B, MB, 128]
        return jnp.max(jnp.where(visible[None], s, -jnp.inf), axis=(1, 3))  # [H, MB]

    per_token = h * batch * max_blocks * PAGE_SIZE * 4
    chunk = max(1, min(t_total, _SCORE_CHUNK_BYTES // per_token))
    scores = jax.lax.map(one, (q_idx, req, pos, in_batch), batch_size=chunk)  # [T, H, MB]
    return jnp.moveaxis(scores, 1, 0)


def select_blocks(scores, *, pos, in_batch, topk: int, num_init_blocks: int = 0):
    """Top-k selection from block scores [H, T, MB]: forced blocks (local, and ids < num_init_blocks) first,
    ties to the lower block id, -1 padding. Returns int32 [H, T, topk]."""
    h, t_total, max_blocks = scores.shape
    blk = jnp.arange(max_blocks, dtype=jnp.int32)
    local = jnp.floor_divide(pos, PAGE_SIZE)[:, None]  # [T, 1]
    visible = in_batch[:, None] & (pos[:, None] >= 0) & (blk[None, :] <= local)  # [T, MB]
    forced = visible & ((blk[None, :] == local) | (blk[None, :] < num_init_blocks))
    s = jnp.where(forced[None], jnp.inf, scores)
    s = jnp.where(visible[None], s, -jnp.inf)
    k = min(topk, max_blocks)
    # lax.top_k returns equal values in increasing index order: the tie-break is the lower block id.
    vals, ids = jax.lax.top_k(s, k)
    ids = jnp.where(vals == -jnp.inf, -1, ids).astype(jnp.int32)
    if k < topk:
        ids = jnp.pad(ids, ((0, 0), (0, 0), (0, topk - k)), constant_values=-1)
    return ids


def _index(q_idx, index_cache, req, pos, in_batch, block_table, topk, num_init_blocks, chunk):
    scores = block_scores(q_idx, index_cache, req=req, pos=pos, in_batch=in_batch,
                          block_table=block_table.astype(jnp.int32), chunk=chunk)
    return select_blocks(scores, pos=pos, in_batch=in_batch, topk=topk, num_init_blocks=num_init_blocks)


def indexer_prefill(q_idx, index_cache, *, cu_seqlens_q, seq_lens, block_table, topk: int = 16,
                    num_init_blocks: int = 0, chunk: int = 32):
    """topk [H, T, topk] int32 for a varlen (chunked) prefill batch: q_idx [T, H, Didx] (post-norm,
    post-RoPE), the index cache already holding every token's key up to seq_lens."""
    if seq_lens.shape[0] == 0:
        return jnp.full((q_idx.shape[1], q_idx.shape[0], topk), -1, jnp.int32)
    req, pos, in_batch = reference.prefill_positions(cu_seqlens_q, seq_lens, q_idx.shape[0])
    return _index(q_idx, index_cache, req, pos, in_batch, block_table, topk, num_init_blocks, chunk)


def indexer_decode(q_idx, index_cache, *, seq_lens, block_table, decode_query_len: int = 1, topk: int = 16,
                   num_init_blocks: int = 0, chunk: int = 32):
    """topk [H, B * decode_query_len, topk] int32 for decode; token i of request b sits at
    seq_lens[b] - decode_query_len + i."""
    req, pos, in_batch = reference.decode_positions(seq_lens, decode_query_len, q_idx.shape[0])
    return _index(q_idx, index_cache, req, pos, in_batch, block_table, topk, num_init_blocks, chunk)
