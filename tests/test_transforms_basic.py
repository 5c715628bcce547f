"""JAX transformations of the public ops: jit without retrace, forward-only gradients, impl switching on CPU,
and which custom calls the CPU and CUDA lowerings contain."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_msa
from jax_msa import _ffi
from hlo_text import entry_computation, scalar_parameters, users_of
from problems import PAGE, cache_maker, make_decode_problem, make_problem

TARGETS = (_ffi.TARGET_PREFILL, _ffi.TARGET_DECODE, _ffi.TARGET_WRITE_KV)

# Shapes every kernel build accepts (M3 per-GPU shapes: GQA 16, D 128, top-16, decode q_len 1).
M3_SHAPES = dict(num_q_heads=16, num_kv_heads=1, head_dim=128, topk=16)


def _prefill_pair():
    """Two batches with identical shapes and different values (q_lens, seq_lens, ids, data)."""
    a = make_problem(501, q_lens=[10, 20], seq_lens=[200, 300], **M3_SHAPES)
    b = make_problem(502, q_lens=[25, 5], seq_lens=[250, 290], **M3_SHAPES)
    assert all(x.shape == y.shape for x, y in zip(_prefill_args(a), _prefill_args(b)))
    return a, b


def _prefill_args(p):
    return p.q, p.kv_cache, p.topk, p.cu_seqlens_q, p.seq_lens, p.block_table


def _decode_args(p):
    return p.q, p.kv_cache, p.topk, p.seq_lens, p.block_table


def _attention(q, kv_cache, topk, cu, sl, bt, *, impl="auto", return_lse=True):
    return jax_msa.sparse_attention(q, kv_cache, topk, cu_seqlens_q=cu, seq_lens=sl, block_table=bt,
                                    return_lse=return_lse, impl=impl)


def _decode(q, kv_cache, topk, sl, bt, *, impl="auto", return_lse=True, decode_query_len=1):
    return jax_msa.sparse_decode(q, kv_cache, topk, seq_lens=sl, block_table=bt, return_lse=return_lse,
                                 impl=impl, decode_query_len=decode_query_len)


def _write_kv_args(seed, pages=3, hkv=1, d=128, n=10):
    rng = np.random.default_rng(seed)
    cache = jnp.asarray(rng.standard_normal((pages, hkv, PAGE, 2 * d)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((n, hkv, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((n, hkv, d)), jnp.bfloat16)
    slots = jnp.asarray(rng.permutation(pages * PAGE + 4)[:n] - 2, jnp.int32)  # a few beyond / negative
    return cache, k, v, slots


def _assert_close_to_one_bf16_ulp(got, want):
    """got, want bf16: equal up to one bf16 ulp (two fp32 computations rounded to bf16)."""
    got = np.asarray(got.astype(jnp.float32), np.float64)
    want = np.asarray(want.astype(jnp.float32), np.float64)
    assert (np.abs(got - want) <= 2.0**-7 * np.abs(want) + 1e-6).all()


# ---------------------------------------------------------------------------------------------------------
# jit: values change, shapes do not -> one trace
# ---------------------------------------------------------------------------------------------------------

def test_jit_prefill_traces_once_for_new_values():
    traces = []

    @jax.jit
    def step(*args):
        traces.append(1)
        return _attention(*args, impl="kernel")

    reference_step = jax.jit(functools.partial(_attention, impl="reference"))
    a, b = _prefill_pair()
    for p in (a, b):
        out, lse = step(*_prefill_args(p))
        want_out, want_lse = reference_step(*_prefill_args(p))
        _assert_close_to_one_bf16_ulp(out, want_out)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=0, atol=1e-5)
    assert len(traces) == 1


def test_jit_decode_traces_once_for_new_values():
    traces = []

    @jax.jit
    def step(*args):
        traces.append(1)
        return _decode(*args, impl="kernel")

    reference_step = jax.jit(functools.partial(_decode, impl="reference"))
    for seed, seq_lens in ((511, [129, 300, 5]), (512, [200, 380, 1])):
        p = make_decode_problem(seed, seq_lens=seq_lens, **M3_SHAPES)
        out, _ = step(*_decode_args(p))
        want, _ = reference_step(*_decode_args(p))
        _assert_close_to_one_bf16_ulp(out, want)
    assert len(traces) == 1


def test_jit_write_kv_traces_once_for_new_values():
    traces = []

    @jax.jit
    def step(*args):
        traces.append(1)
        return jax_msa.write_kv(*args, impl="kernel")

    for seed in (521, 522):
        args = _write_kv_args(seed)
        got = step(*args)
        want = jax_msa.reference.write_kv(*args)
        np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))
    assert len(traces) == 1


# ---------------------------------------------------------------------------------------------------------
# Forward-only: differentiation raises a clear TypeError
# ---------------------------------------------------------------------------------------------------------

FORWARD_ONLY = r"is a forward-only primitive .* it has no gradient"


@pytest.mark.parametrize("impl", ["auto", "kernel"])
def test_grad_through_sparse_attention_raises(impl):
    p = make_problem(531, q_lens=[4], seq_lens=[140], num_q_heads=2, num_kv_heads=1, topk=4)
    q, *rest = _prefill_args(p)

    def loss(q):
        return _attention(q, *rest, impl=impl, return_lse=False).astype(jnp.float32).sum()

    with pytest.raises(TypeError, match=r"jax_msa.sparse_attention " + FORWARD_ONLY):
        jax.grad(loss)(q)
    with pytest.raises(TypeError, match=r"jax_msa.sparse_attention " + FORWARD_ONLY):
        jax.jit(jax.grad(loss))(q)


@pytest.mark.parametrize("impl", ["auto", "kernel"])
def test_grad_through_sparse_decode_raises(impl):
    p = make_decode_problem(532, seq_lens=[140, 3], num_q_heads=2, num_kv_heads=1, topk=4)
    q, *rest = _decode_args(p)

    def loss(q):
        return _decode(q, *rest, impl=impl, return_lse=False).astype(jnp.float32).sum()

    with pytest.raises(TypeError, match=r"jax_msa.sparse_decode " + FORWARD_ONLY):
        jax.grad(loss)(q)
    with pytest.raises(TypeError, match=r"jax_msa.sparse_decode " + FORWARD_ONLY):
        jax.jvp(loss, (q,), (jnp.ones_like(q),))


@pytest.mark.parametrize("impl", ["auto", "kernel"])
def test_grad_through_write_kv_raises(impl):
    cache, k, v, slots = _write_kv_args(533)

    def loss(k):
        return jax_msa.write_kv(cache, k, v, slots, impl=impl).astype(jnp.float32).sum()

    with pytest.raises(TypeError, match=r"jax_msa.write_kv " + FORWARD_ONLY):
        jax.grad(loss)(k.astype(jnp.float32))


# ---------------------------------------------------------------------------------------------------------
# impl="reference" and impl="kernel" agree on CPU
# ---------------------------------------------------------------------------------------------------------

def test_reference_and_kernel_impls_agree_on_cpu():
    p = make_problem(541, q_lens=[7, 0, 19], seq_lens=[300, 40, 19], pad_tokens=2, num_q_heads=8,
                     num_kv_heads=2, topk=8)
    kern = jax.jit(functools.partial(_attention, impl="kernel"))(*_prefill_args(p))
    ref = jax.jit(functools.partial(_attention, impl="reference"))(*_prefill_args(p))
    _assert_close_to_one_bf16_ulp(kern[0], ref[0])
    np.testing.assert_allclose(np.asarray(kern[1]), np.asarray(ref[1]), rtol=0, atol=1e-5)  # -inf == -inf

    d = make_decode_problem(542, seq_lens=[129, 1023, 2], decode_query_len=3, num_q_heads=8, num_kv_heads=2,
                            topk=8)
    dec = functools.partial(_decode, decode_query_len=3)
    kern = jax.jit(functools.partial(dec, impl="kernel"))(*_decode_args(d))
    ref = jax.jit(functools.partial(dec, impl="reference"))(*_decode_args(d))
    _assert_close_to_one_bf16_ulp(kern[0], ref[0])
    np.testing.assert_allclose(np.asarray(kern[1]), np.asarray(ref[1]), rtol=0, atol=1e-5)

    args = _write_kv_args(543)
    kern = jax_msa.write_kv(*args, impl="kernel")
    ref = jax_msa.write_kv(*args, impl="reference")
    np.testing.assert_array_equal(np.asarray(kern).view(np.uint16), np.asarray(ref).view(np.uint16))


# ---------------------------------------------------------------------------------------------------------
# Lowering: which custom calls appear per platform
# ---------------------------------------------------------------------------------------------------------

def _jax_msa_calls(fn, args, platform):
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    return set(re.findall(r"custom_call\s*@(jax_msa_\w+)", text))


def _op_and_args(target):
    if target == _ffi.TARGET_PREFILL:
        p = make_problem(551, q_lens=[6, 3], seq_lens=[200, 3], **M3_SHAPES)
        return _attention, _prefill_args(p)
    if target == _ffi.TARGET_DECODE:
        p = make_decode_problem(552, seq_lens=[200, 3], **M3_SHAPES)
        return _decode, _decode_args(p)
    return jax_msa.write_kv, _write_kv_args(553)


@pytest.mark.parametrize("target", TARGETS)
def test_cuda_lowering_has_the_custom_call_iff_built(target):
    """With the CUDA handler built the CUDA lowering calls it; without, the jnp reference is lowered."""
    fn, args = _op_and_args(target)
    want = {target} if target in _ffi.cuda_targets() else set()
    assert _jax_msa_calls(fn, args, "cuda") == want


@pytest.mark.parametrize("target", TARGETS)
def test_cpu_lowering_has_the_custom_call(target):
    fn, args = _op_and_args(target)
    assert _jax_msa_calls(fn, args, "cpu") == {target}


def test_cpu_lowering_of_a_layer_step_has_all_three_custom_calls():
    p = make_problem(561, q_lens=[6, 3], seq_lens=[200, 3], **M3_SHAPES)
    d = make_decode_problem(562, seq_lens=[200, 3], **M3_SHAPES)
    k = jnp.zeros((2, 1, 128), jnp.bfloat16)
    slots = jnp.array([5, 300], jnp.int32)

    def layer_step(q, kv_cache, topk, cu, sl, bt, dq, dtopk, dsl, dbt):
        kv_cache = jax_msa.write_kv(kv_cache, k, k, slots)
        out = _attention(q, kv_cache, topk, cu, sl, bt, return_lse=False)
        dec = _decode(dq, kv_cache, dtopk, dsl, dbt, return_lse=False)
        return out, dec

    args = (*_prefill_args(p), d.q, d.topk, d.seq_lens, d.block_table)
    assert _jax_msa_calls(layer_step, args, "cpu") == set(TARGETS)


def _fp8_op_with_scales(target):
    """(fn(*arrays, k_scale, v_scale), arrays): the op on an FP8 cache, its scales traced arguments."""
    if target == _ffi.TARGET_WRITE_KV:
        cache, k, v, slots = _write_kv_args(571)
        cache = jax_msa.allocate_cache(jax_msa.KVFormat.FP8, cache.shape[0], cache.shape[1], k.shape[-1])
        return (lambda c, k, v, s, ks, vs: jax_msa.write_kv(c, k, v, s, k_scale=ks, v_scale=vs)), (cache, k, v, slots)
    fp8 = cache_maker(jax_msa.KVFormat.FP8, 0.5, 0.25)
    if target == _ffi.TARGET_PREFILL:
        p = make_problem(572, q_lens=[6, 3], seq_lens=[200, 3], cache_from_kv=fp8, **M3_SHAPES)
        return (lambda q, c, t, cu, sl, bt, ks, vs: jax_msa.sparse_attention(
            q, c, t, cu_seqlens_q=cu, seq_lens=sl, block_table=bt, k_scale=ks, v_scale=vs)), _prefill_args(p)
    p = make_decode_problem(573, seq_lens=[200, 3], cache_from_kv=fp8, **M3_SHAPES)
    return (lambda q, c, t, sl, bt, ks, vs: jax_msa.sparse_decode(
        q, c, t, seq_lens=sl, block_table=bt, k_scale=ks, v_scale=vs)), _decode_args(p)


@pytest.mark.parametrize("target", TARGETS)
def test_traced_scales_are_operands_of_the_custom_call(target):
    """A layer's scales passed as traced fp32 scalars (a model's parameters) are the custom call's operands as they
    are: no XLA kernel stacks them first (one a call before the scales became three operands). Checked in the CPU
    program compiled by XLA; the CUDA lowering passes the same operand list (bindings.h)."""
    fn, arrays = _fp8_op_with_scales(target)
    scales = (jnp.float32(0.5), jnp.float32(0.25))
    entry = entry_computation(jax.jit(fn).lower(*arrays, *scales).compile().as_text())
    params = scalar_parameters(entry)
    assert sorted(i for _, i in params) == [len(arrays), len(arrays) + 1]
    for name, _ in params:  # each scale's one user: the custom call, which takes it as an operand
        users = users_of(entry, name)
        assert len(users) == 1 and f'custom_call_target="{target}"' in users[0], (name, users)


@pytest.mark.parametrize("case", ["mismatched_entries", "entries_not_dividing_tokens", "matrix",
                                  "entries_not_dividing_requests", "prefill_vector"])
def test_scales_of_a_bad_shape_are_refused_by_the_handler(case):
    """The handlers check the scale operands (bindings.h): decode and write_kv take scalars or [L] vectors (jax.vmap's
    fold of per-layer scales), the same L for all, dividing the requests / tokens; the prefill takes scalars. The
    public ops refuse a non-scalar scale at trace time already, so the custom call is reached here directly."""
    one = jnp.ones((), jnp.float32)
    fp8 = int(jax_msa.KVFormat.FP8)
    if case in ("entries_not_dividing_requests", "prefill_vector"):
        cache_fn = cache_maker(jax_msa.KVFormat.FP8, 0.5, 0.25)
        if case == "prefill_vector":
            p = make_problem(575, q_lens=[6, 3], seq_lens=[200, 3], cache_from_kv=cache_fn, **M3_SHAPES)
            plan = jax_msa.build_prefill_plan(p.topk, p.cu_seqlens_q, p.seq_lens, max_blocks=p.block_table.shape[1])
            two = jnp.ones((2,), jnp.float32)
            with pytest.raises(Exception, match="k_scale must be an fp32 scalar"):
                jax.block_until_ready(_ffi.prefill_call(p.q, p.kv_cache, _ffi.Scales(one, two, one), p.cu_seqlens_q,
                                                        p.seq_lens, p.block_table, plan, softmax_scale=0.1,
                                                        kv_format=fp8))
            return
        p = make_decode_problem(576, seq_lens=[200, 3], cache_from_kv=cache_fn, **M3_SHAPES)  # 2 requests
        three = jnp.ones((3,), jnp.float32)
        with pytest.raises(Exception, match="must divide the number of requests"):
            jax.block_until_ready(_ffi.decode_call(p.q, p.kv_cache, _ffi.Scales(three, three, three), p.topk,
                                                   p.seq_lens, p.block_table, softmax_scale=0.1, kv_format=fp8,
                                                   decode_query_len=1, workspace=_ffi.DecodeWorkspace(1)))
        return
    cache, k, v, slots = _write_kv_args(574)  # 10 tokens
    cache = jax_msa.allocate_cache(jax_msa.KVFormat.FP8, cache.shape[0], cache.shape[1], k.shape[-1])
    scales, message = {
        "mismatched_entries": ((jnp.ones((2,), jnp.float32), one), "the same number of entries"),
        "entries_not_dividing_tokens": ((jnp.ones((3,), jnp.float32),) * 2, "must divide the number of tokens"),
        "matrix": ((jnp.ones((5, 2), jnp.float32),) * 2, "k_scale must be an fp32 scalar or vector"),
    }[case]
    with pytest.raises(Exception, match=message):
        jax.block_until_ready(_ffi.write_kv_call(cache, k, v, slots, _ffi.Scales(one, *scales), kv_format=fp8))
