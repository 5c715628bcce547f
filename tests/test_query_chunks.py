"""sparse_attention(..., query_chunk_size=C): the prefill in query windows (jax_msa/_query_chunks.py).

A window of the flat token axis is a chunked prefill of its own; run one after the other, the windows must give
exactly the results of one call (the kernels bit-identically: a token's result depends only on its own query, top-k
row and position; the jnp reference up to rounding), while each custom call's partial workspace is sized by the
window.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_msa
from jax_msa import _ffi, _query_chunks, reference
from bitwise import assert_bitwise_equal
from problems import cache_maker, make_problem

SHAPES = dict(num_q_heads=16, num_kv_heads=2, head_dim=128, topk=8)


def _problem(seed=7):
    # corners: a one-token request, lengths off the tile grid, a request with no new tokens, one whose first
    # tokens sit at negative positions (seq_len < q_len), a chunked prefill over a cached prefix, padding rows
    return make_problem(seed, q_lens=[1, 127, 0, 40, 129, 150], seq_lens=[5, 127, 260, 20, 400, 1000],
                        pad_tokens=5, **SHAPES)


def _attention(p, impl, **kw):
    fn = jax.jit(lambda q, c, t: jax_msa.sparse_attention(q, c, t, return_lse=True, impl=impl,
                                                          **p.prefill_kwargs(), **kw))
    return fn(p.q, p.kv_cache, p.topk)


def test_windows_match_one_call_bit_for_bit():
    """The CPU handler (a kernel: every (token, block) partial and every token's merge computed on its own)."""
    p = _problem()
    total_q = p.q.shape[0]
    whole = _attention(p, "auto")
    assert np.isneginf(np.asarray(whole[1])).any() and np.isfinite(np.asarray(whole[1])).any()
    for size in [1, 37, 128, total_q - 1, total_q, total_q + 100]:
        assert_bitwise_equal(_attention(p, "auto", query_chunk_size=size), whole)


def test_reference_in_windows_matches_to_rounding():
    """The jnp reference in windows: XLA may compile a window's shapes differently (one-token windows at 4/2 heads,
    K = 4 differ in the last bit of some lse and, through it, by one bf16 ulp in a few outputs), so equal up to one
    rounding step, and the same empty rows."""
    p = make_problem(17, q_lens=[1, 127, 0, 40, 129], seq_lens=[5, 127, 260, 20, 400], pad_tokens=5,
                     num_q_heads=4, num_kv_heads=2, head_dim=128, topk=4)
    (out, lse) = _attention(p, "reference")
    for size in [1, 2, 37, p.q.shape[0] - 1]:
        w_out, w_lse = _attention(p, "reference", query_chunk_size=size)
        np.testing.assert_array_equal(np.isneginf(np.asarray(w_lse)), np.isneginf(np.asarray(lse)))
        live = np.isfinite(np.asarray(lse))
        np.testing.assert_allclose(np.asarray(w_lse)[live], np.asarray(lse)[live], rtol=2e-7, atol=2e-6)
        np.testing.assert_allclose(np.asarray(w_out, np.float32), np.asarray(out, np.float32), rtol=2**-7, atol=1e-6)  # 1 bf16 ulp


def test_windows_in_every_cache_format():
    for fmt in [jax_msa.KVFormat.FP8, jax_msa.KVFormat.NVFP4]:
        p = make_problem(11, q_lens=[1, 127, 0, 40, 129, 150], seq_lens=[5, 127, 260, 20, 400, 1000], pad_tokens=5,
                         cache_from_kv=cache_maker(fmt, 0.5, 2.0), **SHAPES)
        fn = lambda **kw: _attention(p, "auto", k_scale=0.5, v_scale=2.0, **kw)
        assert_bitwise_equal(fn(query_chunk_size=100), fn())


def test_window_batch_keeps_every_token_position():
    p = _problem(3)
    total_q = p.q.shape[0]
    req, pos, in_batch = (np.asarray(x) for x in reference.prefill_positions(p.cu_seqlens_q, p.seq_lens, total_q))
    for size in [1, 50, 128, total_q - 3]:
        starts = np.asarray(_query_chunks.window_starts(total_q, size))
        n, window = _query_chunks.window_layout(total_q, size)
        assert len(starts) == n and window <= size and starts[-1] + window == total_q
        assert starts[0] == 0 and np.all(np.diff(starts) <= window)  # the windows cover every token
        for s in starts:
            cu, seq = _query_chunks.window_batch(p.cu_seqlens_q, p.seq_lens, jnp.int32(s), window)
            w_req, w_pos, w_in = (np.asarray(x) for x in reference.prefill_positions(cu, seq, window))
            sl = slice(int(s), int(s) + window)
            np.testing.assert_array_equal(w_in, in_batch[sl])
            np.testing.assert_array_equal(w_req[w_in], req[sl][w_in])
            np.testing.assert_array_equal(w_pos[w_in], pos[sl][w_in])
            counts = np.diff(np.asarray(cu))
            assert np.all(np.asarray(seq)[counts == 0] >= 0)


def _prefill_calls(text: str, target: str) -> list[tuple[list[str], list[str], str]]:
    """(operand types, result types, attributes) of every custom call to target in a lowered module's text."""
    calls = []
    for line in text.splitlines():
        if re.search(rf"custom_call\s*@{target}\b", line):
            signature = line.rsplit(" : ", 1)[-1]
            operands, results = signature.split("->")
            calls.append((re.findall(r"tensor<([^>]*)>", operands), re.findall(r"tensor<([^>]*)>", results), line))
    return calls


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_windows_are_in_place_calls_with_window_sized_workspaces(platform):
    """One jax_msa_prefill_window call a window (static starts), each on the WHOLE q and writing into the whole out /
    lse, the previous window's aliased in place (none for the first): no slice of q, no copy of a window's out back.
    Each call's partial workspace has the window's size; the windows' plans come from one loop."""
    if platform == "cuda" and _ffi.TARGET_PREFILL_WINDOW not in _ffi.cuda_targets():
        pytest.skip("built without the CUDA prefill handler")
    p = _problem(5)
    total_q, hq, size = p.q.shape[0], p.q.shape[1], 128
    n, window = _query_chunks.window_layout(total_q, size)
    assert n == 4 and window < total_q

    def fn(q, c, t):
        return jax_msa.sparse_attention(q, c, t, query_chunk_size=size, **p.prefill_kwargs())

    text = jax.jit(fn).trace(p.q, p.kv_cache, p.topk).lower(lowering_platforms=(platform,)).as_text()
    assert "stablehlo.while" in text  # the plans' lax.map
    assert not _prefill_calls(text, _ffi.TARGET_PREFILL)
    calls = _prefill_calls(text, _ffi.TARGET_PREFILL_WINDOW)
    assert len(calls) == n, len(calls)
    partial = "bf16" if platform == "cuda" else "f32"
    hkv, k, g = SHAPES["num_kv_heads"], SHAPES["topk"], SHAPES["num_q_heads"] // SHAPES["num_kv_heads"]
    whole = [f"{total_q}x{hq}x128xbf16", f"{total_q}x{hq}xf32"]
    starts = _query_chunks.static_window_starts(total_q, size)
    for i, (operands, results, line) in enumerate(calls):
        assert operands[0] == whole[0], operands  # the whole q
        assert results[:2] == whole, results
        assert f"{window}x{hkv}x{k}x{g}x128x{partial}" in results, results
        assert f"window_start = {starts[i]} : i32" in line
        if i == 0:  # q, cache, the 3 scales, cu_seqlens_q, seq_lens, block_table, the 6 plan arrays
            assert len(operands) == 14 and "output_operand_alias" not in line
        else:
            assert operands[14:] == whole, operands
            assert line.count("output_operand_alias<") == 2, line
    assert not re.search(rf"dynamic_slice .*-> tensor<{window}x{hq}x128xbf16>", text)  # q is not sliced


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_many_windows_run_in_a_scan(platform, monkeypatch):
    """Beyond MAX_IN_PLACE_WINDOWS windows (compile time grows with the unrolled calls) the kernels run the windows
    in a lax.scan: one jax_msa_prefill call on a window-sized slice of q, no window calls; still bit for bit."""
    if platform == "cuda" and _ffi.TARGET_PREFILL not in _ffi.cuda_targets():
        pytest.skip("built without the CUDA prefill handler")
    monkeypatch.setattr(_query_chunks, "MAX_IN_PLACE_WINDOWS", 2)
    p = _problem(5)
    total_q, hq, size = p.q.shape[0], p.q.shape[1], 128
    n, window = _query_chunks.window_layout(total_q, size)
    assert n == 4 and not _query_chunks.in_place(total_q, size)

    def fn(q, c, t):
        return jax_msa.sparse_attention(q, c, t, query_chunk_size=size, **p.prefill_kwargs())

    text = jax.jit(fn).trace(p.q, p.kv_cache, p.topk).lower(lowering_platforms=(platform,)).as_text()
    assert "stablehlo.while" in text
    assert not _prefill_calls(text, _ffi.TARGET_PREFILL_WINDOW)
    calls = _prefill_calls(text, _ffi.TARGET_PREFILL)
    assert len(calls) == 1 and calls[0][0][0] == f"{window}x{hq}x128xbf16", calls
    if platform == "cpu":
        assert_bitwise_equal(_attention(p, "auto", query_chunk_size=size), _attention(p, "auto"))


def test_windows_with_fp8_queries():
    """The in-place calls offset q by window_start rows of q's element size (1 byte for FP8 queries)."""
    p = _problem(13)
    q8 = (p.q.astype(jnp.float32) / 0.05).astype(jnp.float8_e4m3fn)

    def run(**kw):
        return jax.jit(lambda q, c, t: jax_msa.sparse_attention(q, c, t, return_lse=True, q_scale=0.05,
                                                                **p.prefill_kwargs(), **kw))(q8, p.kv_cache, p.topk)

    assert _query_chunks.in_place(p.q.shape[0], 100)
    assert_bitwise_equal(run(query_chunk_size=100), run())


def test_bad_window_calls_are_refused_at_trace_time():
    p = _problem(9)
    plan = jax_msa.build_prefill_plan(p.topk[:, :100], jnp.asarray([0, 100], jnp.int32), jnp.asarray([100], jnp.int32),
                                      max_blocks=p.block_table.shape[1])
    scales = _ffi.scale_operands(None, None, None)
    kw = dict(softmax_scale=0.1, kv_format=int(jax_msa.KVFormat.BF16))
    args = (p.q, p.kv_cache, scales, jnp.asarray([0, 100], jnp.int32), jnp.asarray([100], jnp.int32),
            p.block_table[:1], plan)
    with pytest.raises(ValueError, match="does not fit"):
        _ffi.prefill_window_call(*args, window_start=p.q.shape[0] - 99, **kw)
    with pytest.raises(ValueError, match="does not fit"):
        _ffi.prefill_window_call(*args, window_start=-1, **kw)
    with pytest.raises(ValueError, match="both out and lse"):
        _ffi.prefill_window_call(*args, p.q.astype(jnp.bfloat16), window_start=0, **kw)


def test_bad_chunk_sizes_and_a_plan_are_refused():
    p = _problem(9)
    args = (p.q, p.kv_cache, p.topk)
    for bad, err in [(0, ValueError), (-4, ValueError), (2.5, TypeError), ("64", TypeError), (True, TypeError)]:
        with pytest.raises(err, match="query_chunk_size"):
            jax_msa.sparse_attention(*args, query_chunk_size=bad, **p.prefill_kwargs())
    with pytest.raises(TypeError, match="query_chunk_size"):  # a traced size cannot shape the windows
        jax.jit(lambda n: jax_msa.sparse_attention(*args, query_chunk_size=n, **p.prefill_kwargs()))(64)
    plan = jax_msa.build_prefill_plan(p.topk, p.cu_seqlens_q, p.seq_lens, max_blocks=p.block_table.shape[1])
    with pytest.raises(ValueError, match="plan= and query_chunk_size"):
        jax_msa.sparse_attention(*args, plan=plan, query_chunk_size=10_000, **p.prefill_kwargs())
    out = jax_msa.sparse_attention(*args, query_chunk_size=np.int64(64), **p.prefill_kwargs())  # numpy ints are static
    assert out.shape == p.q.shape


def test_windows_stay_forward_only_and_the_reference_differentiable():
    p = _problem(13)

    def loss(q, impl):
        return jax_msa.sparse_attention(q, p.kv_cache, p.topk, impl=impl, query_chunk_size=100,
                                        **p.prefill_kwargs()).astype(jnp.float32).sum()

    with pytest.raises(TypeError, match="forward-only"):
        jax.grad(loss)(p.q.astype(jnp.float32).astype(jnp.bfloat16), "auto")
    g = jax.grad(loss)(p.q, "reference")
    g_whole = jax.grad(lambda q: jax_msa.sparse_attention(q, p.kv_cache, p.topk, impl="reference",
                                                          **p.prefill_kwargs()).astype(jnp.float32).sum())(p.q)
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(g_whole, np.float32), rtol=0, atol=0)
