"""jax.export of the ops for ("cpu", "cuda"), and a decode loop with the KV cache donated: the cache is
aliased input -> output and never copied in the optimized HLO."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import jax_msa
from jax_msa import _ffi
from bitwise import assert_bitwise_equal, bits
from hlo_text import copies_of
from problems import PAGE, make_decode_problem

SHAPES = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, topk=4)
STEPS = 4
START_LENS = [250, 60, 1]  # each request decodes STEPS tokens inside its allocated blocks
# The jax_msa custom calls are not in jax.export's list of stable custom calls: exporting them is an
# explicit opt-in (the serialized module then needs a jax_msa build with the same FFI signatures to run).
DISABLED_CHECKS = [export.DisabledSafetyCheck.custom_call(t)
                   for t in (_ffi.TARGET_PREFILL, _ffi.TARGET_DECODE, _ffi.TARGET_WRITE_KV)]


@functools.cache
def _decode_loop_inputs(seed=8000):
    """A cache with requests of START_LENS tokens, and STEPS decode steps of new tokens for each."""
    p = make_decode_problem(seed, seq_lens=[s + STEPS for s in START_LENS], **SHAPES)
    rng = np.random.default_rng(seed + 1)
    batch, hkv, d = len(START_LENS), SHAPES["num_kv_heads"], SHAPES["head_dim"]
    new_k = jnp.asarray(rng.standard_normal((STEPS, batch, hkv, d)), jnp.bfloat16)
    new_v = jnp.asarray(rng.standard_normal((STEPS, batch, hkv, d)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((STEPS, batch, SHAPES["num_q_heads"], d)), jnp.bfloat16)
    topk = jnp.stack([jnp.roll(p.topk, i, axis=-1) for i in range(STEPS)])  # [STEPS, Hkv, B, K]
    pos = np.asarray(START_LENS)[None, :] + np.arange(STEPS)[:, None]  # [STEPS, B]
    bt = np.asarray(p.block_table)
    slots = jnp.asarray(bt[np.arange(batch)[None, :], pos // PAGE] * PAGE + pos % PAGE, jnp.int32)
    return p.kv_cache, new_k, new_v, slots, q, topk, jnp.asarray(START_LENS, jnp.int32), p.block_table


def _step(cache, k, v, slots, q, topk, seq_lens, block_table, *, impl="kernel"):
    """One decode step of one layer: write the new token, then attend with it."""
    cache = jax_msa.write_kv(cache, k, v, slots, impl=impl)
    out, lse = jax_msa.sparse_decode(q, cache, topk, seq_lens=seq_lens, block_table=block_table,
                                     return_lse=True, impl=impl)
    return cache, out, lse


def _decode_loop(cache, new_k, new_v, slots, q, topk, start_lens, block_table, *, impl="kernel"):
    def body(i, carry):
        cache, outs = carry
        cache, out, _ = _step(cache, new_k[i], new_v[i], slots[i], q[i], topk[i], start_lens + i + 1,
                              block_table, impl=impl)
        return cache, outs.at[i].set(out)

    return jax.lax.fori_loop(0, STEPS, body, (cache, jnp.zeros(q.shape, jnp.bfloat16)))


def _python_loop(cache, new_k, new_v, slots, q, topk, start_lens, block_table, *, impl):
    step = jax.jit(functools.partial(_step, impl=impl))
    outs = []
    for i in range(STEPS):
        cache, out, _ = step(cache, new_k[i], new_v[i], slots[i], q[i], topk[i], start_lens + i + 1, block_table)
        outs.append(out)
    return cache, jnp.stack(outs)


# ---------------------------------------------------------------------------------------------------------
# jax.export
# ---------------------------------------------------------------------------------------------------------

def test_export_for_cpu_and_cuda_round_trips_and_runs_on_cpu():
    pytest.importorskip("flatbuffers", reason="jax.export serialization needs the flatbuffers package")
    cache, new_k, new_v, slots, q, topk, start_lens, bt = _decode_loop_inputs()
    args = (cache, new_k[0], new_v[0], slots[0], q[0], topk[0], start_lens + 1, bt)
    fn = jax.jit(_step)
    exported = export.export(fn, platforms=("cpu", "cuda"), disabled_checks=DISABLED_CHECKS)(*args)
    assert exported.platforms == ("cpu", "cuda")
    text = exported.mlir_module()
    assert {_ffi.TARGET_DECODE, _ffi.TARGET_WRITE_KV} <= set(re.findall(r"custom_call\s*@(jax_msa_\w+)", text))

    restored = export.deserialize(exported.serialize())
    got = restored.call(*args)
    assert_bitwise_equal(got, fn(*args))
    # The new token was written and attended: the cache changed at its slots.
    assert not np.array_equal(bits(got[0]), bits(cache))


def test_export_without_the_opt_in_names_the_custom_call():
    cache, new_k, new_v, slots, q, topk, start_lens, bt = _decode_loop_inputs()
    args = (cache, new_k[0], new_v[0], slots[0], q[0], topk[0], start_lens + 1, bt)
    with pytest.raises(ValueError, match=r"jax_msa_(write_kv|decode)"):
        export.export(jax.jit(_step), platforms=("cpu", "cuda"))(*args)


# ---------------------------------------------------------------------------------------------------------
# Donation
# ---------------------------------------------------------------------------------------------------------

def test_donated_decode_loop_aliases_the_cache_and_never_copies_it():
    inputs = _decode_loop_inputs()
    cache = inputs[0]
    donated = jax.jit(_decode_loop, donate_argnums=0)
    hlo = donated.lower(*inputs).compile().as_text()
    # Parameter 0 (the cache) is aliased to output {0} (the returned cache).
    assert re.search(r"input_output_alias=\{\s*\{0\}:\s*\(0,\s*\{\}", hlo), hlo[:2000]
    assert copies_of(hlo, cache) == []
    # The detector sees a copy when there is one: without donation the input cache must be copied.
    assert copies_of(jax.jit(_decode_loop).lower(*inputs).compile().as_text(), cache)

    want_kernel = _python_loop(*inputs, impl="kernel")
    want_reference = _python_loop(*inputs, impl="reference")
    arg = jnp.array(cache, copy=True)
    got = donated(arg, *inputs[1:])
    assert arg.is_deleted()
    assert_bitwise_equal(got, want_kernel)
    np.testing.assert_array_equal(bits(got[0]), bits(want_reference[0]))  # bf16 writes are exact
    g = np.asarray(got[1].astype(jnp.float32), np.float64)
    w = np.asarray(want_reference[1].astype(jnp.float32), np.float64)
    assert (np.abs(g - w) <= 2.0**-7 * np.abs(w) + 1e-6).all()  # one bf16 ulp
    assert np.abs(w).max() > 0  # the steps attended to something
