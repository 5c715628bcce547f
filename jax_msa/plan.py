"""The KV-block-major prefill plan (MSA.md section 5), built in jnp under jit with static capacities.

This is the one Python module that writes (and reads) the plan arrays; on the device side
``cc/common/plan_view.h`` is their one reader.

Per KV head g the selected (query, block) pairs are inverted into a CSR matrix whose rows are the
(request, block) pairs, ``row = b * max_blocks + block``, and whose entries ("edges") are the queries that
chose the block, in ascending token order. An edge exists for token t, head g and block id when the id is
in range for t's request (0 <= id < min(ceil(seq_len/128), max_blocks)), the block has a causally visible
key (128 * id <= pos(t)), and it is the first copy of the id in the row (set semantics). Holes, ids out of
range, causally invisible blocks and duplicates make no edge.

Arrays (T = total_q, K = top-k, R = B * max_blocks, E = T * K, W = work capacity):

=================== ================= ==============================================================
row_ptr             int32 [Hkv, R+1]  CSR row pointers; row_ptr[g, R] = edges of head g
edge_query          int32 [Hkv, E]    query token of each edge (CSR order); -1 past row_ptr[g, R]
edge_rank           int32 [Hkv, E]    the edge's slot among its query's partials (0..count-1)
query_edge_count    int32 [Hkv, T]    partials (selected valid blocks) per (head, query)
work                int32 [W, 4]      (head, row, edge_begin, edge_count) tiles of at most
                                      ``queries_per_tile`` queries, in ``work_order``; zero past num_work
num_work            int32 [1]         valid work items
=================== ================= ==============================================================

W = Hkv * R + ceil(Hkv * E / queries_per_tile), which bounds the tile count of any input.

Work orders (the kernels' results do not depend on it: one partial per (query, block), merged in rank order):
``"row"`` (default) in (head, row, tile) order as the tiles are enumerated (no sort): every tile of a (head, block), its
partial last one included, follows the previous, which is what the sm90 kernel's stage reuse and its contiguous
per-CTA ranges want (on the H200 the sm90 kernels took up to 15% less time than with "size" and never measurably more;
the warp-MMA kernels, one CTA an item, were not timed with it; docs/BENCHMARKS.md); ``"size"`` largest tile first,
ties in (head, row, tile) order; ``"token"`` by (head, the 128-token block of the tile's first query, row, tile), so
that the tiles that re-read the same query rows run close together.

Everything is static in the shapes: a new batch of the same shapes reuses the compiled plan (no retrace, no host
sync).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jax_msa.reference import PAGE_SIZE, prefill_positions


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefillPlan:
    row_ptr: jax.Array
    edge_query: jax.Array
    edge_rank: jax.Array
    query_edge_count: jax.Array
    work: jax.Array
    num_work: jax.Array
    queries_per_tile: int = dataclasses.field(metadata=dict(static=True))
    max_blocks: int = dataclasses.field(metadata=dict(static=True))

    @property
    def num_kv_heads(self) -> int:
        return self.row_ptr.shape[0]

    @property
    def total_q(self) -> int:
        return self.query_edge_count.shape[1]

    @property
    def topk(self) -> int:
        return self.edge_query.shape[1] // max(self.total_q, 1)

    @property
    def work_capacity(self) -> int:
        return self.work.shape[0]


def _stable_sort_by_key(key, key_bound: int):
    """(order, sorted key) of a stable ascending sort of key [..., n] along its last axis, 0 <= key < key_bound.

    The leading axes are folded into the key (row r's keys offset by r * key_bound) so that the sort is one 1-D
    sort, which XLA's GPU backend runs as a cub radix sort (a batched sort runs as its own, much slower, bitonic
    sort kernel): a sort of (uint16 key, index) pairs when the folded key fits 16 bits (two radix passes; for the edge
    sort, Hkv * (plan rows + 1) <= 65536: 1028 at 32k and 4100 at 128k with 4 KV heads), else a single-operand sort
    of the composite key * N + index (uint32) when that fits 32 bits, else a sort of (int32 key, index) pairs; a
    stable argsort along the last axis when even the folded key needs 32 bits."""
    shape = key.shape
    n = shape[-1]
    rows = math.prod(shape[:-1])
    total = rows * n
    bound = rows * key_bound
    if total == 0 or bound >= 2**31:
        order = jnp.argsort(key, axis=-1, stable=True).astype(jnp.int32)
        return order, jnp.take_along_axis(key, order, axis=-1)
    row_offset = (jnp.arange(rows, dtype=jnp.int32) * key_bound)[:, None]
    flat_key = (key.reshape(rows, n).astype(jnp.int32) + row_offset).reshape(-1)
    if bound <= 2**16:  # (uint16 key, index) pairs: a radix sort of two 8-bit passes instead of four
        sorted16, flat_order = jax.lax.sort((flat_key.astype(jnp.uint16), jnp.arange(total, dtype=jnp.int32)),
                                            num_keys=1, is_stable=True)
        sorted_flat = sorted16.astype(jnp.int32)
    elif bound * total <= 2**32:
        index = jnp.arange(total, dtype=jnp.uint32)
        composite = jnp.sort(flat_key.astype(jnp.uint32) * jnp.uint32(total) + index)
        flat_order = (composite % jnp.uint32(total)).astype(jnp.int32)
        sorted_flat = (composite // jnp.uint32(total)).astype(jnp.int32)
    else:
        sorted_flat, flat_order = jax.lax.sort((flat_key, jnp.arange(total, dtype=jnp.int32)), num_keys=1,
                                               is_stable=True)
    # row r's keys are the r-th n of the sorted sequence: back to per-row positions and keys
    order = flat_order.reshape(rows, n) - (jnp.arange(rows, dtype=jnp.int32) * n)[:, None]
    return order.reshape(shape), (sorted_flat.reshape(rows, n) - row_offset).reshape(shape)


def _selected_edges(ids, n_blk, pos):
    """Set semantics per (head, token), MSA.md section 2, of ids [Hkv, T, K]: (valid [Hkv, T, K], rank [Hkv, T, K]).

    An id is valid when 0 <= id < n_blk[t], 128 * id <= pos[t] (a causally visible key), and no earlier slot of
    the row holds the same id (first copy). rank = the number of valid ids of the row smaller than this one: the
    edge's partial slot, ascending in block id (the order reference.selected_blocks sorts into). Pairwise
    comparisons, which XLA fuses into one elementwise pass, instead of a sort of every row."""
    k = ids.shape[-1]
    in_range = (ids >= 0) & (ids < n_blk[None, :, None]) & (ids <= jnp.floor_divide(pos, PAGE_SIZE)[None, :, None])
    slot = jnp.arange(k, dtype=jnp.int32)
    # The earlier-copy test as K - 1 elementwise terms, not a K x K `any` reduce: XLA's fusion autotuner spent most
    # of the plan's GPU compile on that reduce fusion (15-21 s at 128k tokens on an H100; 0.9 s this way, and the plan
    # runs as fast as the reduce form did with the autotuner off or faster: 0.69 / 0.80 ms against 0.80 / 0.78 in two
    # calls; unrolling the rank's reduce below instead left the compile at 18.9 s).
    earlier_copy = jnp.zeros(ids.shape, bool)
    for j in range(k - 1):
        earlier_copy = earlier_copy | ((ids == ids[..., j:j + 1]) & (slot > j))
    valid = in_range & ~earlier_copy
    smaller = valid[..., None, :] & (ids[..., None, :] < ids[..., :, None])
    rank = jnp.sum(smaller, axis=-1, dtype=jnp.int32)
    return valid, rank


def _row_pointers(sorted_key, rows: int):
    """row_ptr [Hkv, rows + 1] of sorted_key [Hkv, E] (keys in [0, rows], rows = the non-edges): the position of each
    row's first key, or of the next present row's (E past the last), as searchsorted(side="left") gives it.

    A row's first key is where the sorted key changes: one scatter of those positions (each row at most once, the
    other updates out of range and dropped; no collisions), then a reverse running minimum fills the absent rows.
    A binary search here was an XLA while loop (one trip per bit of E, each a host round trip on the GPU)."""
    hkv, e = sorted_key.shape
    first = jnp.concatenate([jnp.ones((hkv, 1), bool), sorted_key[:, 1:] != sorted_key[:, :-1]], axis=1)
    target = jnp.where(first, sorted_key, rows + 1)
    head = jnp.broadcast_to(jnp.arange(hkv, dtype=jnp.int32)[:, None], (hkv, e))
    position = jnp.broadcast_to(jnp.arange(e, dtype=jnp.int32)[None, :], (hkv, e))
    starts = jnp.full((hkv, rows + 1), e, jnp.int32).at[head, target].min(position, mode="drop")
    return jax.lax.cummin(starts, axis=1, reverse=True)


def _tile_rows(tiles, tile_end, cap: int):
    """gr [cap]: the (head, row) index whose tiles [tile_end - tiles, tile_end) hold tile w, for w in [0, cap) (w past
    the last tile: the last (head, row) with tiles), as searchsorted(tile_end, w, side="right") clipped to the rows
    gives it where tiles exist.

    Each (head, row) with tiles writes its index at its first tile (distinct positions: no collisions), then a running
    maximum fills the rest: one scatter of the rows and one scan over the tiles, instead of a binary search of every
    tile over the rows."""
    n = tiles.shape[0]
    start = jnp.where(tiles > 0, tile_end - tiles, cap)  # rows without tiles: out of range, dropped
    marks = jnp.zeros((cap,), jnp.int32).at[start].max(jnp.arange(n, dtype=jnp.int32), mode="drop")
    return jax.lax.cummax(marks, axis=0)


def work_capacity(num_kv_heads: int, total_q: int, topk: int, batch: int, max_blocks: int,
                  queries_per_tile: int) -> int:
    rows = batch * max_blocks
    return num_kv_heads * rows + math.ceil(num_kv_heads * total_q * topk / queries_per_tile)


def default_queries_per_tile(num_q_heads: int, num_kv_heads: int) -> int:
    """Query tokens per work tile: GQA heads packed into 128 MMA rows (8 tokens x 16 heads for M3)."""
    return max(1, 128 // max(1, num_q_heads // num_kv_heads))


WORK_ORDERS = ("size", "token", "row")


def build_prefill_plan(topk, cu_seqlens_q, seq_lens, *, max_blocks: int, queries_per_tile: int = 8,
                       work_order: str = "row") -> PrefillPlan:
    """Builds the plan from topk [Hkv, T, K] int32, cu_seqlens_q [B+1], seq_lens [B] (jit-able)."""
    hkv, t_total, k = topk.shape
    if work_order not in WORK_ORDERS:
        raise ValueError(f"work_order must be one of {WORK_ORDERS}; got {work_order!r}")
    batch = seq_lens.shape[0]
    if cu_seqlens_q.shape != (batch + 1,):
        raise ValueError(f"cu_seqlens_q must be [B+1] = [{batch + 1}]; got {cu_seqlens_q.shape}")
    if queries_per_tile < 1:
        raise ValueError(f"queries_per_tile must be >= 1; got {queries_per_tile}")
    if max_blocks < 1:
        raise ValueError(f"max_blocks (the block table's width) must be >= 1; got {max_blocks}")
    rows = batch * max_blocks
    edges = t_total * k
    if max(hkv * (rows + 1), hkv * edges) >= 2**31:
        raise ValueError("plan too large for int32 indices")
    if work_capacity(hkv, t_total, k, batch, max_blocks, queries_per_tile) >= 2**31:
        raise ValueError("plan too large for int32 indices: the work list's capacity (Hkv * B * max_blocks + "
                         "ceil(Hkv * total_q * K / queries_per_tile)) reaches 2^31; split the batch")

    if batch == 0 or t_total == 0 or k == 0 or hkv == 0:  # nothing can be selected: the empty plan of the shapes
        cap = work_capacity(hkv, t_total, k, batch, max_blocks, queries_per_tile)
        return PrefillPlan(row_ptr=jnp.zeros((hkv, rows + 1), jnp.int32),
                           edge_query=jnp.full((hkv, edges), -1, jnp.int32),
                           edge_rank=jnp.full((hkv, edges), -1, jnp.int32),
                           query_edge_count=jnp.zeros((hkv, t_total), jnp.int32),
                           work=jnp.zeros((cap, 4), jnp.int32), num_work=jnp.zeros((1,), jnp.int32),
                           queries_per_tile=queries_per_tile, max_blocks=max_blocks)

    req, pos, in_batch = prefill_positions(cu_seqlens_q, seq_lens, t_total)
    seq_lens = seq_lens.astype(jnp.int32)
    n_blk = jnp.minimum((seq_lens[req] + PAGE_SIZE - 1) // PAGE_SIZE, max_blocks)
    n_blk = jnp.where(in_batch, n_blk, 0)  # [T]

    blk = topk.astype(jnp.int32)  # [Hkv, T, K]
    valid, rank = _selected_edges(blk, n_blk, pos)
    query_edge_count = jnp.sum(valid, axis=-1, dtype=jnp.int32)  # [Hkv, T]

    # Edge keys in (token, k) order; a stable sort keeps tokens ascending within a row.
    row = req[None, :, None] * max_blocks + jnp.where(valid, blk, 0)
    key = jnp.where(valid, row, rows).reshape(hkv, edges)
    order, sorted_key = _stable_sort_by_key(key, rows + 1)
    is_edge = sorted_key < rows
    edge_query = jnp.where(is_edge, order // k, -1)
    edge_rank = jnp.where(is_edge, jnp.take_along_axis(rank.reshape(hkv, edges), order, axis=-1), -1)

    row_ptr = _row_pointers(sorted_key, rows)
    row_count = row_ptr[:, 1:] - row_ptr[:, :-1]

    # Work tiles: ceil(count / Q) per (head, row); tile w -> its (head, row) by a search over the
    # inclusive prefix sum of tile counts.
    qpt = queries_per_tile
    cap = work_capacity(hkv, t_total, k, batch, max_blocks, qpt)
    tiles = ((row_count + qpt - 1) // qpt).reshape(-1)  # [Hkv * R]
    tile_end = jnp.cumsum(tiles, dtype=jnp.int32)
    num_work = tile_end[-1] if tiles.size else jnp.int32(0)
    w = jnp.arange(cap, dtype=jnp.int32)
    gr = _tile_rows(tiles, tile_end, cap)
    j = w - (tile_end[gr] - tiles[gr])
    g = gr // rows
    r = gr % rows
    begin = row_ptr[g, r] + j * qpt
    count = jnp.clip(row_count[g, r] - j * qpt, 0, qpt)
    count = jnp.where(w < num_work, count, 0)
    work = jnp.stack([g, r, begin, count], axis=-1)
    work = jnp.where((count > 0)[:, None], work, 0)
    # "row": the tiles stay as enumerated, in (head, row, tile) order with the empty ones (w >= num_work) last
    if work_order == "size":
        order, _ = _stable_sort_by_key(qpt - count, qpt + 1)  # largest first, ties by (head, row, tile)
        work = work[order]
    elif work_order == "token":  # (head, token block of the first query, row), ties by tile; empty tiles last
        token_blocks = t_total // PAGE_SIZE + 1
        first_block = edge_query[g, jnp.clip(begin, 0, edges - 1)] // PAGE_SIZE
        major = jnp.where(count > 0, g * token_blocks + first_block, hkv * token_blocks)
        if (hkv * token_blocks + 1) * rows < 2**31:
            order, _ = _stable_sort_by_key(major * rows + r, (hkv * token_blocks + 1) * rows)
        else:
            order = jnp.lexsort((r, major)).astype(jnp.int32)
        work = work[order]

    return PrefillPlan(row_ptr=row_ptr, edge_query=edge_query, edge_rank=edge_rank,
                       query_edge_count=query_edge_count, work=work,
                       num_work=jnp.reshape(num_work, (1,)).astype(jnp.int32),
                       queries_per_tile=qpt, max_blocks=max_blocks)


def clamp_plan_entries(plan: PrefillPlan) -> PrefillPlan:
    """The plan with every entry a kernel indexes with forced into range (jit-able, no host sync).

    For a plan that did not come from ``build_prefill_plan`` (``sparse_attention(..., plan=...)``): the kernels
    index Q, the block table, the KV heads and the partial grid with its entries and check none of them, so an entry
    out of range would read or write out of bounds. Clamped: ``num_work`` to [0, W]; in the first ``num_work``
    tiles the head to [0, Hkv), the row to [0, R), ``edge_begin`` to [0, E) and ``edge_count`` to [1, E -
    edge_begin]; every ``edge_query`` to [0, T) and ``edge_rank`` to [0, K); ``query_edge_count`` to [0, K]. A plan
    from ``build_prefill_plan`` gives the same results after it (only the -1 of its unused edges past
    ``row_ptr[g, R]`` change, and no tile reaches those); a corrupt plan gives garbage results, within bounds.
    ``row_ptr`` is not read by any kernel and stays as it is."""
    hkv, rows_plus_1 = plan.row_ptr.shape
    rows = rows_plus_1 - 1
    total_q = plan.total_q
    edges = plan.edge_query.shape[1]
    capacity = plan.work_capacity
    num_work = jnp.clip(plan.num_work, 0, capacity)
    if min(hkv, rows, total_q, edges) <= 0:  # nothing a tile could index: no tile runs
        return dataclasses.replace(plan, num_work=jnp.zeros_like(num_work))
    topk = edges // total_q
    work = plan.work
    head = jnp.clip(work[:, 0], 0, hkv - 1)
    row = jnp.clip(work[:, 1], 0, rows - 1)
    begin = jnp.clip(work[:, 2], 0, edges - 1)
    count = jnp.clip(work[:, 3], 1, edges - begin)
    live = (jnp.arange(capacity, dtype=jnp.int32) < num_work[0])[:, None]
    work = jnp.where(live, jnp.stack([head, row, begin, count], axis=-1), work)
    return dataclasses.replace(
        plan, work=work, num_work=num_work,
        edge_query=jnp.clip(plan.edge_query, 0, total_q - 1),
        edge_rank=jnp.clip(plan.edge_rank, 0, topk - 1),
        query_edge_count=jnp.clip(plan.query_edge_count, 0, topk))
