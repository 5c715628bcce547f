"""Benchmark of jax_msa.sparse_decode on the GPU (M3 shapes), against dense cuDNN attention.

For each case: heads (64/4 or 16/1), batch B, context length, decode_query_len, KV format. Top-k rows hold the
local block plus 15 distinct earlier blocks (all valid). R >= 8 different top-k sets rotate through one jitted,
unrolled program (so XLA replays it as one command buffer and the selected blocks are not L2-resident:
R x bytes per call >= 200 MB) whose R outputs are stacked into one array (one concatenation per program, whose copy
of 2x the output bytes a call is included), and time per call = wall time / R, median over repeats. This per-call
time includes the program's launch and the gaps between XLA's kernels; `.ci/gpu_run.sh profile` reports the kernels
alone (Nsight Compute, L2 flushed before each kernel).

KV bandwidth = bytes of the selected K and V (with scales) per call / time, against 4.3 TB/s; with q_len > 1 also
over the distinct blocks only (distinct_block_fraction: draft tokens of a request share blocks, re-read from L2).

    python examples/bench/bench_decode.py            # full grid
    python examples/bench/bench_decode.py --quick    # a few cases
    python examples/bench/bench_decode.py --heads 64/4 --batch 32 --fmt FP8 --splits 3   # a forced split-K factor
"""

import argparse
import math

import jax
import jax.numpy as jnp
import numpy as np

import jax_msa
from jax_msa import KVFormat, kv_cache
from timing import median_p10_p90

HBM = 4.3e12
D = 128
K = 16


def block_bytes(fmt, hkv_one=1):
    return kv_cache.bytes_per_token(fmt, hkv_one, D) * 128


def distinct_block_fraction(context, q_len, k=K):
    """Expected share of distinct blocks among the q_len * k ids of one (request, KV head) that make_inputs draws:
    the tokens' local blocks plus, per token, k - 1 distinct blocks uniform over [0, n_prev). With q_len > 1 the
    draft tokens share their local block and, by chance, some others: those are read once from HBM and then from L2,
    so the rate over distinct blocks is the one to hold against 4.3 TB/s."""
    local = (context - q_len + np.arange(q_len)) // 128
    n_prev = int(local.min())
    distinct = len(set(local.tolist())) + n_prev * (1.0 - (1.0 - (k - 1) / n_prev) ** q_len)
    return min(1.0, distinct / (q_len * k))


def pool_pages(fmt, hkv, batch, context, pool_gb=8.0):
    """Pages the block tables draw from: a pool of pool_gb GB (at least 4096 pages), at most one page per block."""
    return min(batch * context // 128, max(4096, int(pool_gb * 1e9 // (block_bytes(fmt) * hkv))))


def make_inputs(rng, fmt, hq, hkv, batch, context, q_len, rotations, pool_pages):
    max_blocks = context // 128
    block_table = rng.integers(0, pool_pages, (batch, max_blocks)).astype(np.int32)
    seq = np.full(batch, context, np.int32)
    cache = jax_msa.allocate_cache(fmt, pool_pages, hkv, D)
    # random content without a host round trip: random bytes, with FP8/NVFP4 NaN codes cleared
    key = jax.random.PRNGKey(0)
    if fmt == KVFormat.BF16:
        cache = jax.random.normal(key, cache.shape, jnp.bfloat16)
    else:
        raw32 = jax.random.bits(key, cache.shape[:-1] + (cache.shape[-1] // 4,), jnp.uint32)  # uint8 bits would
        raw = jax.lax.bitcast_convert_type(raw32, jnp.uint8).reshape(cache.shape)  # draw 4x the memory
        raw = raw & jnp.uint8(0x77)  # no e4m3 NaN codes, moderate exponents
        cache = raw if fmt == KVFormat.NVFP4 else jax.lax.bitcast_convert_type(raw, jnp.float8_e4m3fn)
    t = batch * q_len
    q = jax.random.normal(jax.random.PRNGKey(1), (t, hq, D), jnp.bfloat16)
    topks = []
    for _ in range(rotations):  # the local block + 15 distinct earlier blocks per (head, token)
        pos = context - q_len + np.arange(t) % q_len
        local = pos // 128
        n_prev = int(local.min())
        picks = np.argpartition(rng.random((hkv * t, n_prev)), K - 1, axis=1)[:, : K - 1]
        ids = np.concatenate([np.tile(local, hkv)[:, None], picks], axis=1).reshape(hkv, t, K)
        topks.append(jnp.asarray(ids.astype(np.int32)))
    return q, cache, topks, jnp.asarray(seq), jnp.asarray(block_table)


def bench_case(fmt, hq, hkv, batch, context, q_len, repeats, pool_gb=8.0, splits=None, outputs="stacked"):
    rng = np.random.default_rng(0)
    per_call = batch * q_len * hkv * K * block_bytes(fmt)
    rotations = int(min(64, max(8, math.ceil(200e6 / per_call))))
    q, cache, topks, seq, bt = make_inputs(rng, fmt, hq, hkv, batch, context, q_len, rotations,
                                           pool_pages(fmt, hkv, batch, context, pool_gb))
    scales = {} if fmt == KVFormat.BF16 else dict(k_scale=jnp.float32(0.5), v_scale=jnp.float32(0.5))

    @jax.jit
    def run(q, cache, topks, seq, bt):
        outs = [jax_msa.sparse_decode(q, cache, topk, seq_lens=seq, block_table=bt, decode_query_len=q_len,
                                      impl="kernel", num_splits=splits, **scales) for topk in topks]
        # one output array by default: returned as R arrays ("list", as before 2026-12-06), the runtime's work on each
        # output array adds ~4 us a call (H200, 64/4 B = 1 FP8: 15.3 us a call against 10.9), the benchmark's, not the
        # layer's
        return jnp.stack(outs) if outputs == "stacked" else outs

    med, p10, p90 = median_p10_p90(run, (q, cache, topks, seq, bt), repeats)
    us = med / rotations * 1e6
    return dict(us=us, p10=p10 / rotations * 1e6, p90=p90 / rotations * 1e6, bytes=per_call,
                tbps=per_call / (us * 1e-6) / 1e12, distinct=distinct_block_fraction(context, q_len))


def bench_dense(hq, hkv, batch, context, repeats):
    """Dense cuDNN attention over the whole context, q_len = 1."""
    if batch * context * hkv * D * 2 * 2 > 40e9:
        return None
    key = jax.random.PRNGKey(2)
    q = jax.random.normal(key, (batch, 1, hq, D), jnp.bfloat16)
    k = jax.random.normal(key, (batch, context, hkv, D), jnp.bfloat16)
    v = jax.random.normal(key, (batch, context, hkv, D), jnp.bfloat16)
    f = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"))
    try:
        med, _, _ = median_p10_p90(f, (q, k, v), repeats)
    except Exception as e:  # cuDNN may refuse a shape; report it rather than fail the sweep
        print(f"  dense cuDNN failed for B={batch} ctx={context}: {type(e).__name__}: {e}"[:200])
        return None
    return med * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--heads", help="only these heads, e.g. 64/4")
    ap.add_argument("--batch", type=int, help="only this batch")
    ap.add_argument("--context", type=int, help="only this context")
    ap.add_argument("--q-len", type=int, help="only this decode_query_len")
    ap.add_argument("--fmt", help="only this format (BF16, FP8, NVFP4)")
    ap.add_argument("--no-dense", action="store_true", help="skip the dense cuDNN comparison")
    ap.add_argument("--pool-gb", type=float, default=8.0,
                    help="size of the page pool the block tables draw from (GB; the spread of the reads)")
    ap.add_argument("--outputs", choices=("stacked", "list"), default="stacked",
                    help="the program's R outputs as one stacked array (default) or as R arrays (the runtime's "
                         "per-array work then adds to the per-call time)")
    ap.add_argument("--splits", type=int,
                    help="the CUDA decode's split-K factor (sparse_decode's num_splits; default: the split rule)")
    args = ap.parse_args()
    print(f"devices: {jax.devices()} ({jax.devices()[0].device_kind}; fractions are of the H200's 4.3 TB/s, see "
          f"ceilings.py)  jax_msa CUDA: {jax_msa.cuda_available()} archs {jax_msa.cuda_archs()}")
    heads = [(64, 4), (16, 1)]
    batches = [1, 32, 256]
    contexts = [32768, 131072]
    q_lens = [1, 4]
    fmts = list(KVFormat)
    if args.quick:
        contexts, q_lens = [32768], [1]
    if args.heads:
        heads = [tuple(int(x) for x in args.heads.split("/"))]
    if args.batch:
        batches = [args.batch]
    if args.context:
        if args.context < (K + 1) * 128:  # the local block plus K - 1 distinct earlier ones
            raise SystemExit(f"--context must be at least {(K + 1) * 128} tokens (top-{K} of earlier blocks)")
        contexts = [args.context]
    if args.q_len:
        q_lens = [args.q_len]
    if args.fmt:
        fmts = [KVFormat[args.fmt]]
    rows = []
    dense_cache = {}
    for hq, hkv in heads:
        for batch in batches:
            for context in contexts:
                if args.no_dense:
                    dense_cache[(hq, hkv, batch, context)] = None
                if (hq, hkv, batch, context) not in dense_cache:
                    dense_cache[(hq, hkv, batch, context)] = bench_dense(hq, hkv, batch, context, args.repeats)
                dense = dense_cache[(hq, hkv, batch, context)]
                for q_len in q_lens:
                    for fmt in fmts:
                        r = bench_case(fmt, hq, hkv, batch, context, q_len, args.repeats, args.pool_gb, args.splits,
                                       args.outputs)
                        speedup = f"{dense / r['us']:.1f}x" if (dense and q_len == 1) else "-"
                        row = (f"| {hq}/{hkv} | {batch} | {context // 1024}k | {q_len} | {fmt.name} | "
                               f"{r['us']:.1f} | {r['p10']:.1f}-{r['p90']:.1f} | {r['bytes'] / 1e6:.2f} | "
                               f"{r['tbps']:.2f} | {100 * r['tbps'] * 1e12 / HBM:.0f}% | "
                               f"{100 * r['distinct'] * r['tbps'] * 1e12 / HBM:.0f}% | "
                               f"{'-' if dense is None or q_len != 1 else f'{dense:.1f}'} | {speedup} |")
                        print(row, flush=True)
                        rows.append(row)
    print("\n| heads | B | context | q_len | format | us/call (median) | p10-p90 | MB read | TB/s | of 4.3 TB/s "
          "| distinct blocks, of 4.3 TB/s | dense cuDNN us | speed-up |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
