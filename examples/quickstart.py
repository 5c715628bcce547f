"""jax_msa in one page: write a paged KV cache, run MSA prefill and one decode step, check against the reference.

Two requests, M3 shapes at TP4 (16 query heads over 1 KV head, head_dim 128, top-16 blocks of 128 tokens with the
query's own block forced): request 0 prefills a 300-token prompt; request 1 prefills the last 400-token chunk of a
2,500-token prompt whose first 2,100 tokens are already in the cache (chunked prefill). Then both decode one token.
A stand-in for M3's indexer draws random block scores, so request 1 really is sparse (20 blocks, 16 picked), while
request 0 selects all of its at most 3 blocks (the other slots are -1 holes).

    python examples/quickstart.py [--format bf16|fp8|nvfp4]

Runs on whatever backend JAX has (CPU, or a GPU with the CUDA handlers) and prints, per op, whether the jax_msa
kernel or the jnp reference ran (read off the compiled HLO) and its error against jax_msa.reference.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import jax_msa
from jax_msa import KVFormat

PAGE = 128  # tokens per page == tokens per sparse block
CONTEXT_LENS = (300, 2500)  # prompt tokens per request, all in the cache after the prefill step
CHUNK_LENS = (300, 400)  # new tokens per request in the prefill step (request 1: its last chunk)
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, TOPK = 16, 1, 128, 16
CUSTOM_CALLS = ("jax_msa_prefill", "jax_msa_prefill_window", "jax_msa_decode", "jax_msa_write_kv")


def stand_in_indexer(rng, positions, num_blocks, topk):
    """topk [Hkv, T, K] int32 for tokens at request-local `positions` whose requests have `num_blocks` blocks:
    random block scores over the causally visible blocks, the token's own block always kept, -1 past them."""
    width = int(num_blocks.max())
    block = np.arange(width)
    local = (positions // PAGE)[None, :, None]
    visible = (block <= local) & (block < num_blocks[None, :, None])
    scores = rng.uniform(size=(NUM_KV_HEADS, len(positions), width))
    scores = np.where(block == local, 2.0, np.where(visible, scores, -1.0))
    order = np.argsort(-scores, axis=-1, kind="stable")[..., :topk]
    ids = np.where(np.take_along_axis(scores, order, axis=-1) >= 0.0, order, -1)
    return np.pad(ids, ((0, 0), (0, 0), (0, topk - ids.shape[-1])), constant_values=-1).astype(np.int32)


def bf16_normal(rng, shape):
    return jnp.asarray(rng.standard_normal(shape, np.float32).astype(ml_dtypes.bfloat16))


def run_op(fn, reference_fn, *args):
    """jit-compiles fn and runs it once; returns (result, reference result, what ran, milliseconds)."""
    compiled = jax.jit(fn).lower(*args).compile()
    calls = [name for name in CUSTOM_CALLS if f'"{name}"' in compiled.as_text()]
    expected = jax.jit(reference_fn)(*args)
    start = time.perf_counter()
    got = jax.block_until_ready(compiled(*args))
    took = (time.perf_counter() - start) * 1e3
    ran = f"kernel {', '.join(calls)}" if calls else "jnp reference (no kernel here)"
    return got, expected, ran, took


def report_attention(name, ran, took, result, expected):
    (out, lse), (out_ref, lse_ref) = result, expected
    out, out_ref = np.asarray(out, np.float32), np.asarray(out_ref, np.float32)
    err = np.max(np.abs(out - out_ref))
    lse_err = np.max(np.abs(np.asarray(lse) - np.asarray(lse_ref)))
    print(f"{name:<16s} {ran:<34s} {took:8.1f} ms   max|out - ref| {err:.2e} (max|ref| {np.max(np.abs(out_ref)):.2f}),"
          f" max|lse - ref| {lse_err:.2e}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", choices=[f.name.lower() for f in KVFormat], default="bf16")
    fmt = KVFormat[parser.parse_args().format.upper()]
    rng = np.random.default_rng(0)
    print(f"jax {jax.__version__}, backend {jax.default_backend()} ({jax.devices()[0].device_kind}); jax_msa "
          f"{jax_msa.__version__}, CUDA handlers built: {jax_msa.cuda_available()} {jax_msa.cuda_archs()}")

    # ---- paged cache: request b owns ceil((prompt + 1) / 128) pages (room for the decode token), shuffled
    batch = len(CONTEXT_LENS)
    lens, chunks = np.array(CONTEXT_LENS, np.int32), np.array(CHUNK_LENS, np.int32)
    max_blocks = -(-(int(lens.max()) + 1) // PAGE)
    num_pages = batch * max_blocks
    block_table_np = rng.permutation(num_pages).reshape(batch, max_blocks).astype(np.int32)
    block_table = jnp.asarray(block_table_np)
    cache = jax_msa.allocate_cache(fmt, num_pages, NUM_KV_HEADS, HEAD_DIM)
    scales = {} if fmt == KVFormat.BF16 else dict(k_scale=jnp.float32(0.5), v_scale=jnp.float32(0.25))

    def slots_of(requests, positions):  # cache slot = page * 128 + offset
        return jnp.asarray(block_table_np[requests, positions // PAGE] * PAGE + positions % PAGE, jnp.int32)

    def write(cache, k, v, slots):
        return jax_msa.write_kv(cache, k, v, slots, **scales)

    def write_reference(cache, k, v, slots):
        return jax_msa.reference.write_kv(cache, k, v, slots, **scales)

    # ---- write_kv: K/V of every prompt token (earlier chunks and this step) into the cache
    kv_requests = np.repeat(np.arange(batch), lens)
    kv_positions = np.concatenate([np.arange(n) for n in lens])
    k = bf16_normal(rng, (len(kv_positions), NUM_KV_HEADS, HEAD_DIM))
    v = bf16_normal(rng, (len(kv_positions), NUM_KV_HEADS, HEAD_DIM))
    cache, cache_ref, ran, took = run_op(write, write_reference, cache, k, v, slots_of(kv_requests, kv_positions))
    differ = np.count_nonzero(np.asarray(cache).view(np.uint8) != np.asarray(cache_ref).view(np.uint8))
    print(f"{'write_kv':<16s} {ran:<34s} {took:8.1f} ms   bytes differing from the reference: {differ}")

    # ---- prefill of this step's tokens: cu_seqlens_q = [0, 300, 700], seq_lens = [300, 2500]
    requests = np.repeat(np.arange(batch), chunks)
    positions = np.concatenate([np.arange(n - c, n) for n, c in zip(lens, chunks)])
    q = bf16_normal(rng, (len(positions), NUM_Q_HEADS, HEAD_DIM))
    topk = stand_in_indexer(rng, positions, -(-lens[requests] // PAGE), TOPK)
    selected = np.sum(topk >= 0, axis=-1)
    print(f"prefill: new tokens {chunks.tolist()} of prompts {lens.tolist()}; Hq {NUM_Q_HEADS}, Hkv {NUM_KV_HEADS}, "
          f"D {HEAD_DIM}, top-{TOPK}; {fmt.name} cache of {num_pages} pages; blocks selected per token: mean "
          f"{selected.mean():.1f}, max {selected.max()}")
    prefill_kw = dict(cu_seqlens_q=jnp.asarray(np.concatenate([[0], np.cumsum(chunks)]), jnp.int32),
                      seq_lens=jnp.asarray(lens), block_table=block_table, return_lse=True, **scales)

    def prefill(q, cache, topk):
        return jax_msa.sparse_attention(q, cache, topk, **prefill_kw)

    def prefill_reference(q, cache, topk):
        return jax_msa.reference.sparse_attention(q, cache, topk, **prefill_kw)

    result, expected, ran, took = run_op(prefill, prefill_reference, q, cache, jnp.asarray(topk))
    report_attention("sparse_attention", ran, took, result, expected)

    # ---- one decode step: request b's new token sits at position lens[b]; its K/V is written first
    dec_requests, dec_positions = np.arange(batch), lens.copy()
    dk = bf16_normal(rng, (batch, NUM_KV_HEADS, HEAD_DIM))
    dv = bf16_normal(rng, (batch, NUM_KV_HEADS, HEAD_DIM))
    cache = jax.jit(write, donate_argnums=0)(cache, dk, dv, slots_of(dec_requests, dec_positions))
    dq = bf16_normal(rng, (batch, NUM_Q_HEADS, HEAD_DIM))
    dec_topk = stand_in_indexer(rng, dec_positions, -(-(lens + 1) // PAGE), TOPK)
    decode_kw = dict(seq_lens=jnp.asarray(lens + 1), block_table=block_table, decode_query_len=1,
                     return_lse=True, **scales)

    def decode(q, cache, topk):
        return jax_msa.sparse_decode(q, cache, topk, **decode_kw)

    def decode_reference(q, cache, topk):
        return jax_msa.reference.sparse_decode(q, cache, topk, **decode_kw)

    result, expected, ran, took = run_op(decode, decode_reference, dq, cache, jnp.asarray(dec_topk))
    report_attention("sparse_decode", ran, took, result, expected)


if __name__ == "__main__":
    main()
