"""A prefill run as a sequence of query windows (``sparse_attention(..., query_chunk_size=C)``).

The prefill's device memory grows with the tokens of one call: the kernels write one normalized partial per
(token, KV head, selected block) before the combine (``T * Hq * K * (2 * D + 4)`` bytes on the GPU, ~8.7 GB at
32k tokens, 64 query heads, K = 16). Bounding it needs no new kernel: a token's result depends only on its own
query, top-k row and causal position, so any window of the flat token axis is a chunked prefill of its own. This
module gives each window the batch description under which its tokens keep their positions:

- ``cu_seqlens_q`` clipped to the window [s, e) and shifted by s (a request's tokens outside the window drop out;
  tokens before ``cu_seqlens_q[0]`` or after ``cu_seqlens_q[B]`` stay outside every request);
- ``seq_lens[b]`` less request b's tokens after the window, so that token i of b keeps
  ``pos = seq_lens[b] - q_len_b + i`` (the spec's bottom-right rule). The blocks that the shorter length puts out
  of range all start after the window's last position, so they were causally invisible to its tokens anyway.

On the kernel path the windows' plans are built in one ``lax.map`` (one compiled plan builder), then one custom call
a window runs in turn (``run_window_calls``, static starts): it reads the window's rows of the WHOLE q and writes
them into the whole out / lse, passed from window to window as aliased buffers, so no window's q is sliced out and
no window's out is copied back (against the earlier scan of sliced windows, 3.7-4.4 ms less at 128k tokens on an
H100, the copies and the plans' restructuring together; docs/BENCHMARKS.md). The calls are unrolled, so beyond
``MAX_IN_PLACE_WINDOWS`` windows (compile time) and in the jnp reference, the windows run in a ``lax.scan``
(``run_in_windows``). The windows' size is ``ceil(T / n)`` for ``n = ceil(T / C)`` windows, the last one moved back
to end at T (it recomputes fewer than n tokens of the one before it, with identical results).

The kernels compute each (token, block) partial and each token's merge on its own, so their windowed results are
bit-identical to one call's. The jnp reference is the same computation, but XLA may compile it differently for a
window's shapes (seen with one-token windows): equal up to the last bit of rounding there.
"""

from __future__ import annotations

import math
import operator

import jax
import jax.numpy as jnp


def check_chunk_size(query_chunk_size) -> int | None:
    """The static window size, or None (no windows). Raises for anything but a positive integer."""
    if query_chunk_size is None:
        return None
    if isinstance(query_chunk_size, bool):
        raise TypeError("jax_msa.sparse_attention: query_chunk_size must be an int or None; got a bool")
    try:
        size = operator.index(query_chunk_size)
    except TypeError:
        raise TypeError(f"jax_msa.sparse_attention: query_chunk_size must be a Python int (static) or None; "
                        f"got {type(query_chunk_size).__name__}") from None
    if size < 1:
        raise ValueError(f"jax_msa.sparse_attention: query_chunk_size must be >= 1; got {size}")
    return size


# At most this many windows run as in-place custom calls: one unrolled call a window, so the compile time grows with
# their number (measured on the CPU, 452 tokens: 31 windows 2.1 s in place / 0.6 s in the scan, 113 windows 6.3 /
# 0.9 s, 452 windows 29.6 / 1.3 s). Beyond it they run in a lax.scan, each window's q sliced in and its out copied
# back (10.7-11.6% more time than one call at 128k tokens on an H100 in windows of 16k / 32k, against 0.6-2.7% in
# place: docs/BENCHMARKS.md).
MAX_IN_PLACE_WINDOWS = 32


def in_place(total_q: int, query_chunk_size: int) -> bool:
    """Whether the kernels run the windows as in-place calls (run_window_calls) rather than in a scan."""
    return window_layout(total_q, query_chunk_size)[0] <= MAX_IN_PLACE_WINDOWS


def window_layout(total_q: int, query_chunk_size: int) -> tuple[int, int]:
    """(number of windows n, window size) for T = total_q tokens: n = ceil(T / C), size = ceil(T / n) <= C."""
    n = math.ceil(total_q / query_chunk_size)
    return n, math.ceil(total_q / n)


def static_window_starts(total_q: int, query_chunk_size: int) -> list[int]:
    """Each window's first token (Python ints); the last window ends at total_q."""
    n, size = window_layout(total_q, query_chunk_size)
    return [min(i * size, total_q - size) for i in range(n)]


def window_starts(total_q: int, query_chunk_size: int) -> jax.Array:
    """int32 [n]: static_window_starts as an array."""
    return jnp.asarray(static_window_starts(total_q, query_chunk_size), jnp.int32)


def window_batch(cu_seqlens_q, seq_lens, start, size: int):
    """(cu_seqlens_q, seq_lens) of the window [start, start + size) of the flat token axis, as a chunked prefill of
    its own whose tokens keep their positions. A request with no token in the window gets a length >= 0."""
    cu = cu_seqlens_q.astype(jnp.int32)
    clipped = jnp.clip(cu, start, start + size)
    window_cu = clipped - start
    tokens_after = cu[1:] - clipped[1:]
    window_seq = seq_lens.astype(jnp.int32) - tokens_after
    has_tokens = window_cu[1:] > window_cu[:-1]
    return window_cu, jnp.where(has_tokens, window_seq, jnp.maximum(window_seq, 0))


def run_in_windows(attend, q, topk, cu_seqlens_q, seq_lens, query_chunk_size: int):
    """attend(q_window, topk_window, cu_window, seq_window) -> (out [size, Hq, D], lse [size, Hq]) over every
    window of q [T, Hq, D] / topk [Hkv, T, K] in turn; returns (out [T, Hq, D], lse [T, Hq])."""
    total_q, num_heads = q.shape[0], q.shape[1]
    _, size = window_layout(total_q, query_chunk_size)

    def step(carry, start):
        out, lse = carry
        window_q = jax.lax.dynamic_slice_in_dim(q, start, size, axis=0)
        window_topk = jax.lax.dynamic_slice_in_dim(topk, start, size, axis=1)
        window_cu, window_seq = window_batch(cu_seqlens_q, seq_lens, start, size)
        o, l = attend(window_q, window_topk, window_cu, window_seq)
        out = jax.lax.dynamic_update_slice_in_dim(out, o.astype(out.dtype), start, axis=0)
        lse = jax.lax.dynamic_update_slice_in_dim(lse, l.astype(lse.dtype), start, axis=0)
        return (out, lse), None

    init = (jnp.zeros((total_q, num_heads, q.shape[2]), jnp.bfloat16), jnp.zeros((total_q, num_heads), jnp.float32))
    (out, lse), _ = jax.lax.scan(step, init, window_starts(total_q, query_chunk_size))
    return out, lse


def window_plans(build_plan, topk, cu_seqlens_q, seq_lens, query_chunk_size: int):
    """Every window's (cu_seqlens_q, seq_lens, plan), stacked along a leading [n] axis: one ``lax.map`` over the
    windows (one compiled plan builder). build_plan(topk_window, cu_window, seq_window) -> PrefillPlan."""
    _, size = window_layout(topk.shape[1], query_chunk_size)

    def one(start):
        window_cu, window_seq = window_batch(cu_seqlens_q, seq_lens, start, size)
        window_topk = jax.lax.dynamic_slice_in_dim(topk, start, size, axis=1)
        return window_cu, window_seq, build_plan(window_topk, window_cu, window_seq)

    return jax.lax.map(one, window_starts(topk.shape[1], query_chunk_size))


def run_window_calls(call, total_q: int, stacked, query_chunk_size: int):
    """call(window_start, cu_window, seq_window, plan, out, lse) -> (out, lse) for every window in turn, with static
    starts (the custom call offsets its pointers into the whole q / out / lse: no slice copies), threading out / lse
    through (None for the first window). stacked: window_plans' result. Returns (out [T, Hq, D], lse [T, Hq])."""
    out = lse = None
    for i, start in enumerate(static_window_starts(total_q, query_chunk_size)):
        window_cu, window_seq, plan = jax.tree.map(lambda a, i=i: a[i], stacked)
        out, lse = call(start, window_cu, window_seq, plan, out, lse)
    return out, lse
