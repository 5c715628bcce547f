"""Benchmark of jax_msa.write_kv (quantize-on-write into the paged cache) for the bf16, FP8 and NVFP4 formats.

Workload (default): 4,096 new tokens x 4 KV heads x D = 128, written into page-shuffled slots of a cache
four times larger than needed (as a block table would place them).

Method (no CUDA graphs): one jitted call chains --writes-per-call writes through the donated cache, each
write reading the next of --input-sets rotating (k, v, slot_mapping) sets (by default 8 sets, 67 MB of bf16
K/V, more than the H200's 50 MB L2, so inputs come from HBM); every sample is one call followed by
block_until_ready, divided by the writes it chains. The dispatch of the call is spread over those writes;
the last column times one write per call (dispatch and synchronisation included) for comparison.

Reported per format: median and p10 / p90 microseconds per write; cache bytes written per second (K and V
data plus the NVFP4 block scales) and as a fraction of the H200's 4.3 TB/s HBM copy ceiling; and the same
for all bytes moved (bf16 K/V and slot_mapping read + cache written).

    python examples/bench/bench_write_kv.py            # on the GPU
    python examples/bench/bench_write_kv.py --quick    # a short run (also a syntax check on the CPU)
"""

from __future__ import annotations

import argparse
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_msa
from jax_msa import kv_cache as kvc

HBM_BYTES_PER_S = 4.3e12  # H200 measured HBM copy ceiling (MSA.md section 6)
FORMATS = {"bf16": kvc.KVFormat.BF16, "fp8": kvc.KVFormat.FP8, "nvfp4": kvc.KVFormat.NVFP4}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="new tokens per write")
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--formats", default="bf16,fp8,nvfp4", help="comma-separated subset of bf16,fp8,nvfp4")
    p.add_argument("--samples", type=int, default=200, help="timed calls per format")
    p.add_argument("--writes-per-call", type=int, default=32, help="writes chained in one jitted call")
    p.add_argument("--input-sets", type=int, default=8, help="rotating (k, v, slot_mapping) sets")
    p.add_argument("--impl", default="kernel", choices=["kernel", "auto", "reference"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a short run: few samples, writes and input sets")
    args = p.parse_args()
    if args.quick:
        args.samples, args.writes_per_call, args.input_sets = 5, 4, 2
    return args


def make_inputs(key, n: int, hkv: int, d: int, num_pages: int, sets: int):
    """`sets` tuples (k, v, slots): k, v bf16 [n, hkv, d]; slots fill randomly chosen whole pages."""
    pages_used = math.ceil(n / kvc.PAGE_SIZE)
    ks, vs, ss = [], [], []
    for i in range(sets):
        kk, kv, kp = jax.random.split(jax.random.fold_in(key, i), 3)
        ks.append(jax.random.normal(kk, (n, hkv, d), jnp.float32).astype(jnp.bfloat16))
        vs.append(jax.random.normal(kv, (n, hkv, d), jnp.float32).astype(jnp.bfloat16))
        pages = jax.random.permutation(kp, num_pages)[:pages_used].astype(jnp.int32)
        t = jnp.arange(n, dtype=jnp.int32)
        ss.append(pages[t // kvc.PAGE_SIZE] * kvc.PAGE_SIZE + t % kvc.PAGE_SIZE)
    return tuple(ks), tuple(vs), tuple(ss)


def write_bytes(n: int, hkv: int, d: int, fmt: kvc.KVFormat) -> tuple[int, int]:
    """(cache bytes written, all bytes moved) by one write of n tokens: the K and V data (+ NVFP4 scales) of every new
    token, and with them the bf16 k, v and the int32 slot_mapping read."""
    written = n * kvc.bytes_per_token(fmt, hkv, d)
    return written, written + 2 * n * hkv * d * 2 + n * 4


def chained_writes(writes: int, impl: str):
    """jit(cache, ks, vs, ss) -> cache after `writes` writes, input set i % len(ks) for write i."""
    def chain(cache, ks, vs, ss):
        for i in range(writes):
            j = i % len(ks)
            cache = jax_msa.write_kv(cache, ks[j], vs[j], ss[j], impl=impl)
        return cache
    return jax.jit(chain, donate_argnums=0)


def time_calls(fn, cache, inputs, samples: int, rotate: bool):
    """Seconds per call over `samples` calls (after 3 warm-up calls); returns (times, cache)."""
    ks, vs, ss = inputs
    times = []
    for i in range(samples + 3):
        args = ((ks[i % len(ks)],), (vs[i % len(vs)],), (ss[i % len(ss)],)) if rotate else inputs
        t0 = time.perf_counter()
        cache = fn(cache, *args)
        cache.block_until_ready()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return np.asarray(times), cache


def bench_format(name: str, args, key):
    fmt = FORMATS[name]
    n, hkv, d = args.tokens, args.kv_heads, args.head_dim
    num_pages = 4 * math.ceil(n / kvc.PAGE_SIZE)
    inputs = make_inputs(key, n, hkv, d, num_pages, args.input_sets)
    cache = kvc.allocate_cache(fmt, num_pages, hkv, d)

    chain = chained_writes(args.writes_per_call, args.impl)
    per_call, cache = time_calls(chain, cache, inputs, args.samples, rotate=False)
    per_write = per_call / args.writes_per_call * 1e6
    single, cache = time_calls(chained_writes(1, args.impl), cache, inputs, args.samples, rotate=True)
    single_us = single * 1e6

    written, moved = write_bytes(n, hkv, d, fmt)
    med = float(np.median(per_write))
    return {
        "format": name,
        "median": med,
        "p10": float(np.percentile(per_write, 10)),
        "p90": float(np.percentile(per_write, 90)),
        "written_gbs": written / (med * 1e-6) / 1e9,
        "moved_gbs": moved / (med * 1e-6) / 1e9,
        "single_median": float(np.median(single_us)),
        "single_p10": float(np.percentile(single_us, 10)),
        "single_p90": float(np.percentile(single_us, 90)),
        "written_mb": written / 1e6,
    }


def markdown(rows, args) -> str:
    lines = [
        f"write_kv: {args.tokens} tokens x {args.kv_heads} KV heads x D={args.head_dim}, "
        f"impl={args.impl}, backend={jax.default_backend()} ({jax.devices()[0].device_kind}); "
        f"{args.writes_per_call} chained writes per call over {args.input_sets} rotating input sets, "
        f"{args.samples} samples",
        "",
        "| format | cache MB written | us/write median | p10 | p90 | written GB/s | % of 4.3 TB/s "
        "| read+write GB/s | % of 4.3 TB/s | us/call, 1 write (p10-p90) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['format']} | {r['written_mb']:.2f} | {r['median']:.2f} | {r['p10']:.2f} | {r['p90']:.2f} "
            f"| {r['written_gbs']:.0f} | {100 * r['written_gbs'] * 1e9 / HBM_BYTES_PER_S:.1f}% "
            f"| {r['moved_gbs']:.0f} | {100 * r['moved_gbs'] * 1e9 / HBM_BYTES_PER_S:.1f}% "
            f"| {r['single_median']:.1f} ({r['single_p10']:.1f}-{r['single_p90']:.1f}) |")
    return "\n".join(lines)


def main():
    args = parse_args()
    key = jax.random.key(args.seed)
    names = [s.strip() for s in args.formats.split(",") if s.strip()]
    unknown = sorted(set(names) - set(FORMATS))
    if unknown:
        raise SystemExit(f"unknown formats {unknown}; choose from {sorted(FORMATS)}")
    rows = [bench_format(name, args, jax.random.fold_in(key, i)) for i, name in enumerate(names)]
    print(markdown(rows, args))


if __name__ == "__main__":
    main()
