"""CPU prefill handler speed (for the record): one request of N new tokens, heads Hq/Hkv, top-16 with the local
block plus 15 earlier blocks, bf16 cache. Reports plan-building and kernel time separately (median of repeats).

    python examples/bench/bench_cpu_prefill.py --tokens 32768 --heads 16/1
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jax_msa
from jax_msa.plan import default_queries_per_tile
from timing import median_p10_p90

D, K = 128, 16


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--heads", default="16/1")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    hq, hkv = (int(x) for x in a.heads.split("/"))
    n = a.tokens
    blocks = -(-n // 128)
    rng = np.random.default_rng(0)
    q = jax.random.normal(jax.random.PRNGKey(0), (n, hq, D), jnp.bfloat16)
    cache = jax.random.normal(jax.random.PRNGKey(1), (blocks, hkv, 128, 2 * D), jnp.bfloat16)
    local = np.arange(n) // 128
    topk = np.full((hkv, n, K), -1, np.int32)
    for g in range(hkv):
        for t in range(n):
            prev = rng.choice(local[t], size=min(K - 1, local[t]), replace=False) if local[t] else []
            topk[g, t, : 1 + len(prev)] = np.concatenate([[local[t]], prev])
    topk = jnp.asarray(topk)
    cu = jnp.asarray([0, n], jnp.int32)
    seq = jnp.asarray([n], jnp.int32)
    bt = jnp.arange(blocks, dtype=jnp.int32)[None]
    qpt = default_queries_per_tile(hq, hkv)
    plan_fn = jax.jit(lambda t, c, s: jax_msa.build_prefill_plan(t, c, s, max_blocks=blocks, queries_per_tile=qpt))
    plan = plan_fn(topk, cu, seq)
    attn = jax.jit(lambda q, c, t, cu, s, b, p: jax_msa.sparse_attention(
        q, c, t, cu_seqlens_q=cu, seq_lens=s, block_table=b, plan=p, impl="kernel"))
    p_med, p_lo, p_hi = median_p10_p90(plan_fn, (topk, cu, seq), a.repeats)
    k_med, k_lo, k_hi = median_p10_p90(attn, (q, cache, topk, cu, seq, bt, plan), a.repeats)
    pairs = int(jnp.sum(plan.query_edge_count))
    keys = pairs * 128  # upper bound of attended keys (diagonal blocks are partly masked)
    print(f"backend {jax.default_backend()}  N={n} heads {hq}/{hkv} K={K}")
    print(f"plan  : {p_med * 1e3:.1f} ms (p10 {p_lo * 1e3:.1f}, p90 {p_hi * 1e3:.1f})")
    print(f"kernel: {k_med * 1e3:.1f} ms (p10 {k_lo * 1e3:.1f}, p90 {k_hi * 1e3:.1f}); "
          f"{4 * D * hq * keys / k_med / 1e9:.1f} GFLOP/s over <= {keys} selected keys per head")


if __name__ == "__main__":
    main()
