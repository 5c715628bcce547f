"""Benchmark of jax_msa.sparse_attention (prefill) on the GPU, M3 shapes, against dense cuDNN attention.

One request of N new tokens (no prefix), heads Hq/Hkv, top-16 per (token, KV head): the local block plus 15
earlier blocks drawn from a mix of popular picks (a few blocks many queries choose) and uniform picks. The plan
(jnp, jitted) and the kernels are timed separately, medians over repeats (`timing.median_p10_p90`).

Useful TFLOP/s = 4 * D * Hq * sum_t |S(t)| / time (masked keys not counted), against 790 TFLOP/s.

    python examples/bench/bench_prefill.py --quick          # 32k, 64/4 and 16/1
    python examples/bench/bench_prefill.py                  # 8k, 32k, 128k
    python examples/bench/bench_prefill.py --tokens 2048 --heads 16/1 --no-dense   # a small run (CPU too)
    python examples/bench/bench_prefill.py --quick --no-dense --work-order size --work-order token --work-order row
    python examples/bench/bench_prefill.py --tokens 32768 --heads 64/4 --no-dense \
        --partial-order natural --partial-order fragment      # the sm90 partials' column order (default: fragment)
"""

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

import jax_msa
from jax_msa.plan import default_queries_per_tile
from timing import median_p10_p90

D, K = 128, 16
PEAK = 790e12


def make_topk(rng, n, hkv):
    blocks = -(-n // 128)
    local = np.arange(n) // 128
    popular = rng.choice(blocks, size=min(8, blocks), replace=False)
    ids = np.full((hkv, n, K), -1, np.int32)
    for g in range(hkv):
        ids[g, :, 0] = local
        for t0 in range(0, n, 128):  # tokens of one block share the candidate range [0, local)
            loc = local[t0]
            if loc == 0:
                continue
            rows = slice(t0, min(n, t0 + 128))
            cnt = rows.stop - rows.start
            want = min(K - 1, loc)
            pop = popular[popular < loc]
            picks = np.stack([rng.permutation(np.unique(np.concatenate([pop[: want // 2],
                                                                        rng.choice(loc, want, replace=False)])))[:want]
                              for _ in range(cnt)])
            ids[g, rows, 1:1 + picks.shape[1]] = picks
    return ids


def selected_keys(ids, n):
    """sum over tokens of |S(t)| for one KV head (set semantics, causal)."""
    pos = np.arange(n)
    total = 0
    for t in range(n):
        blocks = {int(b) for b in ids[t] if 0 <= b <= pos[t] // 128}
        total += sum(min(128, pos[t] - 128 * b + 1) for b in blocks)
    return total


def useful_flops(topk_np, n, hq):
    """4 * D * Hq * (selected causal keys per KV head, averaged over the KV heads)."""
    hkv = topk_np.shape[0]
    return 4 * D * hq * (sum(selected_keys(topk_np[g], n) for g in range(hkv)) // hkv)


def make_cache(fmt, blocks, hkv):
    """A cache of random keys and values in `fmt` (FP8 / NVFP4 written with scales 1)."""
    if fmt == "BF16":
        return jax.random.normal(jax.random.PRNGKey(1), (blocks, hkv, 128, 2 * D), jnp.bfloat16)
    k, v = jax.random.normal(jax.random.PRNGKey(1), (2, blocks * 128, hkv, D), jnp.bfloat16)
    cache = jax_msa.allocate_cache(jax_msa.KVFormat[fmt], blocks, hkv, D)
    return jax.jit(jax_msa.write_kv)(cache, k, v, jnp.arange(blocks * 128, dtype=jnp.int32))


def make_inputs(n, hq, hkv, fmt="BF16"):
    """The benchmark's problem: one request of n new tokens over a contiguous cache of random keys and values in `fmt`,
    random bf16 queries and make_topk's selection (seed 0). Returns topk_np (the [hkv, n, K] numpy ids) and the call's
    array arguments (q, cache, topk, cu_seqlens_q, seq_lens, block_table)."""
    blocks = -(-n // 128)
    topk_np = make_topk(np.random.default_rng(0), n, hkv)
    q = jax.random.normal(jax.random.PRNGKey(0), (n, hq, D), jnp.bfloat16)
    cache = make_cache(fmt, blocks, hkv)
    cu, seq = jnp.asarray([0, n], jnp.int32), jnp.asarray([n], jnp.int32)
    bt = jnp.arange(blocks, dtype=jnp.int32)[None]
    return topk_np, (q, cache, jnp.asarray(topk_np), cu, seq, bt)


def temp_gb(fn, args):
    """XLA's temporary buffers of the compiled fn (the partial workspace among them), GB; None if not reported."""
    try:
        return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes / 1e9
    except Exception:  # noqa: BLE001 (a backend without memory analysis)
        return None


def bench(n, hq, hkv, repeats, dense, fmt="BF16", work_order="row", partial_order=None, query_chunk=None):
    blocks = -(-n // 128)
    topk_np, (q, cache, topk, cu, seq, bt) = make_inputs(n, hq, hkv, fmt)
    qpt = default_queries_per_tile(hq, hkv)
    plan_fn = jax.jit(lambda t, c, s: jax_msa.build_prefill_plan(t, c, s, max_blocks=blocks, queries_per_tile=qpt,
                                                                 work_order=work_order))
    # read by the sm90 host code when the call runs: set before this fresh jitted function first runs (XLA's command
    # buffer records the launches of that first run); without --partial-order the environment is left as it is
    if partial_order is not None:
        os.environ["JAX_MSA_PARTIAL_FRAGMENT_ORDER"] = "1" if partial_order == "fragment" else "0"
    plan = plan_fn(topk, cu, seq)
    p_med, p_lo, p_hi = median_p10_p90(plan_fn, (topk, cu, seq), repeats)
    if query_chunk is None:
        attn = jax.jit(lambda q, c, t, cu, s, b, p: jax_msa.sparse_attention(
            q, c, t, cu_seqlens_q=cu, seq_lens=s, block_table=b, plan=p, impl="kernel"))
        args = (q, cache, topk, cu, seq, bt, plan)
    else:  # the prompt in windows of query_chunk tokens, each with its own plan (timed with the kernels)
        attn = jax.jit(lambda q, c, t, cu, s, b: jax_msa.sparse_attention(
            q, c, t, cu_seqlens_q=cu, seq_lens=s, block_table=b, impl="kernel", query_chunk_size=query_chunk))
        args = (q, cache, topk, cu, seq, bt)
    k_med, k_lo, k_hi = median_p10_p90(attn, args, repeats)
    temp = temp_gb(attn, args)
    flops = useful_flops(topk_np, n, hq)
    label = ", ".join([fmt] + ([f"{work_order} order"] if work_order != "row" else [])
                      + (["fragment-order partials"] if partial_order == "fragment" else [])
                      + ([f"windows of {query_chunk} tokens, plans included"] if query_chunk else []))
    row = (f"| {n // 1024}k | {hq}/{hkv} | {label} | {p_med * 1e3:.2f} ({p_lo * 1e3:.2f}-{p_hi * 1e3:.2f}) | "
           f"{k_med * 1e3:.2f} ({k_lo * 1e3:.2f}-{k_hi * 1e3:.2f}) | {flops / k_med / 1e12:.1f} | "
           f"{100 * flops / k_med / PEAK:.1f}% | {'-' if query_chunk else f'{100 * p_med / k_med:.1f}%'} | "
           f"{'-' if temp is None else f'{temp:.2f}'} |")
    if dense:
        qd = q[None]
        kd = jax.random.normal(jax.random.PRNGKey(2), (1, n, hkv, D), jnp.bfloat16)
        f = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"))
        try:
            d_med, _, _ = median_p10_p90(f, (qd, kd, kd), repeats)
            row += f" {d_med * 1e3:.2f} | {d_med / k_med:.1f}x |"
        except Exception as e:  # cuDNN may refuse a shape: report, do not fail the sweep
            row += f" failed: {type(e).__name__} | - |"
    else:
        row += " - | - |"
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tokens", type=int, action="append")
    ap.add_argument("--heads", action="append")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--no-dense", action="store_true")
    ap.add_argument("--pipelined", action="store_true",
                    help="the opt-in persistent pipelined bf16 warp-MMA kernel (JAX_MSA_PREFILL_PIPELINED=1)")
    ap.add_argument("--fmt", action="append", choices=["BF16", "FP8", "NVFP4"], help="KV format(s), default BF16")
    ap.add_argument("--work-order", action="append", choices=["size", "token", "row"],
                    help="the plan's work order(s) (build_prefill_plan(work_order=...)), default row")
    ap.add_argument("--partial-order", action="append", choices=["natural", "fragment"],
                    help="column order of the sm90 kernel's bf16 partials (JAX_MSA_PARTIAL_FRAGMENT_ORDER=0: natural; "
                         "only calls the sm90 wgmma kernel serves); default: as the environment says (fragment)")
    ap.add_argument("--query-chunk", type=int, action="append",
                    help="also time sparse_attention(query_chunk_size=N): the prompt in windows of N tokens, each "
                         "with its own plan (timed with the kernels) and workspace")
    a = ap.parse_args()
    if a.pipelined:  # read by the CUDA handler at its first call
        os.environ["JAX_MSA_PREFILL_PIPELINED"] = "1"
    saved_partial_order = os.environ.get("JAX_MSA_PARTIAL_FRAGMENT_ORDER")  # --partial-order changes it per row
    tokens = a.tokens or ([32768] if a.quick else [8192, 32768, 131072])
    heads = [tuple(int(x) for x in h.split("/")) for h in (a.heads or ["64/4", "16/1"])]
    print(f"devices {jax.devices()} ({jax.devices()[0].device_kind}; fractions are of the H200's 790 TFLOP/s, "
          f"see ceilings.py)  CUDA targets {sorted(jax_msa._ffi.cuda_targets())}")
    print("| N | heads | KV | plan ms (p10-p90) | kernels ms (p10-p90) | useful TFLOP/s | of 790 | plan / kernels "
          "| XLA temp GB | dense cuDNN ms | speed-up |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n in tokens:
        for hq, hkv in heads:
            for fmt in a.fmt or ["BF16"]:
                for order in a.work_order or ["row"]:
                    for partial_order in a.partial_order or [None]:
                        print(bench(n, hq, hkv, a.repeats, not a.no_dense and fmt == "BF16", fmt, order,
                                    partial_order), flush=True)
                for chunk in a.query_chunk or []:  # default plans ("row") and partial order, as labelled
                    os.environ.pop("JAX_MSA_PARTIAL_FRAGMENT_ORDER", None)
                    if saved_partial_order is not None:
                        os.environ["JAX_MSA_PARTIAL_FRAGMENT_ORDER"] = saved_partial_order
                    print(bench(n, hq, hkv, a.repeats, False, fmt, query_chunk=chunk), flush=True)


if __name__ == "__main__":
    main()
