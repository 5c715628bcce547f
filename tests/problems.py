"""Random MSA problems and an independent float64 brute-force oracle (MSA.md section 2).

``make_problem`` draws a varlen prefill (or decode) batch over a paged bf16 cache with the corner cases the
kernels must survive: shuffled pages, poisoned unused pages and block-table tails, top-k rows with holes
(-1), duplicates and out-of-range ids, optional padding tokens past ``cu_seqlens_q[-1]``.

``brute_force_attention`` / ``brute_force_decode`` are written straight from the spec as explicit loops
over tokens, KV heads and Python sets of keys; they never call ``jax_msa``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

PAGE = 128  # tokens per page == tokens per sparse block (MSA.md section 1)
INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)


def bf16_round(x) -> np.ndarray:
    """Round to bfloat16 and return the exact values as float64."""
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def bf16_cache_from_kv(k: np.ndarray, v: np.ndarray):
    """The bf16 cache [P, Hkv, 128, 2D] holding K | V per token; returns (kv_cache, k_seen, v_seen), the
    values attention sees (exact here: k and v are already bf16 values)."""
    cache = np.concatenate([k, v], axis=-1).astype(ml_dtypes.bfloat16)
    return jnp.asarray(cache), bf16_round(k), bf16_round(v)


@dataclasses.dataclass
class MsaProblem:
    """One batch. Arrays the ops take are jnp; k, v are the float64 values the cache holds ([P, Hkv, 128, D])."""

    q: jnp.ndarray  # [T, Hq, D] bf16
    kv_cache: jnp.ndarray  # format-dependent (bf16 [P, Hkv, 128, 2D] by default)
    topk: jnp.ndarray  # [Hkv, T, K] int32
    cu_seqlens_q: jnp.ndarray  # [B + 1] int32 (decode: the uniform prefix sums)
    seq_lens: jnp.ndarray  # [B] int32
    block_table: jnp.ndarray  # [B, max_blocks] int32
    k: np.ndarray  # [P, Hkv, 128, D] float64, the K values attention sees
    v: np.ndarray  # [P, Hkv, 128, D] float64
    scale: float
    decode_query_len: int | None = None  # set for decode problems

    @property
    def num_tokens_in_batch(self) -> int:
        return int(np.asarray(self.cu_seqlens_q)[-1])

    def brute_force(self, with_abs_weighted: bool = False):
        """(out, lse[, abs_weighted]) of this problem from the float64 oracle."""
        q = np.asarray(self.q.astype(jnp.float32), np.float64)
        if self.decode_query_len is None:
            return brute_force_attention(q, self.k, self.v, self.topk, self.cu_seqlens_q, self.seq_lens,
                                         self.block_table, self.scale, with_abs_weighted=with_abs_weighted)
        return brute_force_decode(q, self.k, self.v, self.topk, self.decode_query_len, self.seq_lens,
                                  self.block_table, self.scale, with_abs_weighted=with_abs_weighted)

    def prefill_kwargs(self) -> dict:
        return dict(cu_seqlens_q=self.cu_seqlens_q, seq_lens=self.seq_lens, block_table=self.block_table,
                    scale=self.scale)

    def decode_kwargs(self) -> dict:
        return dict(seq_lens=self.seq_lens, block_table=self.block_table,
                    decode_query_len=self.decode_query_len, scale=self.scale)


@functools.lru_cache(maxsize=None)
def cache_maker(fmt, k_scale: float = 1.0, v_scale: float = 1.0):
    """cache_from_kv hook of make_problem for any format: the cache written by jax_msa.reference.write_kv (with the
    scales for FP8 / NVFP4) and the float64 values a kernel sees after dequantization. One maker (and one jitted
    program, compiled once a shape) per (format, scales) for the session."""
    import jax_msa
    from jax_msa import KVFormat, kv_cache, reference

    scales = {} if fmt == KVFormat.BF16 else dict(k_scale=k_scale, v_scale=v_scale)

    @jax.jit
    def written_and_seen(k, v):
        # one compiled program a shape (eagerly, write_kv's and the dequantization's few hundred primitives compile
        # one by one for every new shape: seconds a problem on a GPU backend)
        pages, hkv, _, d = k.shape
        cache = jax_msa.allocate_cache(fmt, pages, hkv, d)
        flat = lambda x: x.transpose(0, 2, 1, 3).reshape(pages * PAGE, hkv, d)
        cache = reference.write_kv(cache, flat(k), flat(v), jnp.arange(pages * PAGE, dtype=jnp.int32), **scales)
        return (cache, *kv_cache.dequantize_cache(cache, d, k_scale, v_scale))

    def make(k, v):
        # k, v rounded to bf16 once, here (make_problem passes bf16 values, which this keeps exact)
        cache, k_seen, v_seen = written_and_seen(jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16))
        return cache, np.asarray(k_seen, np.float64), np.asarray(v_seen, np.float64)
    return make


def _topk_row(rng, n_blocks, pos, topk, max_blocks, *, hole_frac, dup_frac, oob_frac, include_local):
    """One (token, KV head) row of K request-local block ids with the requested corner cases."""
    row = rng.integers(0, max(n_blocks, 1), size=topk).astype(np.int64)
    if n_blocks == 0:
        row[:] = -1
    u = rng.random(topk)
    row[u < hole_frac] = -1
    dup = (u >= hole_frac) & (u < hole_frac + dup_frac)
    if topk > 1:
        for i in np.nonzero(dup)[0]:
            row[i] = row[rng.integers(0, topk)]
    oob = (u >= hole_frac + dup_frac) & (u < hole_frac + dup_frac + oob_frac)
    bad_ids = np.array([n_blocks, n_blocks + 3, max_blocks, max_blocks + 1, INT32_MAX, -2, -7, INT32_MIN])
    row[oob] = rng.choice(bad_ids, size=int(oob.sum()))
    if include_local and pos >= 0:
        row[rng.integers(0, topk)] = pos // PAGE
    return row


def make_problem(seed: int, *, q_lens, seq_lens, num_q_heads: int, num_kv_heads: int, head_dim: int = 128,
                 topk: int = 16, pad_tokens: int = 0, decode_query_len: int | None = None,
                 hole_frac: float = 0.2, dup_frac: float = 0.15, oob_frac: float = 0.1,
                 include_local: bool = True, extra_pages: int = 3, extra_table_cols: int = 2,
                 bad_page_frac: float = 0.0, scale: float | None = None, kv_format: str = "bf16",
                 cache_from_kv: Callable | None = None) -> MsaProblem:
    """A random MSA batch.

    q_lens / seq_lens: new tokens and total KV length per request (seq_len < q_len puts the first tokens
    at negative positions: their sets are empty, MSA.md section 2). pad_tokens: extra
    query rows after cu_seqlens_q[-1] (prefill only). decode_query_len: make a decode problem (q_lens must
    all equal it). hole/dup/oob_frac: per top-k entry probabilities of -1, a duplicate of another entry, an
    out-of-range id (>= the block count, negative other than -1, huge). include_local: every row selects
    the query's own block. The physical pages are a random permutation with ``extra_pages`` unused pages;
    every page (unused ones and the tail past seq_len included) is random data, and block-table columns past
    a request's block count hold random page ids (never to be read). bad_page_frac: probability that a
    used block-table entry is an invalid page id (negative or >= pages): selecting that block is a hole.

    kv_format: "bf16" is built in; for another format pass cache_from_kv(k, v) -> (kv_cache, k_seen,
    v_seen), with k, v the float32 (bf16-valued) [P, Hkv, 128, D] data and k_seen, v_seen the float64
    values the kernels must see after dequantization.
    """
    rng = np.random.default_rng(seed)
    q_lens = [int(x) for x in q_lens]
    seq_lens = [int(x) for x in seq_lens]
    if len(q_lens) != len(seq_lens):
        raise ValueError("q_lens and seq_lens need one entry per request")
    if any(s < 0 or ql < 0 for ql, s in zip(q_lens, seq_lens)):
        raise ValueError("q_lens and seq_lens must be >= 0")
    if num_q_heads % num_kv_heads:
        raise ValueError("num_q_heads must be a multiple of num_kv_heads")
    if decode_query_len is not None and (any(ql != decode_query_len for ql in q_lens) or pad_tokens):
        raise ValueError("a decode problem has q_len == decode_query_len for every request and no padding")
    if cache_from_kv is None:
        if kv_format != "bf16":
            raise NotImplementedError(f"kv_format {kv_format!r}: pass cache_from_kv(k, v)")
        cache_from_kv = bf16_cache_from_kv

    batch = len(q_lens)
    n_blocks = [-(-s // PAGE) for s in seq_lens]
    max_blocks = max(max(n_blocks, default=0), 1) + extra_table_cols
    num_pages = sum(n_blocks) + extra_pages
    perm = rng.permutation(num_pages)
    block_table = np.empty((batch, max_blocks), np.int64)
    used = 0
    for b in range(batch):
        block_table[b, :n_blocks[b]] = perm[used:used + n_blocks[b]]
        used += n_blocks[b]
        block_table[b, n_blocks[b]:] = rng.integers(0, num_pages, size=max_blocks - n_blocks[b])
        bad = rng.random(n_blocks[b]) < bad_page_frac
        block_table[b, :n_blocks[b]][bad] = rng.choice(
            np.array([-1, -5, num_pages, num_pages + 9, INT32_MAX, INT32_MIN]), size=int(bad.sum()))

    k = bf16_round(rng.standard_normal((num_pages, num_kv_heads, PAGE, head_dim))).astype(np.float32)
    v = bf16_round(rng.standard_normal((num_pages, num_kv_heads, PAGE, head_dim))).astype(np.float32)
    kv_cache, k_seen, v_seen = cache_from_kv(k, v)

    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    total_q = int(cu[-1]) + pad_tokens
    q = rng.standard_normal((total_q, num_q_heads, head_dim)).astype(np.float32)
    ids = rng.integers(-1, max_blocks, size=(num_kv_heads, total_q, topk))  # padding rows: random
    for b in range(batch):
        for i in range(q_lens[b]):
            t = int(cu[b]) + i
            pos = seq_lens[b] - q_lens[b] + i
            for g in range(num_kv_heads):
                ids[g, t] = _topk_row(rng, n_blocks[b], pos, topk, max_blocks, hole_frac=hole_frac,
                                      dup_frac=dup_frac, oob_frac=oob_frac, include_local=include_local)

    return MsaProblem(
        q=jnp.asarray(q, jnp.bfloat16), kv_cache=kv_cache, topk=jnp.asarray(ids.astype(np.int32)),
        cu_seqlens_q=jnp.asarray(cu.astype(np.int32)), seq_lens=jnp.asarray(np.array(seq_lens, np.int32)),
        block_table=jnp.asarray(block_table.astype(np.int32)), k=np.asarray(k_seen, np.float64),
        v=np.asarray(v_seen, np.float64), scale=head_dim**-0.5 if scale is None else float(scale),
        decode_query_len=decode_query_len)


def make_decode_problem(seed: int, *, seq_lens, decode_query_len: int = 1, **kwargs) -> MsaProblem:
    """A decode batch: every request has decode_query_len new tokens (its last ones)."""
    return make_problem(seed, q_lens=[decode_query_len] * len(seq_lens), seq_lens=seq_lens,
                        decode_query_len=decode_query_len, **kwargs)


# ---------------------------------------------------------------------------------------------------------
# The float64 oracle, from MSA.md section 2
# ---------------------------------------------------------------------------------------------------------

def _brute_force(q, k, v, topk, token_rows, seq_lens, block_table, scale, with_abs_weighted):
    """token_rows: (t, b, q_len, i) for every query token that belongs to a request; other rows stay empty."""
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    v = np.asarray(v, np.float64)
    topk = np.asarray(topk)
    seq_lens = np.asarray(seq_lens)
    block_table = np.asarray(block_table)
    total_q, hq, d = q.shape
    hkv = topk.shape[0]
    group = hq // hkv
    num_pages = k.shape[0]
    out = np.zeros((total_q, hq, d))
    lse = np.full((total_q, hq), -np.inf)
    abs_weighted = np.zeros((total_q, hq, d))
    for t, b, q_len, i in token_rows:
        seq_len = int(seq_lens[b])
        pos = seq_len - q_len + i
        block_count = -(-seq_len // PAGE)
        for g in range(hkv):
            blocks = {int(x) for x in topk[g, t] if 0 <= int(x) < block_count}  # a set: duplicates once
            kpos = []
            for blk in sorted(blocks):
                if blk >= block_table.shape[1]:
                    continue  # no block-table entry: nothing to read
                page = int(block_table[b, blk])
                if not 0 <= page < num_pages:
                    continue  # an invalid page id makes the block a hole
                keys = PAGE * blk + np.arange(PAGE)
                kpos.append(keys[keys <= pos])  # causal: key position <= query position
            kpos = np.concatenate(kpos) if kpos else np.zeros(0, np.int64)
            if kpos.size == 0:
                continue  # out = 0, lse = -inf
            pages = block_table[b, kpos // PAGE].astype(np.int64)
            kk = k[pages, g, kpos % PAGE]  # [n, D]
            vv = v[pages, g, kpos % PAGE]
            heads = slice(g * group, (g + 1) * group)
            logits = scale * (q[t, heads] @ kk.T)  # [G, n]
            m = logits.max(axis=1, keepdims=True)
            e = np.exp(logits - m)
            s = e.sum(axis=1, keepdims=True)
            out[t, heads] = (e @ vv) / s
            abs_weighted[t, heads] = (e @ np.abs(vv)) / s
            lse[t, heads] = m[:, 0] + np.log(s[:, 0])
    return (out, lse, abs_weighted) if with_abs_weighted else (out, lse)


def brute_force_attention(q, k, v, topk, cu_seqlens_q, seq_lens, block_table, scale, *,
                          with_abs_weighted=False):
    """Prefill / chunked prefill over a varlen batch. q [T, Hq, D]; k, v [P, Hkv, 128, D] (paged values);
    topk [Hkv, T, K]; cu_seqlens_q [B+1]; seq_lens [B]; block_table [B, MB]. Tokens at or beyond
    cu_seqlens_q[-1] are padding (empty). Returns float64 (out [T, Hq, D], lse [T, Hq]) and, with
    with_abs_weighted, sum_k softmax_k * |V_k| (the scale of the error of a low-precision P @ V)."""
    cu = [int(x) for x in np.asarray(cu_seqlens_q)]
    rows = [(t, b, cu[b + 1] - cu[b], t - cu[b]) for b in range(len(cu) - 1) for t in range(cu[b], cu[b + 1])]
    return _brute_force(q, k, v, topk, rows, seq_lens, block_table, scale, with_abs_weighted)


def brute_force_decode(q, k, v, topk, decode_query_len, seq_lens, block_table, scale, *,
                       with_abs_weighted=False):
    """Decode: q [B * decode_query_len, Hq, D]; token i of request b is row b * decode_query_len + i."""
    batch = len(np.asarray(seq_lens))
    rows = [(b * decode_query_len + i, b, decode_query_len, i)
            for b in range(batch) for i in range(decode_query_len)]
    return _brute_force(q, k, v, topk, rows, seq_lens, block_table, scale, with_abs_weighted)


def corrupt_plan(plan, rng, num_work=None):
    """`plan` (a jax_msa.PrefillPlan) with its index arrays overwritten, shapes kept: half the entries int32 values
    far out of every range, half small ones (-3..7, some in range); num_work as given (default: beyond the
    capacity)."""
    def garbage(x):
        x = np.asarray(x)
        wild = rng.integers(-2**31, 2**31 - 1, x.shape, dtype=np.int64)
        small = rng.integers(-3, 8, x.shape)
        return jnp.asarray(np.where(rng.random(x.shape) < 0.5, wild, small).astype(np.int32))

    return dataclasses.replace(plan, edge_query=garbage(plan.edge_query), edge_rank=garbage(plan.edge_rank),
                               query_edge_count=garbage(plan.query_edge_count), work=garbage(plan.work),
                               num_work=jnp.asarray([plan.work_capacity + 5 if num_work is None else num_work],
                                                    jnp.int32))
