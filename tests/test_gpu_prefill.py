"""Prefill kernels vs the float64 oracle on the GPU (run on the H200: `.ci/gpu_run.sh test`). On the H200 the calls
with bf16 queries and G = 8 or 16 run the wgmma kernel (cc/sm90/prefill), the others the warp-MMA kernel
(cc/sm80/prefill); `.ci/gpu_run.sh test_warp_mma` runs the prefill tests again with JAX_MSA_DISABLE_SM90_KERNELS=1.

Outputs and partials are poisoned with NaN before each launch (JAX_MSA_DEBUG_POISON=1, set here).
Bound: the kernel's error against the float64 oracle is at most 2x the error of a bf16 jnp implementation
(jax_msa.reference with precision="bf16") on the same inputs.
"""

import functools
import os

os.environ.setdefault("JAX_MSA_DEBUG_POISON", "1")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_msa
from jax_msa import KVFormat, reference
import problems
from bitwise import assert_bitwise_equal
from problems import brute_force_attention, corrupt_plan, make_problem

pytestmark = pytest.mark.gpu

K_SCALE, V_SCALE = 0.75, 1.25


def cache_maker(fmt):
    """cache_from_kv hook of problems.make_problem: the cache in `fmt` (K_SCALE, V_SCALE) and the values a kernel sees."""
    return problems.cache_maker(fmt, K_SCALE, V_SCALE)


def kernel_scales(fmt):
    """The k_scale / v_scale arguments of a `fmt` cache made by cache_maker (none for bf16)."""
    return {} if fmt == KVFormat.BF16 else dict(k_scale=K_SCALE, v_scale=V_SCALE)


@functools.partial(jax.jit, static_argnames="precision")
def jnp_attention(q, kv_cache, topk, *, precision, **args):
    """jax_msa.reference.sparse_attention (out, lse) as one jitted program, compiled once a shape for the session:
    called eagerly, its primitives compiled one by one for every new shape, seconds a problem on a GPU backend. The
    same operations either way (bf16 operands go into the products as bf16 arrays, with no rounding round trip for XLA
    to drop; on the CPU the outputs are bitwise the eager ones'), though on a GPU XLA may pick another GEMM algorithm."""
    return reference.sparse_attention(q, kv_cache, topk, precision=precision, return_lse=True, **args)


def run(problem, fmt, **kw):
    scales = kernel_scales(fmt)
    args = dict(cu_seqlens_q=problem.cu_seqlens_q, seq_lens=problem.seq_lens, block_table=problem.block_table,
                **scales, **kw)
    kernel = jax.jit(lambda q, c, t, a: jax_msa.sparse_attention(q, c, t, impl="kernel", return_lse=True, **a))
    out, lse = kernel(problem.q, problem.kv_cache, problem.topk, args)
    b16 = jnp_attention(problem.q, problem.kv_cache, problem.topk, precision="bf16", **args)
    return out, lse, b16


def check(problem, fmt, **kw):
    out, lse, (b16_out, b16_lse) = run(problem, fmt, **kw)
    o = np.asarray(out, np.float32).astype(np.float64)
    lse = np.asarray(lse, np.float64)
    assert not np.isnan(o).any() and not np.isnan(lse).any(), "unwritten (NaN-poisoned) or NaN outputs"
    ref_out, ref_lse = brute_force_attention(problem.q.astype(jnp.float32), problem.k, problem.v, problem.topk,
                                             problem.cu_seqlens_q, problem.seq_lens, problem.block_table,
                                             problem.scale)
    empty = np.isneginf(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    assert np.all(o[empty] == 0.0)
    k_err = np.abs(o - ref_out)
    b_err = np.abs(np.asarray(b16_out, np.float32).astype(np.float64) - ref_out)
    assert k_err.max() <= 2 * b_err.max() + 2.0**-12, (k_err.max(), b_err.max())
    norm = max(np.linalg.norm(ref_out), 1e-30)
    assert np.linalg.norm(k_err) / norm <= 2 * np.linalg.norm(b_err) / norm + 1e-7
    live = ~empty
    if live.any():
        b_lse_err = np.abs(np.asarray(b16_lse, np.float64)[live] - ref_lse[live]).max()
        assert np.abs(lse[live] - ref_lse[live]).max() <= 2 * b_lse_err + 1e-5
    return out, lse


@pytest.mark.parametrize("topk", [8, 16])
@pytest.mark.parametrize("group", [8, 16])
@pytest.mark.parametrize("fmt", list(KVFormat), ids=lambda f: f.name)
def test_prefill_varlen(fmt, group, topk):
    # lengths off the tile grid; the last request is a chunked prefill over a cached prefix
    p = make_problem(100 * int(fmt) + 10 * group + topk, q_lens=[1, 127, 129, 1000, 300],
                     seq_lens=[1, 127, 129, 1000, 4097], num_q_heads=2 * group, num_kv_heads=2, topk=topk,
                     pad_tokens=3, bad_page_frac=0.05, cache_from_kv=cache_maker(fmt))
    check(p, fmt)


@pytest.mark.parametrize("group", [8, 16])
@pytest.mark.parametrize("fmt", list(KVFormat), ids=lambda f: f.name)
def test_prefill_query_windows_match_one_call(fmt, group):
    """sparse_attention(query_chunk_size=...): the tokens in windows (each its own plan, its own in-place custom call
    on the whole q / out) give the one call's outputs bit for bit, which meet the oracle bound. Windows of 300 cut
    requests (and the tiles of a block) anywhere; 1000 and 129 are the same batch cut elsewhere."""
    p = make_problem(300 + 10 * int(fmt) + group, q_lens=[1, 127, 129, 1000, 300],
                     seq_lens=[1, 127, 129, 1000, 4097], num_q_heads=2 * group, num_kv_heads=2, topk=16,
                     pad_tokens=3, cache_from_kv=cache_maker(fmt))
    whole_out, whole_lse = check(p, fmt)
    scales = kernel_scales(fmt)
    for size in (300, 1000, 129):
        out, lse = jax.jit(lambda q, c, t: jax_msa.sparse_attention(
            q, c, t, cu_seqlens_q=p.cu_seqlens_q, seq_lens=p.seq_lens, block_table=p.block_table, impl="kernel",
            return_lse=True, query_chunk_size=size, **scales))(p.q, p.kv_cache, p.topk)
        assert_bitwise_equal(out, whole_out)
        np.testing.assert_array_equal(np.asarray(lse, np.float64), whole_lse)  # check() gives lse as float64


@pytest.mark.parametrize("group", [8, 16])
@pytest.mark.parametrize("fmt", list(KVFormat), ids=lambda f: f.name)
def test_prefill_request_alone_matches_its_batch(fmt, group):
    """Batch invariance across requests: each request run as a batch of its own (its own plan, work order and CTA
    assignment; same cache) gives the batch's bits for its tokens. (Tiles never mix requests; the query-window
    test above changes which tokens of one request share a tile.)"""
    p = make_problem(400 + 10 * int(fmt) + group, q_lens=[1, 127, 129, 1000, 300],
                     seq_lens=[1, 127, 129, 1000, 4097], num_q_heads=2 * group, num_kv_heads=2, topk=16,
                     pad_tokens=3, cache_from_kv=cache_maker(fmt))
    scales = kernel_scales(fmt)

    def call(q, topk, cu, seq, bt):
        fn = jax.jit(lambda q, c, t: jax_msa.sparse_attention(
            q, c, t, cu_seqlens_q=cu, seq_lens=seq, block_table=bt, impl="kernel", return_lse=True, **scales))
        return fn(q, p.kv_cache, topk)

    whole_out, whole_lse = call(p.q, p.topk, p.cu_seqlens_q, p.seq_lens, p.block_table)
    cu = np.asarray(p.cu_seqlens_q)
    real = slice(0, int(cu[-1]))  # NaN-poisoned outputs would compare equal bit for bit: none may be left
    assert not np.isnan(np.asarray(whole_out[real], np.float32)).any()
    assert not np.isnan(np.asarray(whole_lse[real])).any()
    for b in (1, 3, 4):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        out, lse = call(p.q[rows], p.topk[:, rows], jnp.asarray([0, cu[b + 1] - cu[b]], jnp.int32),
                        p.seq_lens[b:b + 1], p.block_table[b:b + 1])
        assert_bitwise_equal((out, lse), (whole_out[rows], whole_lse[rows]))


@pytest.mark.parametrize("fmt", list(KVFormat), ids=lambda f: f.name)
def test_prefill_long_request(fmt):
    p = make_problem(7 + int(fmt), q_lens=[4097], seq_lens=[4097], num_q_heads=16, num_kv_heads=1, topk=16,
                     cache_from_kv=cache_maker(fmt))
    check(p, fmt)


@pytest.mark.parametrize("fmt", list(KVFormat), ids=lambda f: f.name)
def test_prefill_topk_32(fmt):
    """K = 32 (the issue's largest top-k): up to 32 partials a query, so the combine merges them in 4 batches of 8
    (combine_partials.cu); G = 16 and G = 8 requests over a long prefix (48 blocks to choose from)."""
    for group in (16, 8):
        p = make_problem(43 + int(fmt) + group, q_lens=[700, 129], seq_lens=[6100, 129], num_q_heads=2 * group,
                         num_kv_heads=2, topk=32, hole_frac=0.05, dup_frac=0.05, oob_frac=0.05,
                         cache_from_kv=cache_maker(fmt))
        check(p, fmt)


def test_prefill_corners():
    # all-hole rows, a block chosen by every query, a request of one token, a request whose context is shorter than
    # its new tokens (the first 10 sit at negative positions: empty sets)
    p = make_problem(11, q_lens=[600, 1, 40], seq_lens=[900, 50, 30], num_q_heads=16, num_kv_heads=1, topk=16,
                     cache_from_kv=cache_maker(KVFormat.BF16))
    topk = np.array(p.topk)
    topk[0, ::7] = -1  # rows of holes only
    topk[0, 1::7, 0] = 0  # block 0 chosen by many queries (every query sees it: 128 * 0 <= pos)
    topk[0, :, 1] = 0
    p.topk = jnp.asarray(topk)
    check(p, KVFormat.BF16)


def test_prefill_fp8_query():
    p = make_problem(13, q_lens=[200, 333], seq_lens=[700, 333], num_q_heads=16, num_kv_heads=1, topk=16,
                     cache_from_kv=cache_maker(KVFormat.FP8))
    q_scale = 0.05
    q8 = (p.q.astype(jnp.float32) / q_scale).astype(jnp.float8_e4m3fn)
    p.q = q8.astype(jnp.float32) * q_scale  # what the oracle sees
    scales = dict(k_scale=K_SCALE, v_scale=V_SCALE, q_scale=q_scale)
    args = dict(cu_seqlens_q=p.cu_seqlens_q, seq_lens=p.seq_lens, block_table=p.block_table, return_lse=True)
    out, _ = jax.jit(lambda q, c, t: jax_msa.sparse_attention(q, c, t, impl="kernel", **args, **scales))(
        q8, p.kv_cache, p.topk)
    ref, _ = brute_force_attention(p.q, p.k, p.v, p.topk, p.cu_seqlens_q, p.seq_lens, p.block_table, p.scale)
    b16, _ = jnp_attention(q8, p.kv_cache, p.topk, precision="bf16", cu_seqlens_q=p.cu_seqlens_q, seq_lens=p.seq_lens,
                           block_table=p.block_table, **scales)
    k_err = np.abs(np.asarray(out, np.float32) - ref).max()
    b_err = np.abs(np.asarray(b16, np.float32) - ref).max()
    assert k_err <= 2 * b_err + 2.0**-12, (k_err, b_err)
    # in query windows (the in-place calls offset q by window_start rows of 1-byte elements): the same bits
    windowed, _ = jax.jit(lambda q, c, t: jax_msa.sparse_attention(q, c, t, impl="kernel", query_chunk_size=150,
                                                                   **args, **scales))(q8, p.kv_cache, p.topk)
    assert_bitwise_equal(windowed, out)


@pytest.mark.parametrize("group", [8, 16])
def test_prefill_nan_past_sequence(group):
    # The last page of each request holds NaN past seq_len (K and V): those keys are never attended, and P = 0 there
    # must not meet them (0 * NaN); the tile's other rows see every key of the block.
    p = make_problem(29 + group, q_lens=[300, 77, 1], seq_lens=[300, 1000, 129], num_q_heads=2 * group,
                     num_kv_heads=2, topk=8)
    cache = np.array(p.kv_cache)
    table = np.asarray(p.block_table)
    for b, s in enumerate(np.asarray(p.seq_lens)):
        if s % 128:
            cache[table[b, (s - 1) // 128], :, s % 128:, :] = np.nan
    p.kv_cache = jnp.asarray(cache)
    check(p, KVFormat.BF16)


@pytest.mark.parametrize("fmt", list(KVFormat), ids=lambda f: f.name)
def test_prefill_deterministic(fmt):
    p = make_problem(17, q_lens=[700], seq_lens=[1500], num_q_heads=16, num_kv_heads=2, topk=16,
                     cache_from_kv=cache_maker(fmt))
    a = run(p, fmt)
    b = run(p, fmt)
    np.testing.assert_array_equal(np.asarray(a[0], np.float32), np.asarray(b[0], np.float32))
    np.testing.assert_array_equal(np.asarray(a[1]), np.asarray(b[1]))


def test_prefill_total_q_beyond_grid_limit():
    # total_q > 65,535: the work list and the combine's grid stay in range; checked against the reference
    n = 70_000
    p = make_problem(19, q_lens=[n], seq_lens=[n], num_q_heads=8, num_kv_heads=1, topk=4, hole_frac=0.0,
                     dup_frac=0.0, oob_frac=0.0, cache_from_kv=cache_maker(KVFormat.BF16))
    out, lse, (b16_out, _) = run(p, KVFormat.BF16)
    ref_out, ref_lse = jnp_attention(p.q, p.kv_cache, p.topk, precision="fp32", cu_seqlens_q=p.cu_seqlens_q,
                                     seq_lens=p.seq_lens, block_table=p.block_table)
    o = np.asarray(out, np.float32)
    assert not np.isnan(o).any()
    k_err = np.abs(o - np.asarray(ref_out, np.float32)).max()
    b_err = np.abs(np.asarray(b16_out, np.float32) - np.asarray(ref_out, np.float32)).max()
    assert k_err <= 2 * b_err + 2.0**-12, (k_err, b_err)


@pytest.mark.sanitize
@pytest.mark.parametrize("fmt", list(KVFormat), ids=lambda f: f.name)
def test_prefill_small_for_sanitizer(fmt):
    p = make_problem(23, q_lens=[5, 130], seq_lens=[300, 130], num_q_heads=16, num_kv_heads=1, topk=8,
                     pad_tokens=2, cache_from_kv=cache_maker(fmt))
    check(p, fmt)


@pytest.mark.sanitize
def test_prefill_query_windows_for_sanitizer():
    """The in-place window calls (their q / out / lse pointers offset by window_start) under memcheck: windows of 60
    over the small case's tokens, the last one moved back over the one before it."""
    p = make_problem(23, q_lens=[5, 130], seq_lens=[300, 130], num_q_heads=16, num_kv_heads=1, topk=8,
                     pad_tokens=2, cache_from_kv=cache_maker(KVFormat.BF16))
    whole_out, _ = check(p, KVFormat.BF16)
    out = jax.jit(lambda q, c, t: jax_msa.sparse_attention(
        q, c, t, cu_seqlens_q=p.cu_seqlens_q, seq_lens=p.seq_lens, block_table=p.block_table, impl="kernel",
        query_chunk_size=60, **kernel_scales(KVFormat.BF16)))(p.q, p.kv_cache, p.topk)
    assert_bitwise_equal(out, whole_out)


@pytest.mark.sanitize
@pytest.mark.parametrize("fmt", list(KVFormat), ids=lambda f: f.name)
def test_prefill_stage_reuse_for_sanitizer(fmt):
    """More work items than SMs, runs of them chunks of one block: the sm90 kernel's CTAs walk contiguous ranges and a
    stage keeps its K / V for the next item of the same block, which the small case above (one item a CTA) never
    reaches. Every query picks its request's block 0, whose page the two requests share (a shared prefix: the same
    page, head and keys, across requests); the last blocks end inside their pages (92 and 124 keys) and are every
    later token's local block, so the tail V zeroing is reused too."""
    p = make_problem(29, q_lens=[1500, 700], seq_lens=[1500, 1020], num_q_heads=16, num_kv_heads=1, topk=4,
                     cache_from_kv=cache_maker(fmt))
    topk = np.array(p.topk)
    topk[0, :, 1] = 0
    p.topk = jnp.asarray(topk)
    table = np.array(p.block_table)
    table[1, 0] = table[0, 0]
    p.block_table = jnp.asarray(table)
    check(p, fmt)


@pytest.mark.sanitize
@pytest.mark.parametrize("fmt,group", [(f, 16) for f in KVFormat] + [(KVFormat.BF16, 8)],
                         ids=lambda x: x.name if isinstance(x, KVFormat) else f"G{x}")
def test_prefill_corrupt_plan_for_sanitizer(fmt, group):
    """A plan passed in with entries out of every range (jax_msa.plan.clamp_plan_entries bounds them): the kernels
    and the combine stay in bounds (memcheck: `SANITIZE_SELECT=corrupt bash .ci/gpu_run.sh sanitize`) and the
    call completes; its results are garbage and not checked. The problem's own plan afterwards still checks out."""
    p = make_problem(31, q_lens=[5, 130], seq_lens=[300, 130], num_q_heads=group, num_kv_heads=1, topk=8,
                     pad_tokens=2, cache_from_kv=cache_maker(fmt))
    scales = kernel_scales(fmt)
    args = dict(cu_seqlens_q=p.cu_seqlens_q, seq_lens=p.seq_lens, block_table=p.block_table, **scales)
    plan = jax_msa.build_prefill_plan(p.topk, p.cu_seqlens_q, p.seq_lens, max_blocks=p.block_table.shape[1],
                                      queries_per_tile=8)
    kernel = jax.jit(lambda q, c, t, plan, a: jax_msa.sparse_attention(q, c, t, impl="kernel", return_lse=True,
                                                                         plan=plan, **a))
    for seed, num_work in ((0, None), (1, 3)):  # every tile corrupt; three corrupt tiles
        jax.block_until_ready(kernel(p.q, p.kv_cache, p.topk,
                                     corrupt_plan(plan, np.random.default_rng(seed), num_work=num_work), args))
    check(p, fmt)


def test_prefill_fragment_order_partials_match_natural(monkeypatch):
    """The sm90 kernel writes its bf16 partial rows in fragment order (cc/common/partial_order.h; the default) or, with
    JAX_MSA_PARTIAL_FRAGMENT_ORDER=0 (read when a call runs), in the natural column order, and the combine reads the
    order written. Same arithmetic, so the outputs and lse must be bit-identical in both orders (each run() is a fresh
    jitted function, first run after the variable is set). The partials themselves are workspaces, discarded: the test
    cannot tell the order was taken, only that taking it changes nothing."""
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus or not jax_msa.cuda_available():
        pytest.skip("needs a CUDA GPU and the CUDA build")
    cc = tuple(int(x) for x in str(gpus[0].compute_capability).split("."))
    if jax_msa._ffi.kernel_path(*cc, sm90_enabled=os.environ.get("JAX_MSA_DISABLE_SM90_KERNELS") != "1") != "sm90":
        pytest.skip("the fragment order is only written by the sm90 wgmma prefill")
    for fmt in KVFormat:
        p = make_problem(31, q_lens=[300, 129], seq_lens=[700, 129], num_q_heads=16, num_kv_heads=1, topk=8,
                         cache_from_kv=cache_maker(fmt))
        results = []
        for order in ("0", "1"):
            monkeypatch.setenv("JAX_MSA_PARTIAL_FRAGMENT_ORDER", order)
            out, lse = check(p, fmt)
            results.append((np.asarray(out, np.float32), np.asarray(lse)))
        np.testing.assert_array_equal(results[0][0], results[1][0], err_msg=fmt.name)
        np.testing.assert_array_equal(results[0][1], results[1][1], err_msg=fmt.name)
