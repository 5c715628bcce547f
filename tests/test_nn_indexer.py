"""The MSA indexer (jax_msa.nn.indexer) against an independent numpy loop reference.

Index queries and keys are small integers (exact in bf16, and every dot product and block max exact in
fp32), so the comparison is exact, ties included: equal block scores are frequent by construction and
must resolve to the lower block id. The index cache is written with write_index_keys into shuffled pages;
unused pages and the not-yet-written slots of each request's last page hold NaN (poison), and block-table
tails hold out-of-range page ids.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")

from jax_msa.nn.index_cache import allocate_index_cache, write_index_keys  # noqa: E402
from jax_msa import reference  # noqa: E402
from jax_msa.nn import indexer as indexer_module  # noqa: E402
from jax_msa.nn.indexer import indexer_decode, indexer_prefill  # noqa: E402

PAGE = 128
HEADS, DIM = 2, 32


def numpy_indexer(q_idx, keys, requests, positions, topk, num_init_blocks=0):
    """Straight from the definition. q_idx [T, H, D]; keys[b] [seq_len_b, D]; requests/positions [T]
    (request -1 = padding token). Returns int32 [H, T, topk]."""
    t_total, h, _ = q_idx.shape
    out = np.full((h, t_total, topk), -1, np.int32)
    for t in range(t_total):
        b, pos = requests[t], positions[t]
        if b < 0 or pos < 0:
            continue
        local = pos // PAGE
        for j in range(h):
            scored = []
            for blk in range(local + 1):
                kb = keys[b][blk * PAGE: min(blk * PAGE + PAGE, pos + 1)].astype(np.float64)
                score = float(np.max(kb @ q_idx[t, j].astype(np.float64)))
                if blk == local or blk < num_init_blocks:
                    score = np.inf
                scored.append((-score, blk))
            chosen = [blk for _, blk in sorted(scored)][:topk]
            out[j, t, :len(chosen)] = chosen
    return out


def integer_values(rng, shape, low=-2, high=2):
    return rng.integers(low, high + 1, size=shape).astype(np.float32)


def paged_index_cache(rng, keys, num_pages, max_blocks):
    """Writes keys[b] [L_b, D] into shuffled pages with write_index_keys; returns (cache, block_table)."""
    perm = rng.permutation(num_pages)
    block_table = np.full((len(keys), max_blocks), num_pages + 7, np.int32)  # out-of-range tails
    used, slots, rows = 0, [], []
    for b, kb in enumerate(keys):
        n_blk = -(-len(kb) // PAGE)
        block_table[b, :n_blk] = perm[used:used + n_blk]
        used += n_blk
        pos = np.arange(len(kb))
        slots.append(block_table[b, pos // PAGE] * PAGE + pos % PAGE)
        rows.append(kb)
    cache = jnp.full(allocate_index_cache(num_pages, DIM).shape, jnp.nan, jnp.bfloat16)  # poison everywhere
    slots = np.concatenate(slots + [np.array([-1, num_pages * PAGE], np.int64)])  # two skipped slots
    rows = np.concatenate(rows + [np.full((2, DIM), 1e4, np.float32)])
    cache = write_index_keys(cache, jnp.asarray(rows), jnp.asarray(slots, jnp.int32))
    return cache, jnp.asarray(block_table)


@functools.partial(jax.jit, static_argnames=("topk", "num_init_blocks"))
def run_prefill(q_idx, cache, cu, seq_lens, block_table, topk, num_init_blocks=0):
    return indexer_prefill(q_idx, cache, cu_seqlens_q=cu, seq_lens=seq_lens, block_table=block_table, topk=topk,
                           num_init_blocks=num_init_blocks)


@functools.partial(jax.jit, static_argnames=("decode_query_len", "topk"))
def run_decode(q_idx, cache, seq_lens, block_table, decode_query_len, topk):
    return indexer_decode(q_idx, cache, seq_lens=seq_lens, block_table=block_table,
                          decode_query_len=decode_query_len, topk=topk)


def prefill_case(seed, seq_lens, new_lens, padding, topk, num_init_blocks=0, key_range=2):
    rng = np.random.default_rng(seed)
    keys = [integer_values(rng, (n, DIM), -key_range, key_range) for n in seq_lens]
    max_blocks = max(-(-n // PAGE) for n in seq_lens) + 1
    cache, block_table = paged_index_cache(rng, keys, num_pages=sum(-(-n // PAGE) for n in seq_lens) + 3,
                                           max_blocks=max_blocks)
    total = sum(new_lens)
    q_idx = integer_values(rng, (total + padding, HEADS, DIM))
    requests = np.concatenate([np.full(n, b) for b, n in enumerate(new_lens)] + [np.full(padding, -1)])
    positions = np.concatenate([np.arange(s - n, s) for s, n in zip(seq_lens, new_lens)] + [np.zeros(padding, int)])
    cu = np.concatenate([[0], np.cumsum(new_lens)]).astype(np.int32)
    got = run_prefill(jnp.asarray(q_idx), cache, jnp.asarray(cu), jnp.asarray(seq_lens, jnp.int32), block_table,
                      topk=topk, num_init_blocks=num_init_blocks)
    want = numpy_indexer(q_idx, keys, requests.astype(int), positions.astype(int), topk, num_init_blocks)
    return np.asarray(got), want, requests, positions


def test_prefill_varlen_chunked_matches_numpy():
    # request 0: 100 tokens (1 block < topk); request 1: last 250-token chunk of 900 (cached prefix, 8 blocks);
    # request 2: 600 tokens from scratch (5 blocks); 3 padding tokens past cu_seqlens_q[-1].
    got, want, requests, positions = prefill_case(0, seq_lens=[100, 900, 600], new_lens=[100, 250, 600],
                                                  padding=3, topk=4)
    assert got.dtype == np.int32 and got.shape == want.shape == (HEADS, 953, 4)
    np.testing.assert_array_equal(got, want)
    # Structural facts the reference also encodes: local block first, -1 only as padding, rows of padding tokens.
    live = requests >= 0
    np.testing.assert_array_equal(got[:, live, 0], np.broadcast_to(positions[live] // PAGE, (HEADS, live.sum())))
    assert (got[:, ~live] == -1).all()
    short = live & (positions < 3 * PAGE)  # fewer visible blocks than topk: -1 tail
    n_vis = positions[short] // PAGE + 1
    assert ((got[:, short] >= 0).sum(-1) == n_vis).all()


def test_ties_resolve_to_lower_block_id():
    # Keys in {0, 1} and queries all ones over 32 dims: block maxima tie heavily (most blocks reach the same max).
    got, want, _, _ = prefill_case(1, seq_lens=[1100], new_lens=[1100], padding=0, topk=4, key_range=0)
    np.testing.assert_array_equal(got, want)  # key_range=0: every key is 0 -> every score ties at 0
    last = got[:, -1]  # position 1099, local block 8, then blocks 0, 1, 2
    np.testing.assert_array_equal(last, np.broadcast_to([8, 0, 1, 2], last.shape))


def test_partial_ties_and_init_blocks_match_numpy():
    got, want, _, _ = prefill_case(2, seq_lens=[1000, 333], new_lens=[1000, 333], padding=0, topk=5,
                                   num_init_blocks=1, key_range=1)
    np.testing.assert_array_equal(got, want)
    assert (got[:, :, :2] == 0).any(axis=-1).all()  # block 0 forced into every row's first two entries


def test_topk_wider_than_block_table():
    got, want, _, _ = prefill_case(3, seq_lens=[300], new_lens=[300], padding=0, topk=8)
    np.testing.assert_array_equal(got, want)
    assert (got[:, :, 3:] == -1).all()


def test_decode_with_speculative_tokens_matches_numpy():
    rng = np.random.default_rng(4)
    seq_lens = [130, 1025, 7]
    q_len = 3
    keys = [integer_values(rng, (n, DIM)) for n in seq_lens]
    cache, block_table = paged_index_cache(rng, keys, num_pages=16, max_blocks=10)
    q_idx = integer_values(rng, (len(seq_lens) * q_len, HEADS, DIM))
    requests = np.repeat(np.arange(len(seq_lens)), q_len)
    positions = np.concatenate([np.arange(s - q_len, s) for s in seq_lens])
    got = run_decode(jnp.asarray(q_idx), cache, jnp.asarray(seq_lens, jnp.int32), block_table,
                     decode_query_len=q_len, topk=4)
    np.testing.assert_array_equal(np.asarray(got), numpy_indexer(q_idx, keys, requests, positions, 4))


def test_decode_equals_prefill_rows():
    """The same tokens indexed as decode rows and as the last rows of a prefill give the same selection."""
    rng = np.random.default_rng(5)
    seq_lens = [700, 260]
    q_len = 2
    keys = [integer_values(rng, (n, DIM)) for n in seq_lens]
    cache, block_table = paged_index_cache(rng, keys, num_pages=9, max_blocks=6)
    q_idx = jnp.asarray(integer_values(rng, (len(seq_lens) * q_len, HEADS, DIM)))
    sl = jnp.asarray(seq_lens, jnp.int32)
    dec = run_decode(q_idx, cache, sl, block_table, decode_query_len=q_len, topk=3)
    pre = run_prefill(q_idx, cache, jnp.asarray([0, q_len, 2 * q_len], jnp.int32), sl, block_table, topk=3)
    np.testing.assert_array_equal(np.asarray(dec), np.asarray(pre))


def test_write_index_keys_scatters_rows_and_skips_bad_slots():
    rng = np.random.default_rng(6)
    pages = 3
    cache = jnp.full(allocate_index_cache(pages, DIM).shape, jnp.nan, jnp.bfloat16)
    slots = np.array([0, 129, 383, -1, pages * PAGE, 250], np.int32)
    rows = integer_values(rng, (len(slots), DIM)) * 0.5
    got = np.asarray(write_index_keys(cache, jnp.asarray(rows), jnp.asarray(slots)).astype(jnp.float32))
    want = np.full((pages * PAGE, DIM), np.nan, np.float32)
    keep = (slots >= 0) & (slots < pages * PAGE)
    want[slots[keep]] = rows[keep]
    np.testing.assert_array_equal(got.reshape(pages * PAGE, DIM), want)  # NaN positions must match too


@pytest.mark.parametrize("requests", [1, 3, 6])
def test_dense_over_batch_scores_equal_per_token_scores(requests):
    # Both forms of block_scores on the same (NaN-poisoned, shuffled, out-of-range-tailed) cache, with padding
    # tokens (block_scores takes the dense form for <= 4 requests). Integer-valued data: every dot product is
    # exact, so the forms agree bit for bit; float data: they agree to fp32 summation order.
    rng = np.random.default_rng(500 + requests)
    seq_lens = rng.integers(1, 700, size=requests)
    new_lens = np.minimum(seq_lens, rng.integers(1, 300, size=requests))
    keys = [integer_values(rng, (n, DIM)) for n in seq_lens]
    max_blocks = max(-(-int(n) // PAGE) for n in seq_lens) + 1
    cache, block_table = paged_index_cache(rng, keys, num_pages=sum(-(-int(n) // PAGE) for n in seq_lens) + 3,
                                           max_blocks=max_blocks)
    total, padding = int(new_lens.sum()), 5
    q_int = jnp.asarray(integer_values(rng, (total + padding, HEADS, DIM)), jnp.bfloat16)
    q_float = jnp.asarray(rng.standard_normal((total + padding, HEADS, DIM)), jnp.bfloat16)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(new_lens)]), jnp.int32)
    req, pos, in_batch = reference.prefill_positions(cu, jnp.asarray(seq_lens, jnp.int32), total + padding)
    args = dict(req=req, pos=pos, in_batch=in_batch, block_table=block_table)
    dense_fn = jax.jit(lambda q, c: indexer_module._block_scores_dense_over_batch(q, c, **args))
    per_token_fn = jax.jit(lambda q, c: indexer_module._block_scores_per_token(q, c, chunk=32, **args))
    dense, per_token = np.asarray(dense_fn(q_int, cache)), np.asarray(per_token_fn(q_int, cache))
    np.testing.assert_array_equal(dense, per_token)
    assert np.isfinite(dense).any() and np.isneginf(dense).any()
    dense, per_token = np.asarray(dense_fn(q_float, cache)), np.asarray(per_token_fn(q_float, cache))
    np.testing.assert_array_equal(np.isneginf(dense), np.isneginf(per_token))
    live = np.isfinite(per_token)
    np.testing.assert_allclose(dense[live], per_token[live], rtol=1e-5, atol=1e-5)
