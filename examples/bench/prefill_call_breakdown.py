"""Where one jitted prefill call's wall time goes (run on the GPU machine): its kernels one by one under Nsight
Compute, against the call's wall time with and without a host sync after every call.

bench_prefill.py times a call as dispatch + block_until_ready, one call at a time; ncu_prefill.py times only the
prefill kernel and the combine, caches flushed. This script puts the two side by side for one problem of
bench_prefill.py (the plan built once, outside the call):

- every kernel the call launches (XLA's own fusions included), from a child process under ncu with the caches left
  as the previous kernels left them (`--cache-control none`), clocks left alone; the second of two calls is listed;
- the call's wall time, median (p10-p90) of `--repeats` calls each waited for (bench_prefill.py's method), and the
  mean of `--repeats` calls enqueued back to back and waited for once (what a pipelined caller sees);
- the SM clock and the active clock-throttle reasons right after the back-to-back calls (nvidia-smi).

Each call returns a new output and XLA gives it its temporary buffers (the partial workspace, ~8.6 GB at 32k 64/4
bf16), so calls in flight hold memory until they end: with XLA_PYTHON_CLIENT_PREALLOCATE=false, as in the first run
(docs/BENCHMARKS.md, "On an H100: where a prefill call's wall time goes"), 20 calls back to back ran slower a call
than 4.

    python examples/bench/prefill_call_breakdown.py                              # 32k, 64/4, bf16
    python examples/bench/prefill_call_breakdown.py --tokens 131072 --fmt NVFP4
"""

import argparse
import os
import subprocess
import sys
import time

from ncu_util import kernel_durations
from timing import median_p10_p90


def problem(n, heads, fmt):
    import jax

    import jax_msa
    from bench_prefill import default_queries_per_tile, make_inputs

    hq, hkv = (int(x) for x in heads.split("/"))
    _, (q, cache, topk, cu, seq, bt) = make_inputs(n, hq, hkv, fmt)
    plan = jax.jit(lambda t, c, s: jax_msa.build_prefill_plan(
        t, c, s, max_blocks=bt.shape[1], queries_per_tile=default_queries_per_tile(hq, hkv)))(topk, cu, seq)
    attn = jax.jit(lambda q, c, t, cu, s, b, p: jax_msa.sparse_attention(
        q, c, t, cu_seqlens_q=cu, seq_lens=s, block_table=b, plan=p, impl="kernel"))
    args = (q, cache, topk, cu, seq, bt, plan)
    jax.block_until_ready(args)
    return attn, args


def child(n, heads, fmt):
    """Two calls, each waited for: the driver lists the kernels of the second."""
    import jax

    attn, args = problem(n, heads, fmt)
    for _ in range(2):
        jax.block_until_ready(attn(*args))


def back_to_back(attn, args, repeats):
    """Mean wall time a call of `repeats` calls enqueued back to back and waited for once (after warm-up)."""
    import jax

    jax.block_until_ready(attn(*args))
    t0 = time.perf_counter()
    outs = [attn(*args) for _ in range(repeats)]
    jax.block_until_ready(outs)
    return (time.perf_counter() - t0) / repeats


def gpu_clocks():
    out = ""
    for reasons in ("clocks_event_reasons.active", "clocks_throttle_reasons.active"):  # newer, older drivers' name
        try:
            out = subprocess.run(["nvidia-smi", f"--query-gpu=clocks.sm,clocks.max.sm,power.draw,{reasons}",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError) as e:
            return f"(nvidia-smi: {type(e).__name__})"
        if "valid field" not in out:
            return out
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--heads", default="64/4")
    ap.add_argument("--fmt", default="BF16", choices=["BF16", "FP8", "NVFP4"])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--no-ncu", action="store_true", help="wall times only")
    args = ap.parse_args()
    case = f"{args.tokens // 1024}k {args.heads} {args.fmt}"

    attn, call_args = problem(args.tokens, args.heads, args.fmt)
    med, p10, p90 = median_p10_p90(attn, call_args, args.repeats)  # bench_prefill.py's method
    queued = back_to_back(attn, call_args, args.repeats)
    clocks = gpu_clocks()
    print(f"[{case}] wall a call, each waited for: {med * 1e3:.3f} ms ({p10 * 1e3:.3f}-{p90 * 1e3:.3f}); "
          f"back to back, waited for once: {queued * 1e3:.3f} ms ({args.repeats} calls)")
    print(f"[{case}] after the back-to-back calls: sm clock, max sm clock, power, throttle reasons = {clocks}")
    if args.no_ncu:
        return
    del attn, call_args

    rows = kernel_durations(".", 4000, [sys.executable, os.path.abspath(__file__), "--child", str(args.tokens),
                                        args.heads, args.fmt], flush_caches=False)
    combines = [i for i, (name, _) in enumerate(rows) if "combine_partials" in name]
    if len(combines) < 2:
        print(f"[{case}] ncu listed {len(rows)} kernels, {len(combines)} combines: no second call to list")
        return
    call = rows[combines[-2] + 1:combines[-1] + 1]
    total = sum(ns for _, ns in call)
    ours = sum(ns for name, ns in call if any(k in name for k in ("sparse_prefill", "combine_partials")))
    print(f"[{case}] the second call's kernels under ncu (caches as left, clocks alone): {len(call)} kernels, "
          f"{total / 1e6:.3f} ms; jax_msa's {ours / 1e6:.3f} ms, XLA's {(total - ours) / 1e6:.3f} ms")
    for name, ns in call:
        print(f"[{case}]   {ns / 1e3:10.1f} us  {name.split('(')[0][:100]}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    else:
        main()
