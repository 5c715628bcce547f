"""Does the order of the prefill work list matter? The same plan with its valid work items permuted on the host (every
order gives bit-identical outputs: one partial per (query, block), merged in rank order), timed as bench_prefill.py
times the attention call: one request of N new tokens, bf16 KV, the bench_prefill top-k.

    python examples/bench/bench_work_order.py                # 32k, heads 64/4
    python examples/bench/bench_work_order.py --tokens 131072 --heads 16/1

Orders: as built (largest first, ties by (head, block)); by (head, first token); by (first token, head); and the
plan's own work_order="token" (by (head, token block, block)). Ordering by token lets the query rows, re-read once per
selected block, hit L2.
"""

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import jax_msa
from bench_prefill import PEAK, make_inputs, useful_flops
from jax_msa.plan import default_queries_per_tile
from timing import median_p10_p90


def work_lists(plan, token_plan):
    """{name: work array}: the plan's list as built, two host permutations of it, and the token-ordered plan's list."""
    work = np.asarray(plan.work)
    n = int(np.asarray(plan.num_work)[0])
    g, _, begin, _ = work[:n].T
    first = np.asarray(plan.edge_query)[g, begin]

    def permuted(perm):
        out = work.copy()
        out[:n] = work[:n][perm]
        return out

    return n, {"as built": work, "head, token": permuted(np.lexsort((first, g))),
               "token, head": permuted(np.lexsort((g, first))),
               'work_order="token"': np.asarray(token_plan.work)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--heads", default="64/4")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="3 repeats (the gpu_run.sh bench stage)")
    a = ap.parse_args()
    if a.quick:
        a.repeats = 3
    n = a.tokens
    hq, hkv = (int(x) for x in a.heads.split("/"))
    blocks = -(-n // 128)
    topk_np, (q, cache, topk, cu, seq, bt) = make_inputs(n, hq, hkv)
    build = jax.jit(lambda t, c, s, order: jax_msa.build_prefill_plan(
        t, c, s, max_blocks=blocks, queries_per_tile=default_queries_per_tile(hq, hkv), work_order=order),
        static_argnums=3)
    plan, token_plan = build(topk, cu, seq, "size"), build(topk, cu, seq, "token")
    attn = jax.jit(lambda q, c, t, cu, s, b, p: jax_msa.sparse_attention(
        q, c, t, cu_seqlens_q=cu, seq_lens=s, block_table=b, plan=p, impl="kernel"))
    flops = useful_flops(topk_np, n, hq)
    valid, lists = work_lists(plan, token_plan)
    print(f"{valid} work items; {n // 1024}k tokens, heads {hq}/{hkv}")
    print("| order | kernels ms (p10-p90) | of 790 | output |")
    print("|---|---|---|---|")
    ref = None
    for name, work in lists.items():
        p = dataclasses.replace(plan, work=jnp.asarray(work))
        out = np.asarray(attn(q, cache, topk, cu, seq, bt, p)).view(np.uint16)
        same = "reference" if ref is None else ("bit-identical" if np.array_equal(out, ref) else "DIFFERENT")
        ref = out if ref is None else ref
        med, lo, hi = median_p10_p90(attn, (q, cache, topk, cu, seq, bt, p), a.repeats)
        print(f"| {name} | {med * 1e3:.2f} ({lo * 1e3:.2f}-{hi * 1e3:.2f}) | {100 * flops / med / PEAK:.1f}% "
              f"| {same} |", flush=True)


if __name__ == "__main__":
    main()
