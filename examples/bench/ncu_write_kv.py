"""Kernel-only write_kv timings with Nsight Compute (run on the GPU machine).

For each case, runs bench_write_kv.py for that case under `ncu` (clocks left alone, caches flushed before every
kernel, the default) and reports the median duration of `write_kv_kernel` (one write), the bytes it moves (the bf16
K and V read, the slot mapping read, the cache bytes written: K and V data plus the NVFP4 block scales) and that
traffic as a fraction of 4.3 TB/s. bench_write_kv.py's own figures are per call and include the dispatch; these
are the kernel's alone.

    python examples/bench/ncu_write_kv.py                          # the default cases
    python examples/bench/ncu_write_kv.py --case 4096,4,nvfp4      # new tokens, KV heads, format (D = 128)

A case's tokens are one write's new tokens: a prefill chunk (4,096, 32,768) or a decode step's batch (32, 256).
"""

import argparse
import os
import statistics
import sys

from bench_write_kv import FORMATS, write_bytes
from ncu_util import kernel_durations

HBM = 4.3e12
HEAD_DIM = 128
DEFAULT_CASES = [f"{n},4,{f}" for n in (32, 256, 4096, 32768) for f in ("bf16", "fp8", "nvfp4")]


def profile(case, launches, flush_caches=True):
    tokens, kv_heads, fmt = case.split(",")
    bench = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_write_kv.py")
    # bench_write_kv.py's calls: (samples + 3) chained calls of --writes-per-call writes, then (samples + 3) single
    # writes; every one launches write_kv_kernel once a write
    rows = kernel_durations("write_kv_kernel", launches, [
        sys.executable, bench, "--tokens", tokens, "--kv-heads", kv_heads, "--head-dim", str(HEAD_DIM),
        "--formats", fmt, "--samples", "2", "--writes-per-call", "4", "--input-sets", "2"], flush_caches=flush_caches)
    ns = [d for name, d in rows if "write_kv_kernel" in name]
    if not ns:
        return None
    return statistics.median(ns) / 1e3, min(ns) / 1e3, max(ns) / 1e3, len(ns)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", action="append", help="tokens,kv_heads,format (bf16, fp8, nvfp4); D = 128")
    ap.add_argument("--launches", type=int, default=16, help="kernels profiled a case (bench_write_kv.py runs 25)")
    ap.add_argument("--no-flush", action="store_true",
                    help="leave the caches as the previous kernels left them (ncu --cache-control none)")
    args = ap.parse_args()
    print("| tokens | KV heads | format | kernel us (median) | min-max | kernels | MB written | MB moved | TB/s moved "
          "| of 4.3 TB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for case in args.case or DEFAULT_CASES:
        tokens, kv_heads, fmt = case.split(",")
        r = profile(case, args.launches, flush_caches=not args.no_flush)
        if r is None:
            print(f"| {tokens} | {kv_heads} | {fmt} | (no kernels profiled) |")
            continue
        us, lo, hi, n = r
        written, moved = write_bytes(int(tokens), int(kv_heads), HEAD_DIM, FORMATS[fmt])
        tbps = moved / (us * 1e-6) / 1e12
        print(f"| {tokens} | {kv_heads} | {fmt} | {us:.2f} | {lo:.2f}-{hi:.2f} | {n} | {written / 1e6:.2f} | "
              f"{moved / 1e6:.2f} | {tbps:.2f} | {100 * tbps * 1e12 / HBM:.0f}% |", flush=True)


if __name__ == "__main__":
    main()
