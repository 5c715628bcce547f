"""Bit-exact checks of the KV-block-major prefill plan (jax_msa/plan.py, MSA.md section 5).

``numpy_prefill_plan`` below is an independent oracle written from plan.py's docstring with explicit
loops and dicts: per (KV head, token) the set of valid block ids, ranks as positions in the sorted set,
CSR rows ``b * max_blocks + id`` listing tokens ascending, and tiles of at most ``queries_per_tile``
consecutive edges per (head, row), in (head, row, tile) order (work_order "row", the default), largest first with
ties in (head, row, tile) order (work_order "size"), or by (head, 128-token block of the tile's first query, row, tile)
(work_order "token").
"""

from __future__ import annotations

import math
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_msa
from jax_msa import reference
from jax_msa.plan import PrefillPlan, build_prefill_plan, default_queries_per_tile, work_capacity
from problems import corrupt_plan

PAGE = 128
FIELDS = ("row_ptr", "edge_query", "edge_rank", "query_edge_count", "work", "num_work")

jit_build = jax.jit(build_prefill_plan, static_argnames=("max_blocks", "queries_per_tile", "work_order"))


# ---------------------------------------------------------------------------------------------------------
# The oracle
# ---------------------------------------------------------------------------------------------------------

def token_table(cu_seqlens, seq_lens):
    """{token: (request, position)} for every token inside a request (pos = seq_len - q_len + i)."""
    table = {}
    for b in range(len(seq_lens)):
        q_len = int(cu_seqlens[b + 1]) - int(cu_seqlens[b])
        for i in range(q_len):
            table[int(cu_seqlens[b]) + i] = (b, int(seq_lens[b]) - q_len + i)
    return table


def valid_block_ids(ids, seq_len, pos, max_blocks):
    """Sorted unique ids with 0 <= id < min(ceil(seq_len / 128), max_blocks) and 128 * id <= pos."""
    n_blocks = min(-(-seq_len // PAGE), max_blocks)
    return sorted({int(i) for i in ids if 0 <= i < n_blocks and PAGE * int(i) <= pos})


def numpy_prefill_plan(topk, cu_seqlens, seq_lens, max_blocks, queries_per_tile, work_order="row"):
    topk = np.asarray(topk)
    hkv, total_q, k = topk.shape
    batch = len(seq_lens)
    rows = batch * max_blocks
    edges = total_q * k
    tokens = token_table(np.asarray(cu_seqlens), np.asarray(seq_lens))

    row_ptr = np.zeros((hkv, rows + 1), np.int32)
    edge_query = np.full((hkv, edges), -1, np.int32)
    edge_rank = np.full((hkv, edges), -1, np.int32)
    query_edge_count = np.zeros((hkv, total_q), np.int32)
    tiles = []  # (head, row, edge_begin, edge_count) in (head, row, tile) order
    for g in range(hkv):
        members = {}  # row -> [(token, rank)], tokens ascending since t ascends
        for t in range(total_q):
            if t not in tokens:
                continue
            b, pos = tokens[t]
            chosen = valid_block_ids(topk[g, t], int(seq_lens[b]), pos, max_blocks)
            query_edge_count[g, t] = len(chosen)
            for rank, block in enumerate(chosen):
                members.setdefault(b * max_blocks + block, []).append((t, rank))
        e = 0
        for r in range(rows):
            row_ptr[g, r] = e
            entries = members.get(r, [])
            for t, rank in entries:
                edge_query[g, e] = t
                edge_rank[g, e] = rank
                e += 1
            for start in range(0, len(entries), queries_per_tile):
                tiles.append((g, r, row_ptr[g, r] + start, min(queries_per_tile, len(entries) - start)))
        row_ptr[g, rows] = e

    # Python's sort is stable: ties keep (head, row, tile) order
    if work_order == "size":
        tiles.sort(key=lambda tile: -tile[3])
    elif work_order == "token":
        tiles.sort(key=lambda tile: (tile[0], edge_query[tile[0], tile[2]] // PAGE, tile[1]))
    else:
        assert work_order == "row", work_order  # as enumerated
    capacity = hkv * rows + math.ceil(hkv * edges / queries_per_tile)
    work = np.zeros((capacity, 4), np.int32)
    for w, tile in enumerate(tiles):
        work[w] = tile
    return dict(row_ptr=row_ptr, edge_query=edge_query, edge_rank=edge_rank,
                query_edge_count=query_edge_count, work=work, num_work=np.array([len(tiles)], np.int32))


# ---------------------------------------------------------------------------------------------------------
# Random inputs
# ---------------------------------------------------------------------------------------------------------

def random_batch(rng, batch, total_q, max_blocks):
    """(cu_seqlens [B+1], seq_lens [B]): varlen requests of 0, 1, 127..129, 1023 or random new tokens,
    with or without a prefix (chunked prefill), sometimes past the block-table width or shorter than
    the chunk; the packed tokens may stop before total_q (padding)."""
    q_lens, seq_lens, used = [], [], 0
    for _ in range(batch):
        kind = rng.choice(["zero", "one", "special", "random", "random"])
        q_len = {"zero": 0, "one": 1, "special": int(rng.choice([127, 128, 129, 1023])),
                 "random": int(rng.integers(1, max(2, total_q // batch + 1)))}[kind]
        q_len = min(q_len, total_q - used)
        used += q_len
        prefix = rng.choice(["none", "random", "beyond", "negative"], p=[0.3, 0.45, 0.1, 0.15])
        extra = {"none": 0, "random": int(rng.integers(0, PAGE * max_blocks + 1)),
                 "beyond": PAGE * max_blocks + int(rng.integers(0, 300)),
                 "negative": -int(rng.integers(0, q_len + 1))}[prefix]
        q_lens.append(q_len)
        seq_lens.append(max(q_len + extra, 0))
    if rng.random() < 0.25 and used < total_q:  # sometimes fill the last request up to total_q
        q_lens[-1] += total_q - used
        seq_lens[-1] += total_q - used
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return cu, np.asarray(seq_lens, np.int32)


def random_topk(rng, hkv, k, cu_seqlens, seq_lens, max_blocks):
    """topk [Hkv, T, K]: the local block, random (often causally invisible) ids, holes, duplicates,
    ids past the request's blocks or the table width, int32 extremes (packed tokens only)."""
    total_q = int(cu_seqlens[-1])
    tokens = token_table(cu_seqlens, seq_lens)
    t_all = np.arange(total_q)
    n_blk = np.array([-(-int(seq_lens[tokens[t][0]]) // PAGE) if t in tokens else max_blocks for t in t_all],
                     np.int64).reshape(1, -1, 1)
    local = np.array([tokens[t][1] // PAGE if t in tokens else 0 for t in t_all], np.int64).reshape(1, -1, 1)
    shape = (hkv, total_q, k)
    category = rng.integers(0, 8, shape)
    ids = np.where(category == 0, -1, 0)
    ids = np.where(category == 1, local, ids)
    ids = np.where(category == 2, rng.integers(0, 1 << 30, shape) % np.maximum(local + 1, 1), ids)
    ids = np.where(category == 3, rng.integers(0, 1 << 30, shape) % np.maximum(n_blk, 1), ids)
    ids = np.where(category == 4, n_blk + rng.integers(0, 3, shape), ids)
    ids = np.where(category == 5, max_blocks + rng.integers(0, 3, shape), ids)
    ids = np.where(category == 6, rng.choice([-2**31, 2**31 - 1, -7, 1 << 20], shape), ids)
    ids = np.where(category == 7, rng.integers(-3, max_blocks + 3, shape), ids)
    ids[..., 0] = np.where(rng.random(shape[:2]) < 0.8, local[..., 0], ids[..., 0])  # the forced local block
    dup = rng.random(shape) < 0.2
    ids = np.where(dup, np.take_along_axis(ids, rng.integers(0, k, shape), axis=-1), ids)
    return ids.astype(np.int32)


def random_case(seed, hkv, k, batch, max_blocks, total_q):
    rng = np.random.default_rng(seed)
    cu, seq_lens = random_batch(rng, batch, total_q, max_blocks)
    topk = np.empty((hkv, total_q, k), np.int32)
    packed = int(cu[-1])
    topk[:, :packed] = random_topk(rng, hkv, k, cu, seq_lens, max_blocks)
    topk[:, packed:] = rng.integers(-2, max_blocks + 2, (hkv, total_q - packed, k))  # padding tokens
    return topk, cu, seq_lens


# (Hkv, K, B, max_blocks, T, queries_per_tile): each shape compiles once and serves several draws.
SHAPES = [
    (1, 4, 1, 1, 1, 1),         # one token, one block
    (2, 8, 4, 8, 1300, 16),     # lengths 1/127/129/1023 with prefixes
    (3, 16, 3, 12, 400, 8),     # chunked prefill, varlen
    (4, 32, 8, 6, 12, 1),       # many short requests, q_len 1, K > blocks
    (2, 4, 5, 5, 300, 8),       # zero-new-token requests, padding
    (1, 5, 2, 20, 700, 3),      # odd K and tile size
    (2, 16, 2, 2, 600, 16),     # block-table width below the request's blocks
    (4, 12, 3, 9, 257, 8),
]
DRAWS = 5


def shape_id(s):
    return "Hkv{}-K{}-B{}-MB{}-T{}-Q{}".format(*s)


def plan_numpy(plan: PrefillPlan):
    return {f: np.asarray(getattr(plan, f)) for f in FIELDS}


def draws(shape):
    hkv, k, batch, max_blocks, total_q, qpt = shape
    for d in range(DRAWS):
        seed = 100 * SHAPES.index(shape) + d
        topk, cu, seq_lens = random_case(seed, hkv, k, batch, max_blocks, total_q)
        plan = jit_build(jnp.asarray(topk), jnp.asarray(cu), jnp.asarray(seq_lens), max_blocks=max_blocks,
                         queries_per_tile=qpt)
        yield seed, (topk, cu, seq_lens), plan


# ---------------------------------------------------------------------------------------------------------
# Bit-exact equality with the oracle
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_plan_matches_numpy_oracle(shape):
    hkv, k, batch, max_blocks, total_q, qpt = shape
    for seed, (topk, cu, seq_lens), plan in draws(shape):
        want = numpy_prefill_plan(topk, cu, seq_lens, max_blocks, qpt)
        got = plan_numpy(plan)
        for f in FIELDS:
            assert got[f].dtype == np.int32, f
            np.testing.assert_array_equal(got[f], want[f], err_msg=f"{f} (seed {seed}, cu {cu}, seq {seq_lens})")
        assert plan.queries_per_tile == qpt and plan.max_blocks == max_blocks


@pytest.mark.parametrize("prefix", [0, 3 * PAGE + 5], ids=["prefill", "chunked"])
def test_plan_matches_numpy_oracle_on_edge_lengths(prefix):
    """Requests of 1, 127, 129 and 1023 new tokens, a zero-new-token request, padding tokens."""
    hkv, k, max_blocks, qpt = 2, 16, 12, 8
    q_lens = np.array([1, 127, 0, 129, 1023, 1])
    seq_lens = (q_lens + prefix).astype(np.int32)
    seq_lens[2] = 700
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    total_q = int(cu[-1]) + 9
    rng = np.random.default_rng(prefix)
    topk = np.empty((hkv, total_q, k), np.int32)
    topk[:, :cu[-1]] = random_topk(rng, hkv, k, cu, seq_lens, max_blocks)
    topk[:, cu[-1]:] = rng.integers(-1, max_blocks, (hkv, total_q - int(cu[-1]), k))
    tokens = token_table(cu, seq_lens)
    topk[:, :cu[-1], 0] = [tokens[t][1] // PAGE for t in range(int(cu[-1]))]  # the forced local block
    got = plan_numpy(jit_build(jnp.asarray(topk), jnp.asarray(cu), jnp.asarray(seq_lens), max_blocks=max_blocks,
                               queries_per_tile=qpt))
    want = numpy_prefill_plan(topk, cu, seq_lens, max_blocks, qpt)
    for f in FIELDS:
        np.testing.assert_array_equal(got[f], want[f], err_msg=f)
    check_invariants(got, hkv, k, len(q_lens), max_blocks, total_q, qpt)
    assert np.all(got["query_edge_count"][:, cu[-1]:] == 0)
    assert np.all(got["query_edge_count"][:, :cu[-1]] >= 1)  # the local block is always there


def test_oracle_hand_example():
    """The oracle itself on a case worked by hand: one request, 200 keys, 3 new tokens at 197..199."""
    topk = np.array([[[1, -1, 1], [0, 5, 1], [9, 0, 0]]], np.int32)  # Hkv 1, T 3, K 3
    want = numpy_prefill_plan(topk, np.array([0, 3]), np.array([200]), max_blocks=2, queries_per_tile=2)
    np.testing.assert_array_equal(want["row_ptr"], [[0, 2, 4]])
    np.testing.assert_array_equal(want["edge_query"], [[1, 2, 0, 1, -1, -1, -1, -1, -1]])
    np.testing.assert_array_equal(want["edge_rank"], [[0, 0, 0, 1, -1, -1, -1, -1, -1]])
    np.testing.assert_array_equal(want["query_edge_count"], [[1, 2, 1]])
    np.testing.assert_array_equal(want["work"][:3], [[0, 0, 0, 2], [0, 1, 2, 2], [0, 0, 0, 0]])
    assert want["work"].shape == (2 + 5, 4) and want["num_work"][0] == 2
    got = plan_numpy(jit_build(jnp.asarray(topk), jnp.array([0, 3], jnp.int32), jnp.array([200], jnp.int32),
                               max_blocks=2, queries_per_tile=2))
    for f in FIELDS:
        np.testing.assert_array_equal(got[f], want[f], err_msg=f)


# ---------------------------------------------------------------------------------------------------------
# Invariants of the builder's output alone
# ---------------------------------------------------------------------------------------------------------

def check_invariants(p, hkv, k, batch, max_blocks, total_q, qpt, work_order="row"):
    rows = batch * max_blocks
    nnz = p["row_ptr"][:, rows]
    assert p["work"].shape == (hkv * rows + math.ceil(hkv * total_q * k / qpt), 4)
    assert p["work"].shape[0] == work_capacity(hkv, total_q, k, batch, max_blocks, qpt)
    np.testing.assert_array_equal(p["query_edge_count"].sum(axis=1), nnz)
    assert np.all(np.diff(p["row_ptr"], axis=1) >= 0) and np.all(p["row_ptr"][:, 0] == 0)
    row_count = np.diff(p["row_ptr"], axis=1)
    n_work = int(p["num_work"][0])
    assert n_work == int(((row_count + qpt - 1) // qpt).sum())
    assert np.all(p["work"][n_work:] == 0)
    counts = p["work"][:n_work, 3]
    assert np.all(counts >= 1) and np.all(counts <= qpt)
    if work_order == "size":
        assert np.all(np.diff(counts) <= 0)
    if work_order == "row":  # (head, row, tile) order: (head, row, begin) ascending
        g, r, begin = p["work"][:n_work, :3].T.astype(np.int64)
        assert np.all(np.diff((g * rows + r) * (total_q * k + 1) + begin) > 0)
    cover = np.zeros((hkv, total_q * k), np.int64)
    for g, r, begin, count in p["work"][:n_work]:
        assert 0 <= g < hkv and 0 <= r < rows
        assert p["row_ptr"][g, r] <= begin and begin + count <= p["row_ptr"][g, r + 1]
        cover[g, begin:begin + count] += 1
    for g in range(hkv):
        assert np.all(cover[g, :nnz[g]] == 1) and np.all(cover[g, nnz[g]:] == 0)
        q, rank = p["edge_query"][g, :nnz[g]], p["edge_rank"][g, :nnz[g]]
        assert np.all(p["edge_query"][g, nnz[g]:] == -1) and np.all(p["edge_rank"][g, nnz[g]:] == -1)
        assert np.all((q >= 0) & (q < total_q)) and np.all((rank >= 0) & (rank < p["query_edge_count"][g, q]))
        row_of_edge = np.repeat(np.arange(rows), row_count[g])
        block = row_of_edge % max_blocks
        # (query, rank) pairs are distinct, so each query's ranks are exactly 0..count-1, and a query's
        # blocks ascend with its ranks; within a row the queries ascend.
        order = np.lexsort((rank, q))
        assert len(set(zip(q.tolist(), rank.tolist()))) == len(q)
        same_query = q[order][1:] == q[order][:-1]
        assert np.all(np.diff(block[order])[same_query] > 0)
        same_row = row_of_edge[1:] == row_of_edge[:-1]
        assert np.all(np.diff(q)[same_row] > 0)


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_plan_invariants(shape):
    hkv, k, batch, max_blocks, total_q, qpt = shape
    for _, _, plan in draws(shape):
        check_invariants(plan_numpy(plan), *shape)


@pytest.mark.parametrize("work_order", ["size", "token"])
@pytest.mark.parametrize("shape", SHAPES[1:4], ids=shape_id)
def test_other_work_orders_match_oracle(shape, work_order):
    """The same CSR arrays and the same tiles as the default ("row": (head, row, tile) order), ordered largest first
    with ties in (head, row, tile) order (work_order="size") or by (head, token block, row, tile) ("token")."""
    hkv, k, batch, max_blocks, total_q, qpt = shape
    for d in range(3):
        topk, cu, seq_lens = random_case(100 * SHAPES.index(shape) + d, hkv, k, batch, max_blocks, total_q)
        if d == 2:
            topk[0] = -1  # a head without a single edge: its rows make no tiles
        plan = plan_numpy(jit_build(jnp.asarray(topk), jnp.asarray(cu), jnp.asarray(seq_lens), max_blocks=max_blocks,
                                    queries_per_tile=qpt, work_order=work_order))
        want = numpy_prefill_plan(topk, cu, seq_lens, max_blocks, qpt, work_order=work_order)
        for f in FIELDS:
            np.testing.assert_array_equal(plan[f], want[f], err_msg=f)
        check_invariants(plan, *shape, work_order=work_order)


def test_work_order_is_checked():
    with pytest.raises(ValueError, match="work_order"):
        build_prefill_plan(jnp.zeros((1, 1, 1), jnp.int32), jnp.array([0, 1], jnp.int32), jnp.array([1], jnp.int32),
                           max_blocks=1, work_order="random")


@pytest.mark.parametrize("work_order", ["row", "size", "token"])
@pytest.mark.parametrize("hkv, k", [(2, 0), (0, 3)])
def test_plan_without_edge_slots_is_empty_in_every_order(hkv, k, work_order):
    """A top-k of width 0 (or no KV head) has no edge slot: the empty plan of those shapes in every work order (the
    "token" order indexed its edges' first block out of an empty axis)."""
    plan = jit_build(jnp.zeros((hkv, 5, k), jnp.int32), jnp.array([0, 5], jnp.int32), jnp.array([300], jnp.int32),
                     max_blocks=3, work_order=work_order)
    assert int(plan.num_work[0]) == 0
    assert plan.edge_query.shape == (hkv, 5 * k) and plan.query_edge_count.shape == (hkv, 5)
    assert not np.asarray(plan.row_ptr).any() and not np.asarray(plan.query_edge_count).any()


# ---------------------------------------------------------------------------------------------------------
# Static shapes: no retrace, no host sync
# ---------------------------------------------------------------------------------------------------------

def test_no_retrace_and_no_host_sync():
    hkv, k, batch, max_blocks, total_q, qpt = 2, 8, 3, 6, 200, 8
    traces = []

    def build(topk, cu, seq_lens):
        traces.append(1)
        return build_prefill_plan(topk, cu, seq_lens, max_blocks=max_blocks, queries_per_tile=qpt)

    build_jit = jax.jit(build)
    seen_num_work = set()
    for seed in range(4):
        topk, cu, seq_lens = random_case(1000 + seed, hkv, k, batch, max_blocks, total_q)
        args = jax.device_put((topk, cu, seq_lens))
        with jax.transfer_guard("disallow"):  # nothing crosses between host and device
            plan = build_jit(*args)
        got = plan_numpy(plan)
        want = numpy_prefill_plan(topk, cu, seq_lens, max_blocks, qpt)
        for f in FIELDS:
            np.testing.assert_array_equal(got[f], want[f], err_msg=f)
        seen_num_work.add(int(got["num_work"][0]))
    assert len(traces) == 1
    assert len(seen_num_work) > 1  # the values did change between calls

    # All arrays traced: a concrete-value use would raise here; no callback to the host in the program.
    jaxpr = jax.make_jaxpr(build)(jax.ShapeDtypeStruct((hkv, total_q, k), jnp.int32),
                                  jax.ShapeDtypeStruct((batch + 1,), jnp.int32),
                                  jax.ShapeDtypeStruct((batch,), jnp.int32))
    assert "callback" not in str(jaxpr)


def test_builder_rejects_bad_static_arguments():
    topk = jnp.zeros((1, 4, 2), jnp.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        build_prefill_plan(topk, jnp.array([0, 4], jnp.int32), jnp.array([4, 4], jnp.int32), max_blocks=1)
    with pytest.raises(ValueError, match="queries_per_tile"):
        build_prefill_plan(topk, jnp.array([0, 4], jnp.int32), jnp.array([4], jnp.int32), max_blocks=1,
                           queries_per_tile=0)
    for width in (0, -1):  # 0 failed inside a gather, -1 returned a plan of negative rows
        with pytest.raises(ValueError, match=r"max_blocks \(the block table's width\) must be >= 1"):
            build_prefill_plan(topk, jnp.array([0, 4], jnp.int32), jnp.array([4], jnp.int32), max_blocks=width)


def test_32k_token_plan_builds_under_jit():
    total_q, k, max_blocks = 32768, 16, 256
    rng = np.random.default_rng(32768)
    local = np.arange(total_q) // PAGE
    others = rng.integers(0, 1 << 30, (total_q, k - 1)) % (local[:, None] + 1)
    topk = np.concatenate([local[:, None], others], axis=1)[None].astype(np.int32)
    cu = np.array([0, total_q], np.int32)
    seq_lens = np.array([total_q], np.int32)
    start = time.perf_counter()
    plan = jax.block_until_ready(jit_build(jnp.asarray(topk), jnp.asarray(cu), jnp.asarray(seq_lens),
                                           max_blocks=max_blocks, queries_per_tile=8))
    first = time.perf_counter() - start
    start = time.perf_counter()
    jax.block_until_ready(jit_build(jnp.asarray(topk[:, ::-1].copy()), jnp.asarray(cu), jnp.asarray(seq_lens),
                                    max_blocks=max_blocks, queries_per_tile=8))
    again = time.perf_counter() - start
    print(f"\n32k-token plan (Hkv 1, K 16): compile + build {first:.2f} s, rebuild {again:.3f} s")
    got = plan_numpy(plan)
    want = numpy_prefill_plan(topk, cu, seq_lens, max_blocks, 8)
    for f in FIELDS:
        np.testing.assert_array_equal(got[f], want[f], err_msg=f)


# ---------------------------------------------------------------------------------------------------------
# The CPU prefill handler consumes plans of any tile size
# ---------------------------------------------------------------------------------------------------------

def test_cpu_prefill_handler_consumes_any_tile_size():
    hq, hkv, d, k, max_blocks = 4, 2, 64, 8, 4
    q_lens, seq_lens = [100, 0, 130, 1, 9], [300, 50, 130, 257, 9]
    batch, packed = len(q_lens), sum(q_lens)
    total_q = packed + 6  # padding tokens past cu_seqlens[-1]
    rng = np.random.default_rng(7)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    seq_lens = np.asarray(seq_lens, np.int32)
    topk = np.empty((hkv, total_q, k), np.int32)
    topk[:, :packed] = random_topk(rng, hkv, k, cu, seq_lens, max_blocks)
    topk[:, packed:] = rng.integers(0, max_blocks, (hkv, total_q - packed, k))
    topk[:, 3] = -1  # a token with no block at all
    num_pages = batch * max_blocks + 3
    block_table = rng.permutation(num_pages)[:batch * max_blocks].reshape(batch, max_blocks).astype(np.int32)
    cache = jnp.asarray(rng.standard_normal((num_pages, hkv, PAGE, 2 * d)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((total_q, hq, d)), jnp.bfloat16)
    args = dict(cu_seqlens_q=jnp.asarray(cu), seq_lens=jnp.asarray(seq_lens), block_table=jnp.asarray(block_table))

    ref_out, ref_lse = reference.sparse_attention(q, cache, jnp.asarray(topk), return_lse=True, **args)
    ref_out = np.asarray(ref_out, np.float32)
    ref_lse = np.asarray(ref_lse)
    assert np.isneginf(ref_lse).any() and np.isfinite(ref_lse).any()

    run = jax.jit(lambda q, cache, topk, plan, **a: jax_msa.sparse_attention(
        q, cache, topk, return_lse=True, plan=plan, impl="kernel", **a))
    results = {}
    for qpt, order in ((3, "size"), (1, "size"), (default_queries_per_tile(hq, hkv), "size"),
                       (default_queries_per_tile(hq, hkv), "token"), (default_queries_per_tile(hq, hkv), "row")):
        plan = jit_build(jnp.asarray(topk), args["cu_seqlens_q"], args["seq_lens"], max_blocks=max_blocks,
                         queries_per_tile=qpt, work_order=order)
        out, lse = run(q, cache, jnp.asarray(topk), plan, **args)
        out = np.asarray(out, np.float32)
        lse = np.asarray(lse)
        assert np.all(np.isfinite(out)), qpt
        rel = np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out)
        assert rel <= 1e-2, (qpt, rel)
        np.testing.assert_array_less(np.abs(out - ref_out), 2.0**-7 * np.maximum(np.abs(ref_out), 1.0) + 1e-30)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse), err_msg=f"-inf lse, Q={qpt}")
        finite = np.isfinite(ref_lse)
        np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=1e-3, rtol=0)
        np.testing.assert_array_equal(out[~finite], 0.0)
        results[qpt, order] = (out, lse)
    # Partials live at (query, head, rank) and merge in rank order: neither the tile size nor the work order can
    # change a bit.
    base_out, base_lse = results[3, "size"]
    for (qpt, order), (out, lse) in results.items():
        np.testing.assert_array_equal(out, base_out, err_msg=f"Q={qpt}, {order}")
        np.testing.assert_array_equal(lse, base_lse, err_msg=f"Q={qpt}, {order}")


@pytest.mark.parametrize("shape,key_bound", [
    ((3, 1000), 7),           # the folded key fits 16 bits: a (uint16 key, index) pair sort (the 32k / 128k plans)
    ((2, 1000), 32768),       # the same at its edge: bound 2**16, keys up to 65535
    ((2, 1000), 40000),       # composite key * N + index fits 32 bits: one single-operand sort
    ((2, 70000), 40000),      # it does not: an (int32 key, index) pair sort
    ((5, 3000), 2**30),       # even the folded key needs 32 bits: argsort along the last axis
    ((1, 5), 3),
    ((4, 0), 3),
])
def test_stable_sort_by_key_paths(shape, key_bound):
    """The 1-D folded sort the plan uses, on each of its four paths, against numpy's stable argsort."""
    from jax_msa.plan import _stable_sort_by_key

    key = np.random.default_rng(key_bound).integers(0, key_bound, shape).astype(np.int32)
    key[..., ::3] = key[..., :1]  # ties, so stability matters
    order, sorted_key = _stable_sort_by_key(jnp.asarray(key), key_bound)
    want = np.argsort(key, axis=-1, kind="stable")
    np.testing.assert_array_equal(np.asarray(order), want)
    np.testing.assert_array_equal(np.asarray(sorted_key), np.take_along_axis(key, want, axis=-1))


@pytest.mark.parametrize("case", ["mixed", "all_edges", "no_edges", "one_row"])
def test_row_pointers_match_searchsorted(case):
    """row_ptr from the first-position scatter equals searchsorted(side="left") of every row id, empty rows and the
    non-edge sentinel row included."""
    from jax_msa.plan import _row_pointers

    rows, e = 9, 50
    rng = np.random.default_rng(len(case))
    keys = {"mixed": rng.integers(0, rows + 1, (3, e)), "all_edges": rng.integers(0, rows, (3, e)),
            "no_edges": np.full((3, e), rows), "one_row": np.full((3, e), 4)}[case]
    sorted_key = np.sort(keys, axis=-1).astype(np.int32)
    got = np.asarray(_row_pointers(jnp.asarray(sorted_key), rows))
    want = np.stack([np.searchsorted(sk, np.arange(rows + 1), side="left") for sk in sorted_key])
    np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------------------------------------------------
# Plans from elsewhere: clamped into range before any kernel indexes with them
# ---------------------------------------------------------------------------------------------------------

def _small_prefill_problem(seed=11):
    hq, hkv, d, k, max_blocks = 4, 2, 64, 4, 3
    q_lens, seq_lens = [130, 1, 40], [300, 129, 40]
    rng = np.random.default_rng(seed)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    seq_lens = np.asarray(seq_lens, np.int32)
    total_q, batch = int(cu[-1]), len(q_lens)
    topk = random_topk(rng, hkv, k, cu, seq_lens, max_blocks)
    num_pages = batch * max_blocks
    block_table = rng.permutation(num_pages).reshape(batch, max_blocks).astype(np.int32)
    cache = jnp.asarray(rng.standard_normal((num_pages, hkv, PAGE, 2 * d)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((total_q, hq, d)), jnp.bfloat16)
    args = dict(cu_seqlens_q=jnp.asarray(cu), seq_lens=jnp.asarray(seq_lens), block_table=jnp.asarray(block_table))
    return q, cache, jnp.asarray(topk), args, max_blocks


def test_clamp_plan_entries_keeps_built_plans():
    from jax_msa.plan import clamp_plan_entries

    _, _, topk, args, max_blocks = _small_prefill_problem()
    for order in ("row", "size", "token"):
        plan = jit_build(topk, args["cu_seqlens_q"], args["seq_lens"], max_blocks=max_blocks, queries_per_tile=3,
                         work_order=order)
        got, want = plan_numpy(jax.jit(clamp_plan_entries)(plan)), plan_numpy(plan)
        for f in ("row_ptr", "query_edge_count", "work", "num_work"):
            np.testing.assert_array_equal(got[f], want[f], err_msg=f"{order}: {f}")
        for f in ("edge_query", "edge_rank"):  # only the unused edges past row_ptr[g, R] change (-1 -> 0)
            used = np.arange(want[f].shape[1])[None, :] < want["row_ptr"][:, -1:]
            assert (want[f][~used] == -1).all() and (~used).any(), f
            np.testing.assert_array_equal(got[f][used], want[f][used], err_msg=f"{order}: {f}")
            np.testing.assert_array_equal(got[f][~used], 0, err_msg=f"{order}: {f}")


@pytest.mark.parametrize("num_work", [None, -7, 0, 5, "capacity"])
def test_clamp_plan_entries_bounds_a_corrupt_plan(num_work):
    """Every entry a kernel reads lands in range; tiles past num_work (which no kernel reads) are left as they were."""
    from jax_msa.plan import clamp_plan_entries

    _, _, topk, args, max_blocks = _small_prefill_problem()
    plan = jit_build(topk, args["cu_seqlens_q"], args["seq_lens"], max_blocks=max_blocks, queries_per_tile=3)
    cap = plan.work_capacity
    bad = corrupt_plan(plan, np.random.default_rng(3), num_work=cap if num_work == "capacity" else num_work)
    got = plan_numpy(jax.jit(clamp_plan_entries)(bad))
    hkv, rows = plan.row_ptr.shape[0], plan.row_ptr.shape[1] - 1
    total_q, edges, k = plan.total_q, plan.edge_query.shape[1], plan.topk
    live = {None: cap, -7: 0, 0: 0, 5: 5, "capacity": cap}[num_work]
    assert got["num_work"][0] == live
    np.testing.assert_array_equal(got["work"][live:], np.asarray(bad.work)[live:])
    head, row, begin, count = got["work"][:live].T
    for name, x, lo, hi in (("head", head, 0, hkv - 1), ("row", row, 0, rows - 1), ("begin", begin, 0, edges - 1),
                            ("edge_query", got["edge_query"], 0, total_q - 1),
                            ("edge_rank", got["edge_rank"], 0, k - 1), ("query_edge_count", got["query_edge_count"], 0, k)):
        assert x.size == 0 or (x.min() >= lo and x.max() <= hi), name
    assert live == 0 or (count.min() >= 1 and (begin + count).max() <= edges)
    np.testing.assert_array_equal(got["row_ptr"], np.asarray(bad.row_ptr))


def test_sparse_attention_with_a_corrupt_plan_stays_in_bounds():
    """A corrupt plan passed to sparse_attention runs (CPU handler) without reading or writing out of bounds:
    without the clamp its entries index far outside Q, the block table and the partials, and the process dies.
    The results are garbage; only finite-or-not is not asserted."""
    q, cache, topk, args, max_blocks = _small_prefill_problem()
    plan = jit_build(topk, args["cu_seqlens_q"], args["seq_lens"], max_blocks=max_blocks, queries_per_tile=3)
    run = jax.jit(lambda q, cache, topk, plan, **a: jax_msa.sparse_attention(
        q, cache, topk, return_lse=True, plan=plan, impl="kernel", **a))
    for seed in range(3):
        out, lse = run(q, cache, topk, corrupt_plan(plan, np.random.default_rng(seed)), **args)
        assert out.shape == q.shape and lse.shape == q.shape[:2]
        jax.block_until_ready((out, lse))
    out, _ = run(q, cache, topk, plan, **args)  # the same compiled function on the real plan is still right
    ref = reference.sparse_attention(q, cache, topk, **args)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("case", ["mixed", "leading_empty", "trailing_empty", "no_tiles", "one_row"])
def test_tile_rows_match_searchsorted(case):
    """The tile -> (head, row) lookup by scatter and running max equals searchsorted(tile_end, w, side="right") for
    every tile w < the number of tiles, rows without tiles included; past the tiles it is the last row with tiles (or 0
    without any), which the plan turns into empty work entries."""
    from jax_msa.plan import _tile_rows

    rng = np.random.default_rng(len(case))
    tiles = {"mixed": rng.integers(0, 4, 40) * (rng.random(40) < 0.6),
             "leading_empty": np.concatenate([np.zeros(7, int), rng.integers(1, 3, 10)]),
             "trailing_empty": np.concatenate([rng.integers(1, 3, 10), np.zeros(7, int)]),
             "no_tiles": np.zeros(12, int), "one_row": np.eye(1, 15, 6, dtype=int)[0] * 5}[case].astype(np.int32)
    tile_end = np.cumsum(tiles).astype(np.int32)
    cap = int(tile_end[-1]) + 9
    got = np.asarray(_tile_rows(jnp.asarray(tiles), jnp.asarray(tile_end), cap))
    n_work = int(tile_end[-1])
    want = np.searchsorted(tile_end, np.arange(n_work), side="right")
    np.testing.assert_array_equal(got[:n_work], want)
    nonempty = np.flatnonzero(tiles)
    np.testing.assert_array_equal(got[n_work:], nonempty[-1] if nonempty.size else 0)


def test_compiled_plan_does_not_grow_with_the_block_table_width():
    """Long contexts (max_blocks 8,192 at 1M tokens) must not blow up the plan's compilation. The tile -> (head, row)
    lookup was an unrolled binary search over every (head, row), whose steps XLA duplicated into each of the four
    gathers that use it: at T = 32k and max_blocks = 8,192 it compiled in ~55 s on the CPU (0.7 s now). Structural
    stand-in: the optimized HLO holds as many gathers, and about as many instructions, at 4,096 columns as at 64."""
    def compiled(max_blocks):
        fn = jax.jit(lambda t, c, s: build_prefill_plan(t, c, s, max_blocks=max_blocks))
        text = fn.trace(jnp.zeros((4, 2048, 16), jnp.int32), jnp.asarray([0, 2048], jnp.int32),
                        jnp.asarray([2048], jnp.int32)).lower().compile().as_text()
        return len(text.splitlines()), len(re.findall(r"= \S+ gather\(", text))

    (lines_narrow, gathers_narrow), (lines_wide, gathers_wide) = compiled(64), compiled(4096)
    assert gathers_wide == gathers_narrow, (gathers_narrow, gathers_wide)
    assert lines_wide <= 1.15 * lines_narrow, (lines_narrow, lines_wide)


def test_plan_lowered_for_the_gpu_has_no_any_reduce():
    """XLA's fusion autotuner spent 15-21 s of the plan's GPU compile at 128k tokens (an H100) on one fusion: the
    earlier-copy test written as a K x K `any` reduce. It is K - 1 elementwise terms now (0.9 s); this guard keeps an
    or-reduce out of what the plan emits for the GPU (the rank's sum reduce compiles fast and stays)."""
    fn = jax.jit(lambda t, c, s: build_prefill_plan(t, c, s, max_blocks=32))
    text = fn.trace(jnp.zeros((2, 256, 16), jnp.int32), jnp.asarray([0, 256], jnp.int32),
                    jnp.asarray([256], jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    reduces = re.findall(r"stablehlo\.reduce\(.*?applies (stablehlo\.\w+)", text)
    assert reduces, "no reduce found: the pattern no longer matches the lowering's text"
    assert "stablehlo.or" not in reduces, reduces


def test_work_capacity_past_int32_is_refused():
    """Each of the plan's int32 arrays fits, but the work list's capacity Hkv * B * max_blocks + ceil(Hkv * T * K / Q)
    would pass 2^31 (32,767 requests with 8,192-block tables at Hkv = 8): refused at trace time, not wrapped."""
    args = (jax.ShapeDtypeStruct((8, 32768, 16), jnp.int32), jax.ShapeDtypeStruct((32768,), jnp.int32),
            jax.ShapeDtypeStruct((32767,), jnp.int32))
    with pytest.raises(ValueError, match="work list's capacity"):
        jax.eval_shape(lambda t, c, s: build_prefill_plan(t, c, s, max_blocks=8192), *args)
    jax.eval_shape(lambda t, c, s: build_prefill_plan(t, c, s, max_blocks=4096), *args)  # ~2^30 + 2^19: fine
