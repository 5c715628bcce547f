"""jax.vmap and jax.lax.scan over a stacked leading axis (a layer axis) of the kernel ops on CPU.

The reference for every case is a Python loop calling the same op (impl="kernel") on each slice: vmap
must be bit-identical to it. decode and write_kv fold the vmapped axis into one custom call
(jax_msa/_batching.py), per-layer scales included (folded into [L] vectors); prefill runs one call per element.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_msa
from jax_msa import KVFormat
from bitwise import assert_bitwise_equal, bits
from problems import PAGE, make_decode_problem, make_problem

# The CPU handlers: head_dim 64 (the CUDA attention kernels take 128) and bit-identity with per-layer calls. On the GPU
# (the fold keeps the unbatched call's split factor: ops.sparse_decode picks it before the fold):
# tests/test_gpu_decode.py test_decode_vmapped_over_layers_with_per_layer_scales, tests/test_gpu_write_kv.py.
pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU handler tests (default backend is not CPU)")

LAYERS = 3
SHAPES = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, topk=4)
# Same block counts per request (3, 2, 1, 1 blocks) in every layer: identical shapes, different values.
LAYER_SEQ_LENS = ([300, 129, 5, 1], [257, 256, 128, 77], [384, 200, 64, 128])


def _decode(q, kv_cache, topk, seq_lens, block_table, k_scale=None, v_scale=None, *, decode_query_len=1):
    return jax_msa.sparse_decode(q, kv_cache, topk, seq_lens=seq_lens, block_table=block_table,
                                 decode_query_len=decode_query_len, return_lse=True, impl="kernel",
                                 k_scale=k_scale, v_scale=v_scale)


def _stack(trees):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _layer_decode_problems(seed, decode_query_len=1):
    # Invalid page ids in the block tables (holes; >= P must not reach the next layer's pages when folded).
    probs = [make_decode_problem(seed + i, seq_lens=s, decode_query_len=decode_query_len, bad_page_frac=0.3,
                                 **SHAPES) for i, s in enumerate(LAYER_SEQ_LENS)]
    # Request 0's first block sits on page id P, just beyond the cache: a hole in every layer.
    args = [(p.q, p.kv_cache, p.topk, p.seq_lens, p.block_table.at[0, 0].set(p.kv_cache.shape[0]))
            for p in probs]
    assert all(a.shape == b.shape for a, b in zip(args[0], args[-1]))
    return args


def _loop(fn, stacked_args, in_axes):
    n = next(a.shape[ax] for a, ax in zip(stacked_args, in_axes) if ax is not None)
    outs = [fn(*(a if ax is None else a[i] for a, ax in zip(stacked_args, in_axes))) for i in range(n)]
    return _stack(outs)


def _custom_calls_and_loops(fn, args):
    text = jax.jit(fn).lower(*args).as_text()
    return len(re.findall(r"custom_call\s*@jax_msa_\w+", text)), "stablehlo.while" in text


# ---------------------------------------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("in_axes", [
    (0, 0, 0, 0, 0),  # everything per layer (stacked caches)
    (0, None, 0, None, None),  # per-layer q and top-k over one shared cache and batch layout
    (0, 0, 0, None, None),  # per-layer caches, shared seq_lens / block_table
], ids=["all", "shared_cache", "shared_paging"])
def test_vmap_decode_matches_loop_and_is_one_call(in_axes):
    layers = _layer_decode_problems(6100, decode_query_len=2)
    stacked = [a if ax is not None else layers[0][j] for j, (a, ax) in enumerate(zip(_stack(layers), in_axes))]
    dec = functools.partial(_decode, decode_query_len=2)
    got = jax.jit(jax.vmap(dec, in_axes=in_axes))(*stacked)
    want = _loop(jax.jit(dec), stacked, in_axes)
    assert_bitwise_equal(got, want)
    # The fold is one custom call on the whole stack, not a loop over layers.
    assert _custom_calls_and_loops(jax.vmap(dec, in_axes=in_axes), stacked) == (1, False)


def test_nested_vmap_decode_matches_loop():
    layers = _layer_decode_problems(6200)
    stacked = _stack(layers)
    # [2, 3, ...]: the same stack twice, second copy with shuffled q.
    q2 = jnp.stack([stacked[0], stacked[0][:, ::-1]])
    args = (q2, *(jnp.stack([a, a]) for a in stacked[1:]))
    got = jax.jit(jax.vmap(jax.vmap(_decode)))(*args)
    want = _stack([_loop(jax.jit(_decode), [a[i] for a in args], (0,) * 5) for i in range(2)])
    assert_bitwise_equal(got, want)


def _fp8_query_decode(q, q_scale, kv_cache, topk, seq_lens, block_table, k_scale, v_scale):
    return jax_msa.sparse_decode(q.astype(jnp.float8_e4m3fn), kv_cache, topk, seq_lens=seq_lens,
                                 block_table=block_table, return_lse=True, impl="kernel", q_scale=q_scale,
                                 k_scale=k_scale, v_scale=v_scale)


@pytest.mark.parametrize("scales", ["per_element", "inner_shared", "outer_shared"])
def test_nested_vmap_decode_with_per_layer_scales_matches_loop(scales):
    """vmap(vmap(decode)) over [2, 3] stacks of FP8 caches with an e4m3 query. The scales differ on both axes ([2, 3]:
    the inner fold makes [3] vectors, the outer [6]), only on the outer one ([2]: the inner fold keeps scalars, the
    outer makes [2] vectors read by 3 layers' requests each) or only on the inner one ([3]: the inner fold's [3]
    vectors, shared by the outer axis, are broadcast to [6]). One custom call, bit-identical to the loop over the 6
    layers."""
    rng = np.random.default_rng(6350)
    layers = _layer_decode_problems(6350)
    pages = layers[0][1].shape[0]
    q, _, topk, sl, bt = _stack(layers)
    caches = jnp.stack([_quantized_cache(KVFormat.FP8, rng, pages, 2, 64, s) for s in (0.5, 1.0, 2.0)])
    q_scales = jnp.asarray([[0.25, 0.5, 1.0], [2.0, 0.125, 4.0]], jnp.float32)
    k_scales, v_scales = 2 * q_scales[:, ::-1], q_scales + 1
    inner, outer = {"per_element": (0, 0), "inner_shared": (None, 0), "outer_shared": (0, None)}[scales]
    if scales == "inner_shared":
        q_scales, k_scales, v_scales = q_scales[:, 0], k_scales[:, 0], v_scales[:, 0]
    elif scales == "outer_shared":
        q_scales, k_scales, v_scales = q_scales[1], k_scales[1], v_scales[1]
    inner_axes = (0, inner, 0, 0, 0, 0, inner, inner)
    outer_axes = (0, outer, 0, 0, 0, 0, outer, outer)
    fn = jax.vmap(jax.vmap(_fp8_query_decode, in_axes=inner_axes), in_axes=outer_axes)
    args = (jnp.stack([q, q[:, ::-1]]), q_scales, jnp.stack([caches, caches[::-1]]),
            *(jnp.stack([a, a]) for a in (topk, sl, bt)), k_scales, v_scales)
    got = jax.jit(fn)(*args)
    want = _stack([_loop(jax.jit(_fp8_query_decode), [a if ax is None else a[i] for a, ax in zip(args, outer_axes)],
                         inner_axes) for i in range(2)])
    assert_bitwise_equal(got, want)
    assert _custom_calls_and_loops(fn, args) == (1, False)


@functools.partial(jax.jit, static_argnums=(0,))
def _fill_cache(fmt, k, v, k_scale):
    """A cache of format fmt whose every token holds k, v (quantized with k_scale, 2 * k_scale)."""
    n, hkv, d = k.shape
    cache = jax_msa.allocate_cache(fmt, n // PAGE, hkv, d)
    return jax_msa.write_kv(cache, k, v, jnp.arange(n, dtype=jnp.int32), k_scale=k_scale, v_scale=k_scale * 2,
                            impl="kernel")


def _quantized_cache(fmt, rng, pages, hkv, d, k_scale):
    k = jnp.asarray(rng.standard_normal((pages * PAGE, hkv, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((pages * PAGE, hkv, d)), jnp.bfloat16)
    return _fill_cache(fmt, k, v, jnp.float32(k_scale))


@pytest.mark.parametrize("fmt", [KVFormat.FP8, KVFormat.NVFP4])
@pytest.mark.parametrize("decode_query_len", [1, 2])
def test_vmap_decode_with_per_layer_scales_is_one_call_and_matches_loop(fmt, decode_query_len):
    rng = np.random.default_rng(6300 + int(fmt))
    layers = _layer_decode_problems(6300, decode_query_len=decode_query_len)
    pages = layers[0][1].shape[0]
    scales = jnp.asarray([0.5, 1.0, 2.0], jnp.float32)
    caches = jnp.stack([_quantized_cache(fmt, rng, pages, 2, 64, s) for s in np.asarray(scales)])
    q, _, topk, sl, bt = _stack(layers)
    dec = functools.partial(_decode, decode_query_len=decode_query_len)
    args = (q, caches, topk, sl, bt, scales, 2 * scales)
    got = jax.jit(jax.vmap(dec))(*args)
    want = _loop(jax.jit(dec), args, (0,) * 7)
    assert_bitwise_equal(got, want)
    # one call: the scales become [3] vectors, request l * B + b reading entry l (bindings.h group_scales)
    assert _custom_calls_and_loops(jax.vmap(dec), args) == (1, False)
    # per-layer K scales with one shared V scale (broadcast to the layers)
    mixed, axes = (q, caches, topk, sl, bt, scales, scales[2]), (0, 0, 0, 0, 0, 0, None)
    assert_bitwise_equal(jax.jit(jax.vmap(dec, in_axes=axes))(*mixed), _loop(jax.jit(dec), mixed, axes))
    assert _custom_calls_and_loops(jax.vmap(dec, in_axes=axes), mixed) == (1, False)
    # Shared scales over stacked quantized caches fold into one call.
    shared = (q, caches, topk, sl, bt, scales[1], scales[1])
    axes = (0, 0, 0, 0, 0, None, None)
    assert_bitwise_equal(jax.jit(jax.vmap(dec, in_axes=axes))(*shared), _loop(jax.jit(dec), shared, axes))
    assert _custom_calls_and_loops(jax.vmap(dec, in_axes=axes), shared) == (1, False)


# ---------------------------------------------------------------------------------------------------------
# write_kv
# ---------------------------------------------------------------------------------------------------------

def _write_args(seed, pages=3, hkv=2, d=64, n=40):
    rng = np.random.default_rng(seed)
    cache = jnp.asarray(rng.standard_normal((pages, hkv, PAGE, 2 * d)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((n, hkv, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((n, hkv, d)), jnp.bfloat16)
    # Distinct slots, two of them skipped: one just beyond the cache (must not land in the next layer when
    # folded) and one negative.
    slots = np.concatenate([rng.permutation(pages * PAGE)[:n - 2], [pages * PAGE + rng.integers(4), -1]])
    slots = jnp.asarray(rng.permutation(slots), jnp.int32)
    return cache, k, v, slots


def _write(cache, k, v, slots, k_scale=None, v_scale=None):
    return jax_msa.write_kv(cache, k, v, slots, k_scale=k_scale, v_scale=v_scale, impl="kernel")


@pytest.mark.parametrize("in_axes", [(0, 0, 0, 0), (None, 0, 0, 0), (0, 0, 0, None), (0, None, None, None)],
                         ids=["all", "shared_cache", "shared_slots", "only_cache"])
def test_vmap_write_kv_matches_loop_and_is_one_call(in_axes):
    stacked = _stack([_write_args(6400 + i) for i in range(LAYERS)])
    base = _write_args(6400)
    args = [s if ax is not None else b for s, b, ax in zip(stacked, base, in_axes)]
    got = jax.jit(jax.vmap(_write, in_axes=in_axes))(*args)
    want = _loop(jax.jit(_write), args, in_axes)
    assert_bitwise_equal(got, want)
    assert _custom_calls_and_loops(jax.vmap(_write, in_axes=in_axes), args) == (1, False)


@pytest.mark.parametrize("fmt", list(KVFormat), ids=lambda f: f.name)
def test_vmap_write_kv_updates_a_donated_stack_in_place(fmt):
    """A stacked cache [L, P, ...] donated to jit(vmap(write_kv)) is updated in place: no copy of it in the compiled
    program, the output in the input's buffer, also when nested vmaps fold twice. (The fold once reshaped the cache
    to [L*P, ...]; XLA then copied the whole stack on every call, ahead of the aliased custom call.)"""
    rng = np.random.default_rng(6450)
    bf16_caches, k, v, slots = _stack([_write_args(6450 + i) for i in range(2 * LAYERS)])
    caches = bf16_caches if fmt == KVFormat.BF16 else jnp.stack(
        [_quantized_cache(fmt, rng, 3, 2, 64, 1.0) for _ in range(2 * LAYERS)])
    for fn, args in ((jax.vmap(_write), (caches, k, v, slots)),
                     (jax.vmap(jax.vmap(_write)), tuple(x.reshape(2, LAYERS, *x.shape[1:])
                                                         for x in (caches, k, v, slots)))):
        want = jax.jit(fn)(*args)
        compiled = jax.jit(fn, donate_argnums=0).lower(*args).compile()
        copies = [line for line in compiled.as_text().splitlines()
                  if re.search(r"\bcopy(-start)?\(", line) and re.search(r"\b(u8|bf16|f8e4m3fn)\[", line)]
        assert not copies, copies
        stack = args[0].copy()
        pointer = stack.unsafe_buffer_pointer()
        got = compiled(stack, *args[1:])
        assert stack.is_deleted() and got.unsafe_buffer_pointer() == pointer
        assert_bitwise_equal(got, want)


def test_vmap_write_kv_nvfp4_with_shared_and_per_layer_scales():
    rng = np.random.default_rng(6500)
    caches = jnp.stack([_quantized_cache(KVFormat.NVFP4, rng, 3, 2, 64, 1.0) for _ in range(LAYERS)])
    _, k, v, slots = _stack([_write_args(6500 + i) for i in range(LAYERS)])
    scales = jnp.asarray([0.25, 1.0, 3.0], jnp.float32)
    for args, axes in (((caches, k, v, slots, scales, scales), (0,) * 6),
                       ((caches, k, v, slots, scales[2], scales[0]), (0, 0, 0, 0, None, None)),
                       ((caches, k, v, slots, scales[::-1], scales[1]), (0, 0, 0, 0, 0, None))):
        got = jax.jit(jax.vmap(_write, in_axes=axes))(*args)
        assert_bitwise_equal(got, _loop(jax.jit(_write), args, axes))
        # one call, per-layer scales too (token l * N + n reads entry l: bindings.h group_scales)
        assert _custom_calls_and_loops(jax.vmap(_write, in_axes=axes), args) == (1, False)


def test_nested_vmap_write_kv_fp8_with_per_layer_scales():
    """vmap(vmap(write_kv)) over [2, 3] FP8 caches, scales per element on both axes, shared on the inner one or
    shared on the outer one (the inner fold's [3] vectors broadcast to [6])."""
    rng = np.random.default_rng(6550)
    caches = jnp.stack([_quantized_cache(KVFormat.FP8, rng, 3, 2, 64, 1.0) for _ in range(2 * LAYERS)])
    _, k, v, slots = _stack([_write_args(6550 + i) for i in range(2 * LAYERS)])
    args = [x.reshape(2, LAYERS, *x.shape[1:]) for x in (caches, k, v, slots)]
    ks = jnp.asarray([[0.25, 1.0, 3.0], [0.5, 2.0, 0.125]], jnp.float32)
    # (scales, inner axis, outer axis): per element on both axes, shared on the inner, shared on the outer
    for scales, inner, outer in (((ks, ks[:, ::-1]), 0, 0), ((ks[:, 0], ks[:, 2]), None, 0), ((ks[1], ks[0]), 0, None)):
        inner_axes, outer_axes = (0, 0, 0, 0, inner, inner), (0, 0, 0, 0, outer, outer)
        fn = jax.vmap(jax.vmap(_write, in_axes=inner_axes), in_axes=outer_axes)
        all_args = (*args, *scales)
        want = _stack([_loop(jax.jit(_write), [a if ax is None else a[i] for a, ax in zip(all_args, outer_axes)],
                             inner_axes) for i in range(2)])
        assert_bitwise_equal(jax.jit(fn)(*all_args), want)
        assert _custom_calls_and_loops(fn, all_args) == (1, False)


# ---------------------------------------------------------------------------------------------------------
# prefill (sequential) and a layer stack under scan
# ---------------------------------------------------------------------------------------------------------

def test_vmap_sparse_attention_matches_loop():
    probs = [make_problem(6600 + i, q_lens=[5, 9], seq_lens=[260 - 3 * i, 140 + i], **SHAPES) for i in range(2)]
    args = _stack([(p.q, p.kv_cache, p.topk, p.cu_seqlens_q, p.seq_lens, p.block_table) for p in probs])

    def attention(q, kv_cache, topk, cu, sl, bt):
        return jax_msa.sparse_attention(q, kv_cache, topk, cu_seqlens_q=cu, seq_lens=sl, block_table=bt,
                                        return_lse=True, impl="kernel")

    assert_bitwise_equal(jax.jit(jax.vmap(attention))(*args), _loop(jax.jit(attention), args, (0,) * 6))


def test_scan_and_vmap_over_layers_match_a_python_loop():
    """A decode step per layer: write the new token's K/V into the layer's cache, then attend."""
    layers = _layer_decode_problems(6700)
    q, caches, topk, sl, bt = _stack(layers)
    rng = np.random.default_rng(6701)
    batch = sl.shape[1]
    new_k = jnp.asarray(rng.standard_normal((LAYERS, batch, 2, 64)), jnp.bfloat16)
    new_v = jnp.asarray(rng.standard_normal((LAYERS, batch, 2, 64)), jnp.bfloat16)
    # Each request's last token (position seq_len - 1) goes to its page and offset.
    last = sl - 1
    slots = jnp.take_along_axis(bt, (last // PAGE)[..., None], axis=-1)[..., 0] * PAGE + last % PAGE

    def layer(q, cache, topk, sl, bt, k, v, slots):
        cache = _write(cache, k, v, slots)
        return cache, _decode(q, cache, topk, sl, bt)

    xs = (q, caches, topk, sl, bt, new_k, new_v, slots)
    want = _loop(jax.jit(layer), xs, (0,) * 8)

    def scanned(xs):
        return jax.lax.scan(lambda c, x: (c, layer(*x)), 0, xs)[1]

    assert_bitwise_equal(jax.jit(scanned)(xs), want)
    assert_bitwise_equal(jax.jit(jax.vmap(layer))(*xs), want)
    # The new tokens are really in the returned caches (and read by decode): rows differ from the input.
    assert not np.array_equal(bits(want[0]), bits(caches))
