"""Serve a small random-weight stack of MiniMax-M3 attention layers with jax_msa.nn: a page allocator, one
batched varlen prefill of prompts of different lengths, then greedy decode steps with decode_query_len 1
and with 3 speculative tokens (decode_query_len 4), every step jitted. Reports tokens/s per phase and the
split of one layer's time between the indexer and the attention op.

    python examples/serve_m3_layer.py --small     # CPU: 16/1 heads (M3 at TP4), head_dim 128, < 1 minute
    python examples/serve_m3_layer.py             # M3 per-layer geometry: hidden 6144, 64/4 heads (GPU-sized)
    python examples/serve_m3_layer.py --prompts 32768,4000,1000   # long prompts (H200)

The stack is attention only: x <- x + MSAAttention(rms_norm(x)) per layer (layers [0, num_dense_layers)
dense, the rest MSA), with a tied random embedding as input and greedy head. Speculative steps accept
every draft token (the verifier is not part of this example): they measure the q_len 4 decode path.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jax_msa
from jax_msa.kv_cache import PAGE_SIZE
from jax_msa.nn import M3AttentionConfig, MSAAttention, PagedBatch, allocate_index_cache
from jax_msa.nn.norm import rms_norm
from jax_msa.nn.rope import rope_cos_sin


class PageAllocator:
    """Free-list allocator of cache pages; one block table row per request (-1 = no page)."""

    def __init__(self, num_pages: int, num_requests: int, max_blocks: int):
        self.free = list(range(num_pages - 1, -1, -1))
        self.block_table = np.full((num_requests, max_blocks), -1, np.int32)
        self.num_blocks = np.zeros(num_requests, np.int64)

    def reserve(self, request: int, num_tokens: int) -> None:
        """Makes sure the request has pages for its first num_tokens tokens."""
        need = -(-num_tokens // PAGE_SIZE)
        while self.num_blocks[request] < need:
            if not self.free:
                raise MemoryError("out of cache pages")
            self.block_table[request, self.num_blocks[request]] = self.free.pop()
            self.num_blocks[request] += 1

    def release(self, request: int) -> None:
        self.free.extend(int(p) for p in self.block_table[request, :self.num_blocks[request]])
        self.block_table[request] = -1
        self.num_blocks[request] = 0


class M3AttentionStack(nnx.Module):
    def __init__(self, config: M3AttentionConfig, num_layers: int, vocab: int, *, rngs: nnx.Rngs,
                 query_chunk_size: int | None = None, decode_num_splits: int | None = None):
        self.config = config
        self.embed = nnx.Param(jax.random.normal(rngs.params(), (vocab, config.hidden_size), jnp.bfloat16))
        self.layers = nnx.List([MSAAttention(config, dense=config.is_dense_layer(i), rngs=rngs,
                                             query_chunk_size=query_chunk_size, decode_num_splits=decode_num_splits)
                                for i in range(num_layers)])

    def __call__(self, tokens, caches, batch: PagedBatch):
        """tokens [T] -> (next-token guesses [T], caches); caches: list of (kv_cache, index_cache)."""
        emb = self.embed[...]
        x = emb[tokens].astype(jnp.float32)
        new_caches = []
        for layer, (kv, ic) in zip(self.layers, caches):
            y, kv, ic = layer(rms_norm(x, jnp.ones((x.shape[-1],)), self.config.rms_norm_eps), kv, ic, batch)
            x = x + y.astype(jnp.float32)
            new_caches.append((kv, ic))
        logits = jnp.dot(x.astype(jnp.bfloat16), emb.T, preferred_element_type=jnp.float32)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), new_caches


def timed(fn, *args, repeat=1):
    """(result of the last call, median seconds per call); fn is compiled already."""
    times, out = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return out, float(np.median(times))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="CPU-sized: hidden 512, 16/1 heads, top-4, 3 layers")
    parser.add_argument("--steps", type=int, default=4, help="decode steps per phase")
    parser.add_argument("--prompts", help="comma-separated prompt lengths (default: 150,420,700 small, "
                                          "1000,3000,5000 otherwise)")
    parser.add_argument("--query-chunk", type=int, help="prefill attention in windows of at most this many tokens "
                                                           "(bounds its partial workspace; results unchanged)")
    parser.add_argument("--decode-splits", type=int, help="fixed split-K factor of the CUDA decode (batch-invariant "
                                                          "outputs; default: the split rule)")
    args = parser.parse_args()
    if args.small:
        cfg = M3AttentionConfig(hidden_size=512, num_q_heads=16, num_kv_heads=1, num_index_heads=1, topk=4,
                                num_dense_layers=1)
        num_layers, prompts, vocab = 3, [150, 420, 700], 512
    else:
        cfg = M3AttentionConfig(num_dense_layers=1)  # M3 per-layer shapes; 1 dense + 3 MSA layers
        num_layers, prompts, vocab = 4, [1000, 3000, 5000], 4096
    if args.prompts:
        prompts = [int(x) for x in args.prompts.split(",")]
    spec = 3
    b = len(prompts)
    max_len = max(prompts) + args.steps * (2 + spec)
    max_blocks = -(-max_len // PAGE_SIZE)
    num_pages = b * max_blocks + 4
    print(f"jax {jax.__version__} on {jax.default_backend()}; {num_layers} layers ({cfg.num_dense_layers} dense), "
          f"hidden {cfg.hidden_size}, heads {cfg.num_q_heads}/{cfg.num_kv_heads} x {cfg.head_dim}, index "
          f"{cfg.num_index_heads} x {cfg.index_head_dim}, top-{cfg.topk}; prompts {prompts}; {num_pages} pages")

    model = M3AttentionStack(cfg, num_layers, vocab, rngs=nnx.Rngs(0), query_chunk_size=args.query_chunk,
                              decode_num_splits=args.decode_splits)
    graphdef, state = nnx.split(model)
    caches = [(jax_msa.allocate_cache(jax_msa.KVFormat.BF16, num_pages, cfg.num_kv_heads, cfg.head_dim),
               None if layer.dense else allocate_index_cache(num_pages, cfg.index_head_dim))
              for layer in model.layers]

    def run_stack(state, tokens, caches, batch):
        return nnx.merge(graphdef, state)(tokens, caches, batch)

    step = jax.jit(run_stack, donate_argnums=(2,))  # the caches are updated in place
    alloc = PageAllocator(num_pages, b, max_blocks)
    rng = np.random.default_rng(0)
    seq_lens = np.array(prompts, np.int32)
    for r, n in enumerate(prompts):
        alloc.reserve(r, n)

    # Prefill: one varlen batch of all prompts.
    tokens = jnp.asarray(rng.integers(0, vocab, sum(prompts)), jnp.int32)
    cu = np.concatenate([[0], np.cumsum(prompts)]).astype(np.int32)
    batch = PagedBatch.prefill(cu, seq_lens, alloc.block_table)
    start = time.perf_counter()
    compiled = step.lower(state, tokens, caches, batch).compile()
    compile_s = time.perf_counter() - start
    (next_tok, caches), prefill_s = timed(compiled, state, tokens, caches, batch)
    last = np.asarray(next_tok)[cu[1:] - 1]
    print(f"prefill  {sum(prompts):6d} tokens  {prefill_s * 1e3:8.1f} ms  {sum(prompts) / prefill_s:9.0f} tok/s"
          f"  (compile {compile_s:.1f} s)")

    # Decode: q_len 1, then 1 + 3 speculative tokens (drafts random; all accepted).
    for q_len in (1, 1 + spec):
        compiled, total_s, made = None, 0.0, 0
        for _ in range(args.steps):
            drafts = rng.integers(0, vocab, (b, q_len - 1))
            tokens = jnp.asarray(np.concatenate([last[:, None], drafts], axis=1).reshape(-1), jnp.int32)
            seq_lens = seq_lens + q_len
            for r in range(b):
                alloc.reserve(r, int(seq_lens[r]))
            batch = PagedBatch.decode(seq_lens, alloc.block_table, decode_query_len=q_len)
            if compiled is None:
                start = time.perf_counter()
                compiled = step.lower(state, tokens, caches, batch).compile()
                compile_s = time.perf_counter() - start
            (next_tok, caches), s = timed(compiled, state, tokens, caches, batch)
            last = np.asarray(next_tok).reshape(b, q_len)[:, -1]
            total_s += s
            made += b * q_len
        print(f"decode q_len {q_len}: {args.steps} steps x {b} requests  {total_s / args.steps * 1e3:8.1f} ms/step  "
              f"{made / total_s:9.0f} tok/s  (compile {compile_s:.1f} s)")

    report_split(model, cfg, caches, alloc, seq_lens, prompts, rng)
    for r in range(b):
        alloc.release(r)
    assert len(alloc.free) == num_pages


def report_split(model, cfg, caches, alloc, seq_lens, prompts, rng):
    """Time one MSA layer's indexer (index q/k projections, norms, RoPE, block selection) and its attention
    op separately, on the cache state the decode left: a prefill of the last len(prompt) tokens of every
    request (sparse_attention), and decode with q_len 1 and 4 (sparse_decode). The index-key write (a
    scatter of T rows) is left out of both."""
    layer_id = cfg.num_dense_layers
    layer = model.layers[layer_id]
    graphdef, state = nnx.split(layer)
    kv, ic = caches[layer_id]

    @jax.jit
    def indexer(state, x, ic, batch):
        m = nnx.merge(graphdef, state)
        _, pos, _ = batch.token_positions(x.shape[0])
        cos, sin = rope_cos_sin(pos, cfg.rotary_dim, cfg.rope_theta)
        q_idx, _ = m.index_queries_keys(x, cos, sin)
        return m.select_blocks(q_idx, ic, batch)

    @jax.jit
    def attention(q, kv, topk, batch):
        common = dict(seq_lens=batch.seq_lens, block_table=batch.block_table)
        if batch.is_decode:
            return jax_msa.sparse_decode(q, kv, topk, decode_query_len=batch.decode_query_len, **common)
        return jax_msa.sparse_attention(q, kv, topk, cu_seqlens_q=batch.cu_seqlens_q, **common)

    cu = np.concatenate([[0], np.cumsum(prompts)]).astype(np.int32)
    cases = [("prefill", PagedBatch.prefill(cu, seq_lens, alloc.block_table), int(cu[-1]))]
    cases += [(f"decode q_len {n}", PagedBatch.decode(seq_lens, alloc.block_table, decode_query_len=n),
               len(seq_lens) * n) for n in (1, 4)]
    for name, batch, t in cases:
        x = jnp.asarray(rng.standard_normal((t, cfg.hidden_size)), jnp.bfloat16)
        q = jnp.asarray(rng.standard_normal((t, cfg.num_q_heads, cfg.head_dim)), jnp.bfloat16)
        topk = indexer(state, x, ic, batch)
        attention(q, kv, topk, batch)  # compile
        repeat = 1 if name == "prefill" else 5  # after the compiling call above
        _, t_index = timed(indexer, state, x, ic, batch, repeat=repeat)
        _, t_attn = timed(attention, q, kv, topk, batch, repeat=repeat)
        share = t_index / (t_index + t_attn)
        print(f"split, one MSA layer, {name:15s}: indexer {t_index * 1e3:8.2f} ms, attention "
              f"{t_attn * 1e3:8.2f} ms  (indexer {share:.0%} of the two)")


if __name__ == "__main__":
    main()
