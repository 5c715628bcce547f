"""jax_msa.reference against the float64 brute force of tests/problems.py (MSA.md section 2).

Bounds (out is bf16, so rounding it costs up to 2^-8 relative):
  fp32:  |out - brute| <= 2^-8 |brute| + 2^-16 * aw
  bf16:  |out - brute| <= 2^-8 |brute| + (2^-8 + 2^-16) * aw
where aw = sum_k softmax_k |V_k| (per element, from the oracle): rounding P to bf16 moves every weight by
at most 2^-8 relative, so P @ V moves by at most 2^-8 * aw; 2^-16 * aw covers fp32 accumulation.
lse: |lse - brute| <= 1e-4 (fp32 sums of at most 2,048 terms). Empty sets: out exactly 0, lse exactly -inf.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_msa import reference
from problems import make_decode_problem, make_problem

FP32_SLACK = 2.0**-16
BF16_U = 2.0**-8


def _run_reference(problem, precision):
    if problem.decode_query_len is None:
        fn = functools.partial(reference.sparse_attention, return_lse=True, precision=precision,
                               scale=problem.scale)
        out, lse = jax.jit(fn)(problem.q, problem.kv_cache, problem.topk, cu_seqlens_q=problem.cu_seqlens_q,
                               seq_lens=problem.seq_lens, block_table=problem.block_table)
    else:
        fn = functools.partial(reference.sparse_decode, return_lse=True, precision=precision, scale=problem.scale,
                               decode_query_len=problem.decode_query_len)
        out, lse = jax.jit(fn)(problem.q, problem.kv_cache, problem.topk, seq_lens=problem.seq_lens,
                               block_table=problem.block_table)
    assert out.dtype == jnp.bfloat16 and out.shape == problem.q.shape
    assert lse.dtype == jnp.float32 and lse.shape == problem.q.shape[:2]
    return np.asarray(out.astype(jnp.float32), np.float64), np.asarray(lse, np.float64)


def _check(problem, out, lse, *, p_rounding):
    want_out, want_lse, aw = problem.brute_force(with_abs_weighted=True)
    empty = np.isneginf(want_lse)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_array_equal(out[empty], 0.0)
    np.testing.assert_array_equal(lse[empty], -np.inf)
    bound = BF16_U * np.abs(want_out) + (p_rounding + FP32_SLACK) * aw
    err = np.abs(out - want_out)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), f"out error {err[worst]:.3g} > bound {bound[worst]:.3g} at {worst}"
    np.testing.assert_allclose(lse[~empty], want_lse[~empty], rtol=0, atol=1e-4)
    assert (~empty).sum() > 0, "the problem should have non-empty rows"


CASES = {
    # fresh varlen prefill (seq_len == q_len), a request crossing block boundaries
    "prefill_varlen": dict(seed=11, q_lens=[3, 140, 37], seq_lens=[3, 140, 37], num_q_heads=4, num_kv_heads=2,
                           topk=8),
    # chunked prefill: new tokens after a cached prefix; one request ends mid-block
    "chunked_prefill": dict(seed=12, q_lens=[20, 64], seq_lens=[300, 700], num_q_heads=8, num_kv_heads=1,
                            topk=16),
    # heavy holes and out-of-range ids, no forced local block, padding rows past cu_seqlens_q[-1]
    "prefill_holes_padding": dict(seed=13, q_lens=[9, 0, 50], seq_lens=[400, 10, 260], num_q_heads=2,
                                  num_kv_heads=2, topk=4, hole_frac=0.4, oob_frac=0.3, include_local=False,
                                  pad_tokens=5),
}
DECODE_CASES = {
    "decode_q1": dict(seed=21, seq_lens=[1, 129, 1000, 257], decode_query_len=1, num_q_heads=8,
                      num_kv_heads=1, topk=16),
    "decode_q4": dict(seed=22, seq_lens=[4, 130, 900], decode_query_len=4, num_q_heads=4, num_kv_heads=2,
                      topk=8),
}


def _problem(name):
    if name in CASES:
        return make_problem(**CASES[name], head_dim=128)
    return make_decode_problem(**DECODE_CASES[name], head_dim=128)


@pytest.mark.parametrize("name", [*CASES, *DECODE_CASES])
def test_fp32_reference_matches_brute_force(name):
    problem = _problem(name)
    out, lse = _run_reference(problem, "fp32")
    _check(problem, out, lse, p_rounding=0.0)


@pytest.mark.parametrize("name", ["chunked_prefill", "decode_q4"])
def test_bf16_reference_within_bf16_rounding(name):
    problem = _problem(name)
    out, lse = _run_reference(problem, "bf16")
    _check(problem, out, lse, p_rounding=BF16_U)


def test_reference_custom_scale_and_padding_rows():
    problem = make_problem(31, q_lens=[5, 7], seq_lens=[133, 7], num_q_heads=2, num_kv_heads=1, topk=4,
                           pad_tokens=3, scale=0.3, head_dim=64)
    out, lse = _run_reference(problem, "fp32")
    _check(problem, out, lse, p_rounding=0.0)
    np.testing.assert_array_equal(out[-3:], 0.0)
    np.testing.assert_array_equal(lse[-3:], -np.inf)


def test_reference_empty_batches():
    """No requests (B = 0) or no tokens: empty rows everywhere, never an indexing error."""
    cache = jnp.zeros((2, 1, 128, 256), jnp.bfloat16)
    out, lse = reference.sparse_decode(jnp.zeros((0, 2, 128), jnp.bfloat16), cache, jnp.zeros((1, 0, 4), jnp.int32),
                                       seq_lens=jnp.zeros((0,), jnp.int32), block_table=jnp.zeros((0, 2), jnp.int32),
                                       decode_query_len=2, return_lse=True)
    assert out.shape == (0, 2, 128) and lse.shape == (0, 2)
    q = jnp.ones((3, 2, 128), jnp.bfloat16)
    topk = jnp.zeros((1, 3, 4), jnp.int32)
    for cu, seq_lens, table in (([0], [], (0, 2)), ([0, 0], [200], (1, 2))):  # B = 0; B = 1 with no new tokens
        out, lse = reference.sparse_attention(q, cache, topk, cu_seqlens_q=jnp.array(cu, jnp.int32),
                                              seq_lens=jnp.array(seq_lens, jnp.int32),
                                              block_table=jnp.zeros(table, jnp.int32), return_lse=True)
        np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), 0.0)
        np.testing.assert_array_equal(np.asarray(lse), -np.inf)
