"""Tensor-parallel MSA: M3's attention ops with the KV heads sharded over a `model` mesh axis of the visible devices.

For each case (a prefill of N new tokens; decode at batch B), runs the op on one device, then on meshes of m
devices for every m that divides both the device count and Hkv (M3: 4 KV heads -> m in 1, 2, 4), and reports:
- that the sharded output equals the one-device output (bit-identical, or the largest difference),
- that the compiled sharded program holds no collective (all-reduce, all-gather, reduce-scatter, all-to-all,
  collective-permute): every shard attends its own heads only,
- the time per call on m devices (each device does 1/m of the heads) and the speed-up over one device.

    python examples/bench/bench_tp.py                     # M3: 64/4 heads, 32k prefill, decode B 32 and 256
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python examples/bench/bench_tp.py --small   # CPU check

Times are per-call wall times of the jitted call (timing.median_p10_p90): medians over --repeats.
"""

import argparse
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jax_msa
from bench_prefill import make_topk
from jax_msa.sharding import ServingSpecs, sharded_sparse_attention, sharded_sparse_decode
from timing import median_p10_p90

D, K = 128, 16
COLLECTIVES = re.compile(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(-start)?\(")


def prefill_inputs(n, hq, hkv):
    """One request of n new tokens over a contiguous cache; top-k from bench_prefill.make_topk."""
    blocks = -(-n // 128)
    rng = np.random.default_rng(0)
    q = jax.random.normal(jax.random.PRNGKey(0), (n, hq, D), jnp.bfloat16)
    cache = jax.random.normal(jax.random.PRNGKey(1), (blocks, hkv, 128, 2 * D), jnp.bfloat16)
    topk = jnp.asarray(make_topk(rng, n, hkv))
    return dict(q=q, kv_cache=cache, topk=topk, cu_seqlens_q=jnp.asarray([0, n], jnp.int32),
                seq_lens=jnp.asarray([n], jnp.int32), block_table=jnp.arange(blocks, dtype=jnp.int32)[None])


def decode_inputs(batch, context, hq, hkv):
    """batch requests of `context` tokens over a shuffled page pool; the local block + K - 1 distinct earlier blocks
    (all the earlier ones when there are fewer)."""
    rng = np.random.default_rng(1)
    max_blocks = -(-context // 128)  # the last, partial block has its page too
    pages = batch * max_blocks
    q = jax.random.normal(jax.random.PRNGKey(2), (batch, hq, D), jnp.bfloat16)
    cache = jax.random.normal(jax.random.PRNGKey(3), (pages, hkv, 128, 2 * D), jnp.bfloat16)
    block_table = rng.permutation(pages).reshape(batch, max_blocks).astype(np.int32)
    local = max_blocks - 1
    earlier = min(K - 1, local)
    picks = np.argsort(rng.random((hkv * batch, local)), axis=1)[:, :earlier]  # distinct blocks in [0, local)
    holes = np.full((hkv * batch, K - 1 - earlier), -1)
    topk = np.concatenate([np.full((hkv * batch, 1), local), picks, holes], axis=1).reshape(hkv, batch, K)
    return dict(q=q, kv_cache=cache, topk=jnp.asarray(topk.astype(np.int32)),
                seq_lens=jnp.full((batch,), context, jnp.int32), block_table=jnp.asarray(block_table))


def one_device(kind):
    if kind == "prefill":
        return jax.jit(lambda q, kv_cache, topk, cu_seqlens_q, seq_lens, block_table: jax_msa.sparse_attention(
            q, kv_cache, topk, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens, block_table=block_table))
    return jax.jit(lambda q, kv_cache, topk, seq_lens, block_table: jax_msa.sparse_decode(
        q, kv_cache, topk, seq_lens=seq_lens, block_table=block_table))


def sharded(kind, mesh):
    specs = ServingSpecs(None, "model")
    if kind == "prefill":
        attn = sharded_sparse_attention(mesh, data_axis=None, model_axis="model")
        fn = jax.jit(lambda q, kv_cache, topk, cu_seqlens_q, seq_lens, block_table: attn(
            q, kv_cache, topk, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens, block_table=block_table))
        layout = dict(q=specs.q, kv_cache=specs.kv_cache, topk=specs.topk, cu_seqlens_q=PartitionSpec(),
                      seq_lens=PartitionSpec(), block_table=PartitionSpec())
    else:
        dec = sharded_sparse_decode(mesh, data_axis=None, model_axis="model")
        fn = jax.jit(lambda q, kv_cache, topk, seq_lens, block_table: dec(q, kv_cache, topk, seq_lens, block_table))
        layout = dict(q=specs.q, kv_cache=specs.kv_cache, topk=specs.topk, seq_lens=PartitionSpec(),
                      block_table=PartitionSpec())
    return fn, layout


def run_case(kind, name, inputs, sizes, repeats):
    devices = jax.devices()
    args = tuple(jax.device_put(x, devices[0]) for x in inputs.values())
    base_fn = one_device(kind)
    want = np.asarray(base_fn(*args), np.float32)
    t1, lo1, hi1 = median_p10_p90(base_fn, args, repeats)
    rows = [f"| {name} | 1 | {t1 * 1e3:.3f} ({lo1 * 1e3:.3f}-{hi1 * 1e3:.3f}) | 1.00x | - | reference |"]
    for m in sizes:
        if m == 1:
            continue
        mesh = Mesh(np.asarray(devices[:m]), ("model",))
        fn, layout = sharded(kind, mesh)
        placed = tuple(jax.device_put(x, NamedSharding(mesh, layout[k])) for k, x in inputs.items())
        hlo = fn.lower(*placed).compile().as_text()
        collectives = sorted(set(c[0] for c in COLLECTIVES.findall(hlo)))
        got = np.asarray(fn(*placed), np.float32)
        diff = float(np.max(np.abs(got - want))) if got.size else 0.0
        same = "bit-identical" if np.array_equal(got.view(np.uint32), want.view(np.uint32)) else f"max diff {diff:.3g}"
        tm, lo, hi = median_p10_p90(fn, placed, repeats)
        rows.append(f"| {name} | {m} | {tm * 1e3:.3f} ({lo * 1e3:.3f}-{hi * 1e3:.3f}) | {t1 / tm:.2f}x | "
                    f"{', '.join(collectives) or 'none'} | {same} |")
        assert not collectives, f"{name}, {m} devices: collectives in the sharded program: {collectives}"
        assert got.shape == want.shape and np.isfinite(got).all()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="CPU-sized: 16/4 heads, 1k prefill, decode B 8, 2k context")
    ap.add_argument("--tokens", type=int, default=32768, help="prefill tokens")
    ap.add_argument("--batch", type=int, action="append", help="decode batch (default 32 and 256)")
    ap.add_argument("--context", type=int, default=32768, help="decode context")
    ap.add_argument("--repeats", type=int, default=10)
    a = ap.parse_args()
    hq, hkv = (16, 4) if a.small else (64, 4)
    tokens, batches, context = (1024, [8], 2048) if a.small else (a.tokens, a.batch or [32, 256], a.context)
    n = len(jax.devices())
    sizes = [m for m in range(1, n + 1) if n % m == 0 and hkv % m == 0]
    print(f"devices: {n} x {jax.devices()[0].device_kind}; heads {hq}/{hkv}; model-axis sizes {sizes}")
    print("| case | devices | ms per call (p10-p90) | speed-up | collectives | vs one device |")
    print("|---|---|---|---|---|---|")
    for row in run_case("prefill", f"prefill {tokens // 1024}k", prefill_inputs(tokens, hq, hkv), sizes, a.repeats):
        print(row, flush=True)
    for b in batches:
        for row in run_case("decode", f"decode B={b} {context // 1024}k", decode_inputs(b, context, hq, hkv), sizes,
                            a.repeats):
            print(row, flush=True)


if __name__ == "__main__":
    main()
