"""Kernel-only prefill timings with Nsight Compute (run on the GPU machine): the prefill kernel and the combine
of its partials, separately, for the problems of bench_prefill.py.

For each case, runs bench_prefill.py for that case under `ncu` (clocks left alone, caches flushed before every
kernel) and reports the median duration of each kernel over the profiled calls, their sum, and the useful
TFLOP/s of the sum (bench_prefill.useful_flops) as a fraction of 790.

    python examples/bench/ncu_prefill.py                          # 32k, heads 64/4 and 16/1, bf16
    python examples/bench/ncu_prefill.py --case 32768,64/4,NVFP4
    python examples/bench/ncu_prefill.py --pipelined              # the opt-in pipelined bf16 kernel
"""

import argparse
import os
import statistics
import sys

import numpy as np

from bench_prefill import PEAK, make_topk, useful_flops
from ncu_util import kernel_durations

KERNELS = {"prefill": "sparse_prefill", "combine": "combine_partials"}  # sparse_prefill_(pipelined_)kernel


def profile(case, calls, pipelined=False):
    n, heads, fmt = case.split(",")
    bench = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_prefill.py")
    rows = kernel_durations("|".join(KERNELS.values()), 2 * calls, [
        sys.executable, bench, "--tokens", n, "--heads", heads, "--fmt", fmt, "--repeats", str(max(1, calls - 2)),
        "--no-dense", *(["--pipelined"] if pipelined else [])])
    return {k: [ns / 1e3 for name, ns in rows if sym in name] for k, sym in KERNELS.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", action="append", help="tokens,heads,format")
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--pipelined", action="store_true", help="the opt-in pipelined bf16 prefill kernel")
    args = ap.parse_args()
    print("| N | heads | KV | prefill kernel us (min-max) | combine us (min-max) | sum us | useful TFLOP/s | of 790 |")
    print("|---|---|---|---|---|---|---|---|")
    for case in args.case or ["32768,64/4,BF16", "32768,16/1,BF16"]:
        n, heads, fmt = case.split(",")
        times = profile(case, args.calls, args.pipelined)
        if not times["prefill"]:
            print(f"| {int(n) // 1024}k | {heads} | {fmt} | (no kernels profiled) |")
            continue
        med = {k: statistics.median(v) if v else 0.0 for k, v in times.items()}
        hq, hkv = (int(x) for x in heads.split("/"))
        flops = useful_flops(make_topk(np.random.default_rng(0), int(n), hkv), int(n), hq)
        total = med["prefill"] + med["combine"]
        cells = " | ".join(f"{med[k]:.0f} ({min(v):.0f}-{max(v):.0f})" if v else "-" for k, v in times.items())
        tflops = flops / (total * 1e-6) / 1e12
        print(f"| {int(n) // 1024}k | {heads} | {fmt} | {cells} | {total:.0f} | {tflops:.1f} | "
              f"{100 * tflops * 1e12 / PEAK:.1f}% |", flush=True)


if __name__ == "__main__":
    main()
