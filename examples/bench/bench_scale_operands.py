"""What a layer's FP8 / NVFP4 scales cost per decode call, by how they reach jax_msa.sparse_decode.

A model calls the decode once per layer, each layer with its own k_scale / v_scale. One jitted program chains R
calls (64/4 heads, B = 1, 32k context, each call's output the next call's query, a different top-k set each; the
whole B = 1 cache, 34 MB in FP8, fits the 50 MB L2, so these are per-call overhead times, not HBM-bound ones), with
the scales given three ways:

  constant  Python floats: folded into the program as constants;
  params    R pairs of traced fp32 scalars, the program's arguments (a model's per-layer parameters);
  scan      two stacked [R] arrays, the layers run by lax.scan and the scales indexed per step (a scanned model);
  vmap      the R layers independent (one query, each layer its own top-k set) under jax.vmap, the scales two [R]
            arrays: one custom call of R requests since the fold takes per-layer scales (jax_msa/_batching.py), R
            calls in a loop before;
  vmap_shared  the same with one shared pair of scales (one call before and after).

It prints the time per call (wall time of the program / R, median and p10-p90 over repeats; for the vmap rows, per
layer), the number of XLA fusions in the compiled program (about one kernel each besides jax_msa's: with the scales
stacked into one operand, one a call) and its while loops (the scan's; a vmap that runs one call a layer). Every
program takes the same arguments (keep_unused), so that the constant case does not drop the scales it ignores. Run it
against two installations to compare how they pass the scales.

    python examples/bench/bench_scale_operands.py [--layers 64] [--repeats 30] [--fmt FP8 --fmt NVFP4]
    python examples/bench/bench_scale_operands.py --quick    # 8 layers, 5 repeats, FP8 (.ci/gpu_run.sh bench)
"""

import argparse
import re

import jax
import jax.numpy as jnp
import numpy as np

import jax_msa
from bench_decode import make_inputs, pool_pages
from jax_msa import KVFormat
from timing import median_p10_p90

HQ, HKV, CONTEXT = 64, 4, 32768


def programs(cache, seq, bt, layers):
    def call(q, topk, ks, vs):
        return jax_msa.sparse_decode(q, cache, topk, seq_lens=seq, block_table=bt, impl="kernel", k_scale=ks,
                                     v_scale=vs)

    def constant(q, topks, ks, vs):
        for i, t in enumerate(topks):
            q = call(q, t, 0.5 + 0.01 * i, 0.25 + 0.01 * i)
        return q

    def params(q, topks, ks, vs):
        for t, k, v in zip(topks, ks, vs):
            q = call(q, t, k, v)
        return q

    def scan(q, topks, ks, vs):
        def step(q, x):
            t, k, v = x
            return call(q, t, k, v), None
        return jax.lax.scan(step, q, (jnp.stack(topks), ks, vs))[0]

    def vmap(q, topks, ks, vs):
        return jax.vmap(lambda t, k, v: call(q, t, k, v))(jnp.stack(topks), ks, vs)

    def vmap_shared(q, topks, ks, vs):
        return jax.vmap(lambda t: call(q, t, ks[0], vs[0]))(jnp.stack(topks))

    ks = 0.5 + 0.01 * jnp.arange(layers, dtype=jnp.float32)
    vs = 0.25 + 0.01 * jnp.arange(layers, dtype=jnp.float32)
    as_list = ([ks[i] for i in range(layers)], [vs[i] for i in range(layers)])
    return {"constant": (constant, as_list), "params": (params, as_list), "scan": (scan, (ks, vs)),
            "vmap": (vmap, (ks, vs)), "vmap_shared": (vmap_shared, (ks, vs))}


def fusions(compiled_text: str) -> int:
    """XLA fusions in the compiled program's text (about one kernel launch each where it runs; those in the scan's loop
    body and condition run once a layer)."""
    return sum(1 for line in compiled_text.splitlines() if re.match(r"\s*(ROOT\s+)?%?\S+ = .*\bfusion\(", line))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--fmt", action="append", choices=["FP8", "NVFP4"])
    ap.add_argument("--quick", action="store_true", help="a short run: 8 layers, 5 repeats, FP8 only")
    args = ap.parse_args()
    if args.quick:
        args.layers, args.repeats, args.fmt = 8, 5, args.fmt or ["FP8"]
    print(f"jax_msa {jax_msa.__file__}, {jax.devices()[0].device_kind}")
    print(f"| format | scales | us a call (p10-p90) | XLA fusions in the program ({args.layers} calls) | while loops |")
    print("|---|---|---|---|---|")
    for name in args.fmt or ["FP8", "NVFP4"]:
        fmt = KVFormat[name]
        rng = np.random.default_rng(0)
        q, cache, topks, seq, bt = make_inputs(rng, fmt, HQ, HKV, 1, CONTEXT, 1, args.layers,
                                               pool_pages(fmt, HKV, 1, CONTEXT))
        for how, (fn, (ks, vs)) in programs(cache, seq, bt, args.layers).items():
            jitted = jax.jit(fn, keep_unused=True)
            text = jitted.lower(q, topks, ks, vs).compile().as_text()
            n_fusions, loops = fusions(text), len(re.findall(r"\bwhile\(", text))
            med, p10, p90 = median_p10_p90(jitted, (q, topks, ks, vs), args.repeats)
            n = args.layers
            print(f"| {name} | {how} | {med / n * 1e6:.2f} ({p10 / n * 1e6:.2f}-{p90 / n * 1e6:.2f}) | "
                  f"{n_fusions} | {loops} |", flush=True)


if __name__ == "__main__":
    main()
