"""Trace-time argument errors of the public ops: each names the argument and what was expected.

Every call goes through jax.eval_shape, so the errors are shown to come from tracing alone (no kernel runs).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_msa

T, HQ, HKV, D, K, B, MB, PAGES = 6, 4, 2, 128, 4, 2, 3, 4


def _attention_args(**overrides):
    args = dict(
        q=jnp.zeros((T, HQ, D), jnp.bfloat16),
        kv_cache=jnp.zeros((PAGES, HKV, 128, 2 * D), jnp.bfloat16),
        topk=jnp.zeros((HKV, T, K), jnp.int32),
        cu_seqlens_q=jnp.array([0, 2, 6], jnp.int32),
        seq_lens=jnp.array([130, 260], jnp.int32),
        block_table=jnp.zeros((B, MB), jnp.int32),
    )
    args.update(overrides)
    return args


def _trace_attention(impl="auto", scales=None, **overrides):
    a = _attention_args(**overrides)
    scales = scales or {}

    def fn(q, kv_cache, topk, cu_seqlens_q, seq_lens, block_table):
        return jax_msa.sparse_attention(q, kv_cache, topk, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens,
                                        block_table=block_table, impl=impl, **scales)

    return jax.eval_shape(fn, a["q"], a["kv_cache"], a["topk"], a["cu_seqlens_q"], a["seq_lens"],
                          a["block_table"])


def _trace_decode(decode_query_len=1, impl="auto", scales=None, **overrides):
    a = dict(
        q=jnp.zeros((B * decode_query_len, HQ, D), jnp.bfloat16),
        kv_cache=jnp.zeros((PAGES, HKV, 128, 2 * D), jnp.bfloat16),
        topk=jnp.zeros((HKV, B * decode_query_len, K), jnp.int32),
        seq_lens=jnp.array([130, 260], jnp.int32),
        block_table=jnp.zeros((B, MB), jnp.int32),
    )
    a.update(overrides)
    scales = scales or {}

    def fn(q, kv_cache, topk, seq_lens, block_table):
        return jax_msa.sparse_decode(q, kv_cache, topk, seq_lens=seq_lens, block_table=block_table,
                                     decode_query_len=decode_query_len, impl=impl, **scales)

    return jax.eval_shape(fn, a["q"], a["kv_cache"], a["topk"], a["seq_lens"], a["block_table"])


def _trace_write_kv(**overrides):
    a = dict(
        kv_cache=jnp.zeros((PAGES, HKV, 128, 2 * D), jnp.bfloat16),
        k=jnp.zeros((5, HKV, D), jnp.bfloat16),
        v=jnp.zeros((5, HKV, D), jnp.bfloat16),
        slot_mapping=jnp.zeros((5,), jnp.int32),
    )
    scales = {n: overrides.pop(n) for n in ("k_scale", "v_scale") if n in overrides}
    impl = overrides.pop("impl", "auto")
    a.update(overrides)

    def fn(kv_cache, k, v, slot_mapping):
        return jax_msa.write_kv(kv_cache, k, v, slot_mapping, impl=impl, **scales)

    return jax.eval_shape(fn, a["kv_cache"], a["k"], a["v"], a["slot_mapping"])


def test_valid_arguments_trace():
    out = _trace_attention()
    assert out.shape == (T, HQ, D) and out.dtype == jnp.bfloat16
    out = _trace_decode(decode_query_len=2)
    assert out.shape == (B * 2, HQ, D)
    cache = _trace_write_kv()
    assert cache.shape == (PAGES, HKV, 128, 2 * D) and cache.dtype == jnp.bfloat16


ATTENTION_ERRORS = {
    "q_rank": (dict(q=jnp.zeros((T, HQ * D), jnp.bfloat16)), ValueError, r"q must be \[total_q, Hq, D\]"),
    "q_dtype": (dict(q=jnp.zeros((T, HQ, D), jnp.float32)), TypeError, r"q must be bfloat16"),
    "hq_not_multiple_of_hkv": (dict(q=jnp.zeros((T, 3, D), jnp.bfloat16)), ValueError,
                               r"Hq must be a multiple of Hkv: q has 3 heads, kv_cache has 2 KV heads"),
    "topk_dtype_int16": (dict(topk=jnp.zeros((HKV, T, K), jnp.int16)), TypeError, r"topk must be int32"),
    "topk_dtype_uint32": (dict(topk=jnp.zeros((HKV, T, K), jnp.uint32)), TypeError, r"topk must be int32"),
    "topk_dtype_float": (dict(topk=jnp.zeros((HKV, T, K), jnp.float32)), TypeError, r"topk must be int32"),
    "topk_rank": (dict(topk=jnp.zeros((T, K), jnp.int32)), ValueError, r"topk must be \[Hkv, total_q, K\]"),
    "topk_tokens": (dict(topk=jnp.zeros((HKV, T + 1, K), jnp.int32)), ValueError,
                    r"topk must be \[Hkv, total_q, K\] = \[2, 6, K\]"),
    "topk_heads": (dict(topk=jnp.zeros((HKV + 1, T, K), jnp.int32)), ValueError,
                   r"topk must be \[Hkv, total_q, K\] = \[2, 6, K\]"),
    "page_size": (dict(kv_cache=jnp.zeros((PAGES, HKV, 64, 2 * D), jnp.bfloat16)), ValueError,
                  r"kv_cache.shape\[2\] is the page size and must be 128"),
    "head_dim_vs_cache": (dict(q=jnp.zeros((T, HQ, 64), jnp.bfloat16)), ValueError,
                          r"kv_cache .*must be \[pages, Hkv, 128, 2\*D\] = \[.., .., 128, 128\] for head_dim 64"),
    "cache_dtype": (dict(kv_cache=jnp.zeros((PAGES, HKV, 128, 2 * D), jnp.float32)), ValueError,
                    r"kv_cache dtype must be bfloat16, float8_e4m3fn or uint8"),
    "cu_seqlens_length": (dict(cu_seqlens_q=jnp.array([0, 6], jnp.int32)), ValueError,
                          r"cu_seqlens_q must be \[B\+1\] = \[3\]"),
    "cu_seqlens_dtype": (dict(cu_seqlens_q=jnp.array([0, 2, 6], jnp.float32)), TypeError,
                         r"cu_seqlens_q must be int32"),
    "block_table_batch": (dict(block_table=jnp.zeros((B + 1, MB), jnp.int32)), ValueError,
                          r"block_table must be \[B, max_blocks\] with B = 2"),
    "block_table_rank": (dict(block_table=jnp.zeros((B * MB,), jnp.int32)), ValueError,
                         r"block_table must be \[B, max_blocks\]"),
    "seq_lens_dtype": (dict(seq_lens=jnp.array([130, 260], jnp.uint32)), TypeError, r"seq_lens must be int32"),
}


@pytest.mark.parametrize("case", ATTENTION_ERRORS)
def test_sparse_attention_argument_errors(case):
    overrides, error, message = ATTENTION_ERRORS[case]
    with pytest.raises(error, match=message):
        _trace_attention(**overrides)


def _plan_for_args():
    a = _attention_args()
    return jax_msa.build_prefill_plan(a["topk"], a["cu_seqlens_q"], a["seq_lens"], max_blocks=MB)


PLAN_ERRORS = {
    "not_a_plan": (lambda plan: dict(plan.__dict__), TypeError, r"plan must be a jax_msa.PrefillPlan; got dict"),
    "edge_query_shape": (lambda plan: dataclasses.replace(plan, edge_query=plan.edge_query[:, 1:]), ValueError,
                         r"plan.edge_query must be \[2, 24\] for these inputs; got \[2, 23\]"),
    "work_shape": (lambda plan: dataclasses.replace(plan, work=plan.work[:, :3]), ValueError,
                   r"plan.work must be \[W, 4\] \(head, row, edge_begin, edge_count\); got \[\d+, 3\]"),
    "work_dtype": (lambda plan: dataclasses.replace(plan, work=plan.work.astype(jnp.uint32)), TypeError,
                   r"plan.work must be int32; got uint32"),
    "edge_rank_dtype": (lambda plan: dataclasses.replace(plan, edge_rank=plan.edge_rank.astype(jnp.int16)),
                        TypeError, r"plan.edge_rank must be int32; got int16"),
    "max_blocks": (lambda plan: dataclasses.replace(plan, max_blocks=MB + 1), ValueError,
                   r"plan was built with max_blocks=4; block_table has 3"),
}


@pytest.mark.parametrize("case", PLAN_ERRORS)
def test_sparse_attention_plan_errors(case):
    corrupt, error, message = PLAN_ERRORS[case]
    plan = corrupt(_plan_for_args())
    a = _attention_args()

    def fn(q, kv_cache, topk, cu_seqlens_q, seq_lens, block_table):
        return jax_msa.sparse_attention(q, kv_cache, topk, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens,
                                        block_table=block_table, plan=plan)

    with pytest.raises(error, match=message):
        jax.eval_shape(fn, a["q"], a["kv_cache"], a["topk"], a["cu_seqlens_q"], a["seq_lens"], a["block_table"])


@pytest.mark.parametrize("impl", ["fast", "cuda", ""])
def test_bad_impl_string(impl):
    with pytest.raises(ValueError, match=r"impl must be one of \('auto', 'kernel', 'reference'\)"):
        _trace_attention(impl=impl)
    with pytest.raises(ValueError, match=r"impl must be one of"):
        _trace_decode(impl=impl)
    with pytest.raises(ValueError, match=r"impl must be one of"):
        _trace_write_kv(impl=impl)


def test_decode_q_not_batch_times_query_len():
    with pytest.raises(ValueError, match=r"q must be \[B \* decode_query_len, Hq, D\] = \[6, \.\.\.\] "
                                         r"\(B = 2, decode_query_len = 3\)"):
        _trace_decode(decode_query_len=3, q=jnp.zeros((4, HQ, D), jnp.bfloat16),
                      topk=jnp.zeros((HKV, 4, K), jnp.int32))


def test_decode_query_len_may_be_a_numpy_integer():
    _trace_decode(decode_query_len=np.int64(1))
    _trace_decode(decode_query_len=np.int32(2))


def test_decode_query_len_must_be_static_int():
    with pytest.raises(ValueError, match=r"decode_query_len must be a static int >= 1"):
        _trace_decode(decode_query_len=0)
    with pytest.raises(ValueError, match=r"decode_query_len must be a static int >= 1; got True"):
        _trace_decode(decode_query_len=True)


def test_decode_topk_and_table_errors():
    with pytest.raises(ValueError, match=r"topk must be \[Hkv, total_q, K\]"):
        _trace_decode(topk=jnp.zeros((HKV, 3, K), jnp.int32))
    with pytest.raises(ValueError, match=r"block_table must be \[B, max_blocks\] with B = 2"):
        _trace_decode(block_table=jnp.zeros((3, MB), jnp.int32))


@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
def test_kv_scale_on_bf16_cache(name):
    scales = {name: jnp.float32(0.5)}
    with pytest.raises(ValueError, match=r"k_scale / v_scale apply to FP8 and NVFP4 caches; this kv_cache is "
                                         r"bfloat16"):
        _trace_attention(scales=scales)
    with pytest.raises(ValueError, match=r"k_scale / v_scale apply to FP8"):
        _trace_decode(scales=scales)
    with pytest.raises(ValueError, match=r"k_scale / v_scale apply to FP8"):
        _trace_write_kv(**scales)


def test_q_scale_with_bf16_q():
    with pytest.raises(ValueError, match=r"q_scale is only meaningful for a float8_e4m3fn q"):
        _trace_attention(scales=dict(q_scale=jnp.float32(2.0)))
    with pytest.raises(ValueError, match=r"q_scale is only meaningful"):
        _trace_decode(scales=dict(q_scale=jnp.float32(2.0)))


def test_scale_must_be_scalar():
    fp8_cache = jnp.zeros((PAGES, HKV, 128, 2 * D), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"k_scale must be a scalar"):
        _trace_attention(kv_cache=fp8_cache, scales=dict(k_scale=jnp.ones((2,), jnp.float32)))


WRITE_KV_ERRORS = {
    "k_rank": (dict(k=jnp.zeros((5, HKV * D), jnp.bfloat16)), ValueError, r"k must be \[N, Hkv, D\]"),
    "v_shape": (dict(v=jnp.zeros((4, HKV, D), jnp.bfloat16)), ValueError, r"v must have k's shape \(5, 2, 128\)"),
    "k_dtype": (dict(k=jnp.zeros((5, HKV, D), jnp.int32)), TypeError, r"k must be a floating array"),
    "heads": (dict(k=jnp.zeros((5, 3, D), jnp.bfloat16), v=jnp.zeros((5, 3, D), jnp.bfloat16)), ValueError,
              r"k has 3 KV heads but kv_cache holds 2"),
    "head_dim": (dict(k=jnp.zeros((5, HKV, 64), jnp.bfloat16), v=jnp.zeros((5, HKV, 64), jnp.bfloat16)),
                 ValueError, r"kv_cache .*must be \[pages, Hkv, 128, 2\*D\]"),
    "slot_mapping_length": (dict(slot_mapping=jnp.zeros((4,), jnp.int32)), ValueError,
                            r"slot_mapping must be \[N\] = \[5\]"),
    "slot_mapping_rank": (dict(slot_mapping=jnp.zeros((5, 1), jnp.int32)), ValueError,
                          r"slot_mapping must be \[N\] \(rank 1\)"),
    "slot_mapping_dtype": (dict(slot_mapping=jnp.zeros((5,), jnp.float32)), TypeError,
                           r"slot_mapping must be int32"),
    "cache_page_size": (dict(kv_cache=jnp.zeros((PAGES, HKV, 256, 2 * D), jnp.bfloat16)), ValueError,
                        r"kv_cache.shape\[2\] is the page size"),
}


@pytest.mark.parametrize("case", WRITE_KV_ERRORS)
def test_write_kv_argument_errors(case):
    overrides, error, message = WRITE_KV_ERRORS[case]
    with pytest.raises(error, match=message):
        _trace_write_kv(**overrides)


def test_cache_without_kv_heads():
    """Hkv = 0 is an argument error, not a ZeroDivisionError from the GQA check."""
    no_heads = jnp.zeros((PAGES, 0, 128, 2 * D), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"kv_cache holds no KV head"):
        _trace_attention(kv_cache=no_heads, topk=jnp.zeros((0, T, K), jnp.int32))
    with pytest.raises(ValueError, match=r"kv_cache holds no KV head"):
        _trace_decode(kv_cache=no_heads, topk=jnp.zeros((0, B, K), jnp.int32))
    with pytest.raises(ValueError, match=r"kv_cache holds no KV head"):
        _trace_write_kv(kv_cache=no_heads, k=jnp.zeros((5, 0, D), jnp.bfloat16), v=jnp.zeros((5, 0, D), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"k head_dim must be >= 1"):
        _trace_write_kv(k=jnp.zeros((5, HKV, 0), jnp.bfloat16), v=jnp.zeros((5, HKV, 0), jnp.bfloat16))


def test_softmax_scale_must_be_static():
    """The softmax scale is compiled into the kernels: a traced one is a clear TypeError (the reference takes it)."""
    a = _attention_args()

    def decode(scale):
        return jax_msa.sparse_decode(a["q"][:B], a["kv_cache"], a["topk"][:, :B], seq_lens=a["seq_lens"],
                                     block_table=a["block_table"], scale=scale)

    def attention(scale):
        return jax_msa.sparse_attention(a["q"], a["kv_cache"], a["topk"], cu_seqlens_q=a["cu_seqlens_q"],
                                        seq_lens=a["seq_lens"], block_table=a["block_table"], scale=scale)

    for fn in (decode, attention):
        with pytest.raises(TypeError, match=r"scale must be a static Python number"):
            jax.eval_shape(fn, jnp.float32(0.1))
        concrete = jnp.float32(0.1)
        jax.eval_shape(lambda: fn(0.1))  # a Python float traces
        jax.eval_shape(lambda: fn(concrete))  # a concrete array captured from outside the trace too
        one = jnp.asarray([0.1], jnp.float32)
        jax.eval_shape(lambda: fn(one))  # shape (1,), as k_scale / v_scale / q_scale take
        with pytest.raises(ValueError, match=r"scale must be a scalar .*got shape \(2,\)"):
            jax.eval_shape(lambda: fn(jnp.asarray([0.1, 0.2], jnp.float32)))


def test_query_without_heads():
    """Hq = 0 is an argument error, not a ZeroDivisionError from the group size."""
    no_heads = jnp.zeros((T, 0, D), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"q must have at least one head"):
        _trace_attention(q=no_heads)
    with pytest.raises(ValueError, match=r"q must have at least one head"):
        _trace_decode(q=no_heads[:B])


@pytest.mark.parametrize("impl", ["reference", "kernel", "auto"])
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_write_kv_traces_for_caches_past_2gb(fmt, impl):
    """A cache of 2^31 bytes or more: the jnp twin (traced for every impl, lax.platform_dependent) indexes
    (row, position) of a 2-D or 3-D view, so no int32 index overflows; nothing is allocated (eval_shape)."""
    if fmt == "nvfp4":
        cache = jax.ShapeDtypeStruct((29128, 2 * 4, 128, 72), jnp.uint8)  # 2,147,549,184 B: just past 2^31
    else:
        cache = jax.ShapeDtypeStruct((16385, 4, 128, 256), jnp.float8_e4m3fn)  # 2,147,614,720 B
    assert cache.size >= 2**31
    k = jax.ShapeDtypeStruct((3, 4, 128), jnp.bfloat16)
    slots = jax.ShapeDtypeStruct((3,), jnp.int32)
    out = jax.eval_shape(lambda c, k, v, s: jax_msa.write_kv(c, k, v, s, impl=impl), cache, k, k, slots)
    assert out.shape == cache.shape and out.dtype == cache.dtype
