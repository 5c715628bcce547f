"""The CPU FFI handlers (impl="kernel" on CPU) against the float64 brute force, and write_kv on a bf16 cache.

Attention bound, per (token, query head) row, with err = max_d |x - brute|:
  out: err(kernel) <= 2 * err(jax_msa.reference, precision="bf16") + 1e-6
  lse: |kernel - brute| <= 2 * |reference bf16 - brute| + 1e-5
The 1e-6 covers rows where both errors are exactly zero (a single visible key: out = V exactly). The lse
slack is 1e-5 (about 10 fp32 ulps at |lse| ~ 10): q and K are bf16 values, so the bf16 reference computes
scores as exactly as fp32 does and its lse error is fp32 summation-order noise (~1e-7), which a kernel
summing in another order legitimately doubles. Empty sets: out exactly 0, lse exactly -inf, never NaN.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_msa
from jax_msa import reference
from bitwise import bits
from problems import INT32_MAX, INT32_MIN, PAGE, make_decode_problem, make_problem

OUT_SLACK = 1e-6
LSE_SLACK = 1e-5


@functools.cache
def _jitted(module, op: str, **static):
    return jax.jit(functools.partial(getattr(module, op), **static))


def _run(problem, *, kernel: bool, return_lse=True):
    """(out f64, lse f64 or None) of the kernel (impl="kernel") or of the bf16-precision reference."""
    module, extra = (jax_msa, dict(impl="kernel")) if kernel else (reference, dict(precision="bf16"))
    args = (problem.q, problem.kv_cache, problem.topk)
    if problem.decode_query_len is None:
        fn = _jitted(module, "sparse_attention", scale=problem.scale, return_lse=return_lse, **extra)
        res = fn(*args, cu_seqlens_q=problem.cu_seqlens_q, seq_lens=problem.seq_lens,
                 block_table=problem.block_table)
    else:
        fn = _jitted(module, "sparse_decode", scale=problem.scale, return_lse=return_lse,
                     decode_query_len=problem.decode_query_len, **extra)
        res = fn(*args, seq_lens=problem.seq_lens, block_table=problem.block_table)
    out, lse = res if return_lse else (res, None)
    assert out.dtype == jnp.bfloat16 and out.shape == problem.q.shape
    out = np.asarray(out.astype(jnp.float32), np.float64)
    if lse is not None:
        assert lse.dtype == jnp.float32 and lse.shape == problem.q.shape[:2]
        lse = np.asarray(lse, np.float64)
    return out, lse


def _check_kernel(problem, expect_nonempty=True):
    want_out, want_lse = problem.brute_force()
    out, lse = _run(problem, kernel=True)
    ref_out, ref_lse = _run(problem, kernel=False)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    empty = np.isneginf(want_lse)
    assert expect_nonempty == bool((~empty).any())
    np.testing.assert_array_equal(out[empty], 0.0)
    np.testing.assert_array_equal(lse[empty], -np.inf)

    err = np.abs(out - want_out).max(axis=-1)
    ref_err = np.abs(ref_out - want_out).max(axis=-1)
    bound = 2 * ref_err + OUT_SLACK
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), f"out row error {err[worst]:.3g} > bound {bound[worst]:.3g} at (t, h) = {worst}"

    ne = ~empty
    lse_err = np.abs(lse[ne] - want_lse[ne])
    lse_bound = 2 * np.abs(ref_lse[ne] - want_lse[ne]) + LSE_SLACK
    if ne.any():
        i = np.argmax(lse_err - lse_bound)
        assert (lse_err <= lse_bound).all(), f"lse error {lse_err[i]:.3g} > bound {lse_bound[i]:.3g}"
    return out, lse


def _with_rows_all_holes(problem, every: int):
    """Every `every`-th token gets an all -1 top-k row for every KV head."""
    return dataclasses.replace(problem, topk=problem.topk.at[:, ::every].set(-1))


PREFILL_CASES = {
    # GQA 8, K 16, chunked prefill over a cached prefix, invalid page ids behind selected blocks, padding rows
    "gqa8_k16_chunked_bad_pages_padding": dict(
        seed=101, q_lens=[17, 40, 1], seq_lens=[500, 300, 129], num_q_heads=8, num_kv_heads=1, topk=16,
        bad_page_frac=0.25, pad_tokens=4),
    # GQA 1, K 4, KV lengths 1 / 127 / 129 / 1023, many duplicates and out-of-range ids
    "gqa1_k4_odd_lengths_dups_oob": dict(
        seed=102, q_lens=[1, 127, 129, 3], seq_lens=[1, 127, 129, 1023], num_q_heads=2, num_kv_heads=2, topk=4,
        dup_frac=0.4, oob_frac=0.3),
    # GQA 16, K 32, requests with zero new tokens (cu_seqlens_q repeats), padding rows
    "gqa16_k32_zero_new_tokens": dict(
        seed=103, q_lens=[6, 0, 9, 0], seq_lens=[200, 50, 1023, 0], num_q_heads=16, num_kv_heads=1, topk=32,
        pad_tokens=3),
    # q_len 1 per request, K 8, GQA 8 over two KV heads, custom scale
    "gqa8_k8_q_len1_scale": dict(
        seed=104, q_lens=[1, 1, 1, 1], seq_lens=[1, 128, 129, 700], num_q_heads=16, num_kv_heads=2, topk=8,
        scale=0.05),
    # head_dim 64 (the CPU handler takes any D), K 16, no forced local block; request 1 has more new tokens
    # than KV (seq_len 3 < q_len 5): its first two tokens sit at negative positions (empty)
    "d64_no_local_negative_positions": dict(
        seed=105, q_lens=[130, 5], seq_lens=[130, 3], num_q_heads=4, num_kv_heads=2, topk=16, head_dim=64,
        include_local=False, scale=0.5),
}

DECODE_CASES = {
    "q1_gqa16_k16_bad_pages": dict(seed=201, seq_lens=[1, 127, 129, 1023], decode_query_len=1, num_q_heads=16,
                                   num_kv_heads=1, topk=16, bad_page_frac=0.25),
    # seq_len 2 < decode_query_len 4: the first two tokens sit at negative positions (empty)
    "q4_gqa8_k32_dups_negative_pos": dict(seed=202, seq_lens=[2, 128, 1023], decode_query_len=4, num_q_heads=16,
                                          num_kv_heads=2, topk=32, dup_frac=0.4),
    "q2_gqa1_k4_oob_scale": dict(seed=203, seq_lens=[300, 129, 1], decode_query_len=2, num_q_heads=2,
                                 num_kv_heads=2, topk=4, oob_frac=0.4, scale=0.3),
    "q1_gqa8_k8_holes": dict(seed=204, seq_lens=[640, 127, 1000, 5], decode_query_len=1, num_q_heads=8,
                             num_kv_heads=1, topk=8, hole_frac=0.6),
}


@pytest.mark.parametrize("name", PREFILL_CASES)
def test_prefill_kernel_matches_brute_force(name):
    problem = make_problem(**{"head_dim": 128, **PREFILL_CASES[name]})
    out, lse = _check_kernel(problem)
    if problem.q.shape[0] > problem.num_tokens_in_batch:  # padding rows past cu_seqlens_q[-1]
        np.testing.assert_array_equal(out[problem.num_tokens_in_batch:], 0.0)
        np.testing.assert_array_equal(lse[problem.num_tokens_in_batch:], -np.inf)


@pytest.mark.parametrize("name", DECODE_CASES)
def test_decode_kernel_matches_brute_force(name):
    _check_kernel(make_decode_problem(**DECODE_CASES[name], head_dim=128))


def test_prefill_rows_of_only_holes_are_empty():
    problem = _with_rows_all_holes(
        make_problem(301, q_lens=[20, 13], seq_lens=[260, 13], num_q_heads=8, num_kv_heads=2, topk=8), every=3)
    out, lse = _check_kernel(problem)
    np.testing.assert_array_equal(out[::3], 0.0)
    np.testing.assert_array_equal(lse[::3], -np.inf)


def test_decode_rows_of_only_holes_are_empty():
    problem = _with_rows_all_holes(
        make_decode_problem(302, seq_lens=[129, 400, 7], decode_query_len=2, num_q_heads=8, num_kv_heads=2, topk=8),
        every=2)
    out, lse = _check_kernel(problem)
    np.testing.assert_array_equal(out[::2], 0.0)
    np.testing.assert_array_equal(lse[::2], -np.inf)


@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
@pytest.mark.parametrize("what", ["holes", "out_of_range"])
def test_everything_empty(decode, what):
    """All ids -1, or all ids out of range (>= block count, negative, huge): never dereferenced."""
    fracs = dict(hole_frac=1.0, dup_frac=0.0, oob_frac=0.0) if what == "holes" else \
        dict(hole_frac=0.0, dup_frac=0.0, oob_frac=1.0)
    common = dict(num_q_heads=4, num_kv_heads=1, topk=8, include_local=False, **fracs)
    if decode:
        problem = make_decode_problem(303, seq_lens=[129, 1], decode_query_len=2, **common)
    else:
        problem = make_problem(303, q_lens=[3, 9], seq_lens=[250, 9], pad_tokens=2, **common)
    out, lse = _check_kernel(problem, expect_nonempty=False)
    assert (out == 0).all() and np.isneginf(lse).all()


def test_decode_kernel_empty_batch():
    p = make_decode_problem(305, seq_lens=[], decode_query_len=2, num_q_heads=4, num_kv_heads=1, topk=4)
    assert p.q.shape == (0, 4, 128)
    out, lse = _run(p, kernel=True)
    assert out.shape == (0, 4, 128) and lse.shape == (0, 4)


@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_return_lse_off_gives_the_same_out(decode):
    if decode:
        problem = make_decode_problem(304, seq_lens=[300, 129], decode_query_len=1, num_q_heads=8,
                                      num_kv_heads=1, topk=8)
    else:
        problem = make_problem(304, q_lens=[7, 30], seq_lens=[400, 30], num_q_heads=8, num_kv_heads=1, topk=8)
    with_lse, _ = _run(problem, kernel=True, return_lse=True)
    without_lse, none = _run(problem, kernel=True, return_lse=False)
    assert none is None
    np.testing.assert_array_equal(without_lse, with_lse)
    want, _ = problem.brute_force()
    assert np.abs(with_lse - want).max() < 0.02  # a sanity anchor; the tight bound is checked above


# ---------------------------------------------------------------------------------------------------------
# write_kv (bf16 cache)
# ---------------------------------------------------------------------------------------------------------

def _write_kv_inputs(seed, *, pages=5, hkv=2, d=128, n=24, k_dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    cache = jnp.asarray(rng.standard_normal((pages, hkv, PAGE, 2 * d)), jnp.bfloat16)  # poisoned: random
    valid = rng.choice(pages * PAGE, size=n - 8, replace=False)
    skipped = np.array([-1, -2, -PAGE, INT32_MIN, pages * PAGE, pages * PAGE + 1, 10**6, INT32_MAX])
    slots = rng.permutation(np.concatenate([valid, skipped])).astype(np.int32)
    k = jnp.asarray(rng.standard_normal((n, hkv, d)), k_dtype)
    v = jnp.asarray(rng.standard_normal((n, hkv, d)), k_dtype)
    return cache, k, v, jnp.asarray(slots)


@pytest.mark.parametrize("k_dtype", [jnp.bfloat16, jnp.float32], ids=["bf16_kv", "f32_kv"])
def test_write_kv_bit_exact_vs_reference(k_dtype):
    cache, k, v, slots = _write_kv_inputs(401, k_dtype=k_dtype)
    before = np.asarray(cache)
    got = jax.jit(functools.partial(jax_msa.write_kv, impl="kernel"))(cache, k, v, slots)
    want = jax.jit(reference.write_kv)(cache, k, v, slots)
    assert got.dtype == jnp.bfloat16 and got.shape == cache.shape
    np.testing.assert_array_equal(bits(got), bits(want))

    # Independently: written rows hold bf16(k) | bf16(v); every other row is untouched.
    got = np.asarray(got)
    s = np.asarray(slots)
    ok = (s >= 0) & (s < cache.shape[0] * PAGE)
    assert ok.sum() == 16
    touched = np.zeros(cache.shape[:3], bool)
    for n in np.nonzero(ok)[0]:
        page, off = divmod(int(s[n]), PAGE)
        row = np.concatenate([np.asarray(k[n]), np.asarray(v[n])], axis=-1).astype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(bits(got[page, :, off]), bits(row))
        touched[page, :, off] = True
    np.testing.assert_array_equal(bits(got[~touched]), bits(before[~touched]))


def test_write_kv_in_place_under_donation():
    """Under jit with the cache donated the custom call writes into the donated buffer (no copy).

    Results are read through device-side copies: a NumPy view of a jax.Array on CPU is an external
    reference to its buffer, which would make the next donation fall back to a copy."""
    cache, k, v, slots = _write_kv_inputs(402, pages=4, hkv=1, d=64, n=12)
    want = reference.write_kv(cache, k, v, slots)
    fn = jax.jit(functools.partial(jax_msa.write_kv, impl="kernel"), donate_argnums=0)
    pointer = cache.unsafe_buffer_pointer()
    got = fn(cache, k, v, slots)
    assert cache.is_deleted(), "the donated cache buffer should have been consumed"
    assert got.unsafe_buffer_pointer() == pointer, "write_kv under donation should update the cache in place"
    first = got.copy()
    # The donated result feeds the next step (the serving loop): still correct, still in place.
    _, k2, v2, slots2 = _write_kv_inputs(403, pages=4, hkv=1, d=64, n=12)
    want2 = reference.write_kv(first, k2, v2, slots2)
    got2 = fn(got, k2, v2, slots2)
    assert got.is_deleted()
    assert got2.unsafe_buffer_pointer() == pointer
    np.testing.assert_array_equal(bits(first), bits(want))
    np.testing.assert_array_equal(bits(got2), bits(want2))


@pytest.mark.parametrize("d", [8, 72, 100])
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_write_kv_any_head_dim(fmt, d):
    """The CPU handler takes any head_dim for bf16 and FP8 caches (NVFP4: a multiple of 16), as the reference does
    and as README's shape table says; only the CUDA kernel needs head_dim % 16 == 0 (ops.py sends it nothing else)."""
    cache, k, v, slots = _write_kv_inputs(404 + d, pages=3, hkv=2, d=d, n=12)
    scales = {}
    if fmt == "fp8":
        cache = cache.astype(jnp.float8_e4m3fn)
        scales = dict(k_scale=jnp.float32(0.5), v_scale=jnp.float32(3.0))
    got = jax.jit(functools.partial(jax_msa.write_kv, impl="kernel", **scales))(cache, k, v, slots)
    want = jax.jit(functools.partial(reference.write_kv, **scales))(cache, k, v, slots)
    assert not np.array_equal(bits(want), bits(cache)), "some slot must be written"
    np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
@pytest.mark.parametrize("kernel", [False, True], ids=["reference", "kernel"])
def test_topk_order_is_irrelevant(decode, kernel):
    """MSA.md: a top-k row is a set; its order does not matter. Each row permuted: bit-identical out and lse."""
    problem = (make_decode_problem(**DECODE_CASES["q4_gqa8_k32_dups_negative_pos"]) if decode
               else make_problem(**PREFILL_CASES["gqa8_k16_chunked_bad_pages_padding"]))
    rng = np.random.default_rng(11)
    topk = np.asarray(problem.topk)
    shuffled = np.take_along_axis(topk, rng.permuted(np.broadcast_to(np.arange(topk.shape[-1]), topk.shape), axis=-1),
                                  axis=-1)
    assert not np.array_equal(shuffled, topk)
    permuted = dataclasses.replace(problem, topk=jnp.asarray(shuffled))
    a = _run(problem, kernel=kernel)
    b = _run(permuted, kernel=kernel)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(bits(x), bits(y))
