"""Multi-device cases of jax_msa.sharding on 8 fake CPU devices.

Not collected by the main pytest run (the name does not start with test_): tests/test_sharding.py runs
this file in a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=8, which must be set
before jax is imported. Each case compares the sharded op with the unsharded op on the equivalent global
inputs (data shard i's local page p is global page i*P_local + p) and checks that the compiled HLO has no
collective.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

import jax_msa
from jax_msa import KVFormat
from jax_msa.sharding import ServingSpecs, sharded_sparse_attention, sharded_sparse_decode, sharded_write_kv
from bitwise import assert_bitwise_equal
from problems import PAGE, make_decode_problem, make_problem

MESHES = {"mesh1x8": (1, 8), "mesh2x4": (2, 4), "mesh4x2": (4, 2)}
SHAPES = dict(num_q_heads=16, num_kv_heads=8, head_dim=64, topk=4)
HKV, HEAD_DIM = 8, 64
COLLECTIVES = re.compile(r"all-reduce|all-gather|collective-permute|all-to-all|reduce-scatter")
SPECS = ServingSpecs("data", "model")


@pytest.fixture(autouse=True, scope="module")
def _eight_devices():
    assert jax.device_count() == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"


def _mesh(name):
    return jax.make_mesh(MESHES[name], ("data", "model"))


def _put(mesh, x, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def _assert_no_collectives(fn, *args):
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    assert not COLLECTIVES.findall(hlo), sorted(set(COLLECTIVES.findall(hlo)))
    assert "jax_msa_" in hlo  # the custom calls ran in the shards


def _global_ids(local_ids, per_shard: int):
    """[d, ...] local page ids / slots of each data shard -> ids into the concatenated global cache."""
    shard = np.arange(local_ids.shape[0]).reshape((-1,) + (1,) * (local_ids.ndim - 1))
    ok = (local_ids >= 0) & (local_ids < per_shard)
    return jnp.asarray(np.where(ok, local_ids + shard * per_shard, -1).astype(np.int32))


@functools.partial(jax.jit, static_argnums=(0, 2))
def _fill_cache(fmt, k, pages):
    """A cache of format fmt holding k (as K) and 2k (as V) in every token of its pages."""
    scales = dict(k_scale=0.5, v_scale=2.0) if fmt != KVFormat.BF16 else {}
    return jax_msa.write_kv(jax_msa.allocate_cache(fmt, pages, HKV, HEAD_DIM), k, 2 * k,
                            jnp.arange(pages * PAGE, dtype=jnp.int32), impl="kernel", **scales)


def _quantized_cache(fmt, seed, pages):
    rng = np.random.default_rng(seed)
    k = jnp.asarray(rng.standard_normal((pages * PAGE, HKV, HEAD_DIM)), jnp.bfloat16)
    return _fill_cache(fmt, k, pages)


def _decode_shards(seed, d, fmt):
    """d per-shard decode problems with equal shapes (2 requests each), as (local stacked, global) arrays."""
    seq_lens = ([300, 77], [1, 257], [383, 128], [100, 300])  # 4 pages, <= 3 per request
    probs = [make_decode_problem(seed + i, seq_lens=seq_lens[i], decode_query_len=2, **SHAPES) for i in range(d)]
    caches = [p.kv_cache if fmt == KVFormat.BF16 else _quantized_cache(fmt, seed + 50 + i, p.kv_cache.shape[0])
              for i, p in enumerate(probs)]
    pages = caches[0].shape[0]
    bt = np.stack([np.asarray(p.block_table) for p in probs])
    return dict(q=jnp.concatenate([p.q for p in probs]), kv_cache=jnp.concatenate(caches),
                topk=jnp.concatenate([p.topk for p in probs], axis=1),
                seq_lens=jnp.concatenate([p.seq_lens for p in probs]),
                block_table=jnp.asarray(bt.reshape(-1, bt.shape[-1])),
                global_block_table=_global_ids(bt, pages).reshape(-1, bt.shape[-1]))


@pytest.mark.parametrize("fmt", [KVFormat.BF16, KVFormat.NVFP4])
@pytest.mark.parametrize("mesh_name", MESHES)
def test_sharded_decode_equals_unsharded(mesh_name, fmt):
    mesh = _mesh(mesh_name)
    x = _decode_shards(7000 + int(fmt), mesh.shape["data"], fmt)
    scales = dict(k_scale=0.5, v_scale=2.0) if fmt == KVFormat.NVFP4 else {}
    want = jax.jit(lambda q, c, t, sl, bt: jax_msa.sparse_decode(
        q, c, t, seq_lens=sl, block_table=bt, decode_query_len=2, return_lse=True, impl="kernel", **scales))(
        x["q"], x["kv_cache"], x["topk"], x["seq_lens"], x["global_block_table"])

    decode = sharded_sparse_decode(mesh, decode_query_len=2, return_lse=True, impl="kernel")
    args = (_put(mesh, x["q"], SPECS.q), _put(mesh, x["kv_cache"], SPECS.kv_cache),
            _put(mesh, x["topk"], SPECS.topk), _put(mesh, x["seq_lens"], SPECS.per_request),
            _put(mesh, x["block_table"], SPECS.block_table))
    step = jax.jit(lambda *a: decode(*a, **scales))
    got = step(*args)
    assert got[0].sharding.is_equivalent_to(NamedSharding(mesh, SPECS.q), 3)
    assert_bitwise_equal(got, want)
    _assert_no_collectives(lambda *a: decode(*a, **scales), *args)


@pytest.mark.parametrize("fmt", [KVFormat.BF16, KVFormat.NVFP4])
@pytest.mark.parametrize("mesh_name", MESHES)
def test_sharded_write_kv_equals_unsharded(mesh_name, fmt):
    mesh = _mesh(mesh_name)
    d = mesh.shape["data"]
    rng = np.random.default_rng(7100 + int(fmt))
    pages, n = 3, 24  # per data shard
    cache = jnp.concatenate([_quantized_cache(fmt, 7150 + i, pages) for i in range(d)])
    k = jnp.asarray(rng.standard_normal((d * n, HKV, HEAD_DIM)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((d * n, HKV, HEAD_DIM)), jnp.bfloat16)
    # Distinct local slots per shard, two skipped: just beyond the shard's pages, and negative.
    local = np.stack([rng.permutation(np.concatenate([rng.permutation(pages * PAGE)[:n - 2], [pages * PAGE, -1]]))
                      for _ in range(d)])
    scales = dict(k_scale=0.5, v_scale=2.0) if fmt != KVFormat.BF16 else {}
    want = jax_msa.write_kv(cache, k, v, _global_ids(local, pages * PAGE).reshape(-1), impl="kernel", **scales)

    write = sharded_write_kv(mesh, impl="kernel")
    args = (_put(mesh, cache, SPECS.kv_cache), _put(mesh, k, SPECS.q), _put(mesh, v, SPECS.q),
            _put(mesh, jnp.asarray(local.reshape(-1), jnp.int32), SPECS.per_request))
    got = jax.jit(lambda *a: write(*a, **scales))(*args)
    assert_bitwise_equal(got, want)
    _assert_no_collectives(lambda *a: write(*a, **scales), *args)


@pytest.mark.parametrize("mesh_name", MESHES)
def test_sharded_prefill_equals_unsharded(mesh_name):
    mesh = _mesh(mesh_name)
    d = mesh.shape["data"]
    # 16 tokens, 5 pages, <= 3 per request in every shard
    shapes = (([5, 11], [300, 140]), ([9, 7], [200, 300]), ([16, 0], [300, 200]), ([1, 15], [257, 129]))
    probs = [make_problem(7200 + i, q_lens=shapes[i][0], seq_lens=shapes[i][1], **SHAPES) for i in range(d)]
    pages = probs[0].kv_cache.shape[0]
    assert all(p.kv_cache.shape[0] == pages and p.q.shape == probs[0].q.shape for p in probs)
    bt = np.stack([np.asarray(p.block_table) for p in probs])
    q = jnp.concatenate([p.q for p in probs])
    cache = jnp.concatenate([p.kv_cache for p in probs])
    topk = jnp.concatenate([p.topk for p in probs], axis=1)
    seq_lens = jnp.concatenate([p.seq_lens for p in probs])
    local_cu = jnp.concatenate([p.cu_seqlens_q for p in probs])  # [d * (B/d + 1)]
    tokens = probs[0].q.shape[0]
    global_cu = jnp.concatenate([jnp.zeros(1, jnp.int32)] + [p.cu_seqlens_q[1:] + i * tokens
                                                            for i, p in enumerate(probs)])
    want = jax.jit(lambda *a: jax_msa.sparse_attention(
        *a[:3], cu_seqlens_q=a[3], seq_lens=a[4], block_table=a[5], return_lse=True, impl="kernel"))(
        q, cache, topk, global_cu, seq_lens, _global_ids(bt, pages).reshape(-1, bt.shape[-1]))

    args = (_put(mesh, q, SPECS.q), _put(mesh, cache, SPECS.kv_cache), _put(mesh, topk, SPECS.topk),
            _put(mesh, local_cu, SPECS.per_request), _put(mesh, seq_lens, SPECS.per_request),
            _put(mesh, jnp.asarray(bt.reshape(-1, bt.shape[-1])), SPECS.block_table))
    for query_chunk_size in (None, 5):  # 5: each shard's 16 tokens in windows (jax_msa/_query_chunks.py)
        attention = sharded_sparse_attention(mesh, return_lse=True, impl="kernel", query_chunk_size=query_chunk_size)

        def step(q, cache, topk, cu, sl, bt):
            return attention(q, cache, topk, cu_seqlens_q=cu, seq_lens=sl, block_table=bt)

        assert_bitwise_equal(jax.jit(step)(*args), want)
        _assert_no_collectives(step, *args)


@pytest.mark.parametrize("mesh_name", ["mesh2x4"])
def test_indivisible_shapes_raise(mesh_name):
    mesh = _mesh(mesh_name)
    p = make_decode_problem(7300, seq_lens=[300, 77], num_q_heads=4, num_kv_heads=2, head_dim=64, topk=4)
    with pytest.raises(ValueError, match=r"Hkv \(topk.shape\[0\]\) = 2 must be divisible by the size 4"):
        sharded_sparse_decode(mesh)(p.q, p.kv_cache, p.topk, p.seq_lens, p.block_table)
    # shapes that disagree: the op's message with the global sizes the caller passed, not one shard's
    topk4 = jnp.concatenate([p.topk, p.topk])  # 4 KV heads against the cache's 2
    with pytest.raises(ValueError, match=r"topk must be \[Hkv, total_q, K\] = \[2, 2, K\]; got shape \(4, 2, 4\)"):
        sharded_sparse_decode(mesh)(p.q, p.kv_cache, topk4, p.seq_lens, p.block_table)
    cu = jnp.asarray([0, 1, 0, 1], jnp.int32)
    with pytest.raises(ValueError, match=r"got shape \(4, 2, 4\)"):
        sharded_sparse_attention(mesh)(p.q, p.kv_cache, topk4, cu_seqlens_q=cu, seq_lens=p.seq_lens,
                                       block_table=p.block_table)
    k = jnp.zeros((2, 4, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="k has 4 KV heads but kv_cache holds 2"):
        sharded_write_kv(mesh)(p.kv_cache, k, k, jnp.zeros((2,), jnp.int32))


@pytest.mark.parametrize("mesh_name", ["mesh2x4"])
def test_auto_axes_mesh_and_unplaced_inputs(mesh_name):
    """Under Auto mesh axes, inputs not yet laid out per the specs are placed by shard_map itself."""
    mesh = jax.make_mesh(MESHES[mesh_name], ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x = _decode_shards(7400, mesh.shape["data"], KVFormat.BF16)
    want = jax_msa.sparse_decode(x["q"], x["kv_cache"], x["topk"], seq_lens=x["seq_lens"],
                                 block_table=x["global_block_table"], decode_query_len=2, impl="kernel")
    decode = sharded_sparse_decode(mesh, decode_query_len=2, impl="kernel")
    got = jax.jit(decode)(x["q"], x["kv_cache"], x["topk"], x["seq_lens"], x["block_table"])
    assert_bitwise_equal(got, want)


@pytest.mark.parametrize("mesh_name", ["mesh2x4"])
def test_plain_ops_on_explicitly_sharded_inputs_name_the_wrappers(mesh_name):
    """The plain ops given inputs sharded over Explicit axes: a TypeError that names the jax_msa.sharding wrapper
    (JAX refuses the jnp reference's gathers on them, and the reference is traced next to the kernels)."""
    from jax.sharding import PartitionSpec as P

    mesh = _mesh(mesh_name)
    b, d = 4, 64
    put = functools.partial(_put, mesh)
    cache = jnp.ones((4, 2, PAGE, 2 * d), jnp.bfloat16)
    q = put(jnp.ones((b, 4, d), jnp.bfloat16), P("data"))
    topk = put(jnp.zeros((2, b, 1), jnp.int32), P(None, "data"))
    seq_lens = put(jnp.full((b,), 5, jnp.int32), P("data"))
    block_table = put(jnp.arange(b, dtype=jnp.int32)[:, None], P("data"))
    k = put(jnp.ones((b, 2, d), jnp.bfloat16), P("data"))
    for impl in ("kernel", "reference"):
        with pytest.raises(TypeError, match=r"jax_msa.sparse_decode: .*jax_msa.sharding.sharded_sparse_decode"):
            jax.jit(lambda q, t, s, bt: jax_msa.sparse_decode(q, cache, t, seq_lens=s, block_table=bt, impl=impl))(
                q, topk, seq_lens, block_table)
        with pytest.raises(TypeError, match=r"jax_msa.write_kv: .*jax_msa.sharding.sharded_write_kv"):
            jax.jit(lambda c, k, s: jax_msa.write_kv(c, k, k, s, impl=impl))(put(cache, P("data")), k, seq_lens)
    cu_seqlens_q = jnp.arange(b + 1, dtype=jnp.int32)  # one new token a request
    for impl in ("kernel", "auto", "reference"):
        with pytest.raises(TypeError, match=r"jax_msa.sparse_attention: .*sharding.sharded_sparse_attention"):
            jax.jit(lambda q, t, s, bt: jax_msa.sparse_attention(q, cache, t, cu_seqlens_q=cu_seqlens_q, seq_lens=s,
                                                                 block_table=bt, impl=impl))(
                q, topk, seq_lens, block_table)
