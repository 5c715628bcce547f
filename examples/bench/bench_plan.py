"""Wall time of the jitted prefill plan builder (jnp) on the bench_prefill top-k, and the sort / scatter ops XLA
compiled it to.

    python examples/bench/bench_plan.py --case 32768,4 --case 131072,4
"""

import argparse
import re

import jax
import jax.numpy as jnp
import numpy as np

from bench_prefill import make_topk
from jax_msa.plan import build_prefill_plan
from timing import median_p10_p90


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", action="append", help="tokens,kv_heads")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="32k only (the gpu_run.sh bench stage)")
    args = ap.parse_args()
    print("| N | Hkv | plan ms (median) | p10-p90 | sort / scatter ops |")
    print("|---|---|---|---|---|")
    for case in args.case or (["32768,4"] if args.quick else ["32768,4", "131072,4"]):
        n, hkv = (int(x) for x in case.split(","))
        topk = jnp.asarray(make_topk(np.random.default_rng(0), n, hkv))
        cu, seq = jnp.asarray([0, n], jnp.int32), jnp.asarray([n], jnp.int32)
        fn = jax.jit(lambda t, c, s: build_prefill_plan(t, c, s, max_blocks=(n + 127) // 128, queries_per_tile=8))
        med, lo, hi = median_p10_p90(fn, (topk, cu, seq), args.repeats)
        hlo = fn.lower(topk, cu, seq).compile().as_text()
        ops = sorted(set(re.findall(r'custom_call_target="[^"]*sort[^"]*"|scatter\(', hlo)))
        print(f"| {n} | {hkv} | {med * 1e3:.3f} | {lo * 1e3:.3f}-{hi * 1e3:.3f} | {', '.join(ops)} |", flush=True)


if __name__ == "__main__":
    main()
