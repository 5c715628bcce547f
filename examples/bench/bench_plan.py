"""Wall time of the jitted prefill plan builder (jnp) on the bench_prefill top-k, and the sort / scatter ops XLA
compiled it to.

    python examples/bench/bench_plan.py --case 32768,4 --case 131072,4 --case 32768,4,1048576

A case is tokens,kv_heads[,context]: with a context, the tokens are a chunked prefill at the end of a prompt of that
many tokens (the block table as wide as the context; the bench_prefill top-k moved to the last blocks). "compile s" is
XLA's compile time of the builder (the table's width once made it grow, and it took 15-21 s at 128k on the GPU until
the twenty-eighth session, most of it XLA's fusion autotuner: docs/BENCHMARKS.md); --no-fusion-autotuner turns the autotuner off
for this compile (compiler_options), to compare. The times are of the executable compiled here.
"""

import argparse
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench_prefill import make_topk
from jax_msa.plan import build_prefill_plan
from timing import median_p10_p90


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", action="append", help="tokens,kv_heads[,context]")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="32k only (the gpu_run.sh bench stage)")
    ap.add_argument("--no-fusion-autotuner", action="store_true",
                    help="compile with compiler_options={'xla_gpu_experimental_enable_fusion_autotuner': False} (on "
                         "the GPU it spent most of the plan's compile time until the twenty-eighth session: docs/BENCHMARKS.md)")
    args = ap.parse_args()
    print("| N | Hkv | context | plan ms (median) | p10-p90 | compile s | sort / scatter ops |")
    print("|---|---|---|---|---|---|---|")
    for case in args.case or (["32768,4"] if args.quick else ["32768,4", "131072,4"]):
        n, hkv, *rest = (int(x) for x in case.split(","))
        context = rest[0] if rest else n
        if context < n:
            raise SystemExit(f"--case {case}: the context ({context}) holds the new tokens ({n})")
        shift = (context - n) // 128  # whole blocks of earlier context: the top-k's blocks move by as many
        topk_np = make_topk(np.random.default_rng(0), n, hkv)
        topk = jnp.asarray(np.where(topk_np >= 0, topk_np + shift, topk_np).astype(np.int32))
        cu, seq = jnp.asarray([0, n], jnp.int32), jnp.asarray([shift * 128 + n], jnp.int32)
        max_blocks = (context + 127) // 128
        fn = jax.jit(lambda t, c, s: build_prefill_plan(t, c, s, max_blocks=max_blocks, queries_per_tile=8))
        t0 = time.perf_counter()
        options = {"xla_gpu_experimental_enable_fusion_autotuner": False} if args.no_fusion_autotuner else None
        compiled = fn.lower(topk, cu, seq).compile(compiler_options=options)
        compile_s = time.perf_counter() - t0
        med, lo, hi = median_p10_p90(compiled, (topk, cu, seq), args.repeats)
        hlo = compiled.as_text()
        ops = sorted(set(re.findall(r'custom_call_target="[^"]*sort[^"]*"|scatter\(', hlo)))
        print(f"| {n} | {hkv} | {context} | {med * 1e3:.3f} | {lo * 1e3:.3f}-{hi * 1e3:.3f} | {compile_s:.1f} | "
              f"{', '.join(ops)} |", flush=True)

if __name__ == "__main__":
    main()
