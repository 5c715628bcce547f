"""Kernel-only decode timings with Nsight Compute (run on the GPU machine).

For each case, runs bench_decode.py for that case under `ncu` (clocks left alone, caches flushed before
every kernel, the default) and sums the durations of the decode kernel and its split combine per call.
Reports the median over the profiled calls and the KV bandwidth (bytes of the selected K/V and scales read /
kernel time) as a fraction of 4.3 TB/s, and with q_len > 1 the same over the distinct blocks only
(bench_decode.distinct_block_fraction).

    python examples/bench/ncu_decode.py                       # the M3 cases of docs/BENCHMARKS.md
    python examples/bench/ncu_decode.py --case 64/4,32,32768,1,BF16
    python examples/bench/ncu_decode.py --splits 3 --case 64/4,32,32768,1,FP8   # a forced split-K factor
    python examples/bench/ncu_decode.py --no-flush --case 64/4,1,32768,1,FP8    # L2 as the previous calls left it

--no-flush leaves the caches as the previous kernels left them instead of flushing them before every kernel: the
top-k rows, block tables, lengths and queries of the rotating inputs (a few KB a call) then come from L2, as the
step's small inputs would in a running server. The selected KV blocks stay cold only where bench_decode.py's
rotation (8-64 calls, up to 200 MB) exceeds the 50 MB L2: not at 16/1 B = 1 (FP8 32 MB, NVFP4 19 MB).
"""

import argparse
import os
import statistics
import sys

from bench_decode import distinct_block_fraction
from ncu_util import kernel_durations

HBM = 4.3e12
DEFAULT_CASES = [f"{h},{b},{c},{q},{f}" for h in ("64/4", "16/1") for b in (1, 32, 256) for c in (32768,)
                 for q in (1, 4) for f in ("BF16", "FP8", "NVFP4")]


def selected_bytes(heads, batch, q_len, fmt):
    hkv = int(heads.split("/")[1])
    per_block = {"BF16": 128 * 2 * 128 * 2, "FP8": 128 * 2 * 128, "NVFP4": 128 * 2 * (64 + 8)}[fmt]
    return batch * q_len * hkv * 16 * per_block


def profile(case, calls, pool_gb=8.0, splits=None, flush_caches=True):
    heads, batch, context, q_len, fmt = case.split(",")
    bench = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_decode.py")
    rows = kernel_durations("sparse_decode_kernel|combine_splits", 2 * calls + 8, [
        sys.executable, bench, "--heads", heads, "--batch", batch, "--context", context, "--q-len", q_len,
        "--fmt", fmt, "--repeats", "1", "--no-dense", "--pool-gb", str(pool_gb),
        *(["--splits", str(splits)] if splits else [])], flush_caches=flush_caches)
    per_call, current = [], None
    for name, ns in rows:
        if "sparse_decode_kernel" in name:
            if current is not None:
                per_call.append(current)
            current = ns
        elif current is not None:
            current += ns
    if current is not None:
        per_call.append(current)
    if not per_call:
        return None
    us = statistics.median(per_call) / 1e3
    nbytes = selected_bytes(heads, int(batch), int(q_len), fmt)
    return us, min(per_call) / 1e3, max(per_call) / 1e3, nbytes, len(per_call)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", action="append", help="heads,batch,context,q_len,format")
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--pool-gb", type=float, default=8.0, help="bench_decode.py --pool-gb")
    ap.add_argument("--splits", type=int, help="bench_decode.py --splits: force the split-K factor")
    ap.add_argument("--no-flush", action="store_true",
                    help="leave the caches as the previous kernels left them (ncu --cache-control none)")
    args = ap.parse_args()
    print("| heads | B | context | q_len | format | kernel us (median) | min-max | calls | MB | TB/s | of 4.3 TB/s "
          "| distinct blocks, of 4.3 TB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for case in args.case or DEFAULT_CASES:
        r = profile(case, args.calls, args.pool_gb, args.splits, flush_caches=not args.no_flush)
        heads, batch, context, q_len, fmt = case.split(",")
        if r is None:
            print(f"| {heads} | {batch} | {int(context) // 1024}k | {q_len} | {fmt} | (no kernels profiled) |")
            continue
        us, lo, hi, nbytes, n = r
        tbps = nbytes / (us * 1e-6) / 1e12
        distinct = distinct_block_fraction(int(context), int(q_len))
        print(f"| {heads} | {batch} | {int(context) // 1024}k | {q_len} | {fmt} | {us:.1f} | {lo:.1f}-{hi:.1f} | {n} | "
              f"{nbytes / 1e6:.2f} | {tbps:.2f} | {100 * tbps * 1e12 / HBM:.0f}% | "
              f"{100 * distinct * tbps * 1e12 / HBM:.0f}% |", flush=True)


if __name__ == "__main__":
    main()
