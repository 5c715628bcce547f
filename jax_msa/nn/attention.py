"""MSAAttention: one MiniMax-M3 attention layer as a flax.nnx module over a paged KV cache.

    x [T, hidden] --q/k/v_proj--> per-head RMSNorm on q, k --> partial NeoX RoPE (first rotary_dim dims)
      --> jax_msa.write_kv (K after RoPE, V) into the paged cache
      sparse layer: index q/k projections, their own RMSNorm and RoPE --> index keys into the index cache
                    --> indexer (top-k blocks, local block forced) --> jax_msa.sparse_attention (prefill)
                    or jax_msa.sparse_decode (decode)
      dense layer (layers 0-2): causal GQA with jax.nn.dot_product_attention over the same paged cache
      --> o_proj --> y [T, hidden]

The module holds weights only. Caches and batch metadata go in and the updated caches come out, so a
jitted step can donate them. Projections run in bf16 (bf16 weights and activations as served); norms and
RoPE in fp32; q, K and V are rounded to bf16 for the cache and the attention ops.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

import jax_msa
from jax_msa import _query_chunks, _validation
from jax_msa.nn.batch import PagedBatch
from jax_msa.nn.config import M3AttentionConfig
from jax_msa.nn.dense_attention import dense_paged_attention
from jax_msa.nn.index_cache import write_index_keys
from jax_msa.nn.indexer import indexer_decode, indexer_prefill
from jax_msa.nn.norm import HeadRMSNorm
from jax_msa.nn.rope import apply_partial_rope, rope_cos_sin


def _linear(n_in, n_out, param_dtype, rngs):
    return nnx.Linear(n_in, n_out, use_bias=False, dtype=jnp.bfloat16, param_dtype=param_dtype,
                      kernel_init=nnx.initializers.normal(stddev=n_in**-0.5), rngs=rngs)


class MSAAttention(nnx.Module):
    """One M3 attention layer. ``dense=True``: a dense causal GQA layer (no indexer weights).
    ``param_dtype``: the weights' dtype (bf16 as served). ``impl`` is passed to the jax_msa ops
    (``"auto"``: the platform's kernel where there is one, else the jnp reference). ``query_chunk_size``: a
    prefill step runs its tokens in windows of at most that many (``jax_msa.sparse_attention``), which bounds the
    attention's partial workspace (None: one window). ``decode_num_splits``: a decode step's split-K factor
    (``jax_msa.sparse_decode``'s ``num_splits``; None: the split rule), fixed for outputs that do not depend on the
    batch."""

    def __init__(self, config: M3AttentionConfig, *, dense: bool = False, rngs: nnx.Rngs,
                 param_dtype=jnp.bfloat16, impl: str = "auto", query_chunk_size: int | None = None,
                 decode_num_splits: int | None = None):
        c = config
        self.config = c
        self.dense = dense
        self.impl = impl
        self.query_chunk_size = _query_chunks.check_chunk_size(query_chunk_size)
        self.decode_num_splits = _validation.check_num_splits(decode_num_splits)
        self.q_proj = _linear(c.hidden_size, c.num_q_heads * c.head_dim, param_dtype, rngs)
        self.k_proj = _linear(c.hidden_size, c.num_kv_heads * c.head_dim, param_dtype, rngs)
        self.v_proj = _linear(c.hidden_size, c.num_kv_heads * c.head_dim, param_dtype, rngs)
        self.o_proj = _linear(c.num_q_heads * c.head_dim, c.hidden_size, param_dtype, rngs)
        self.q_norm = HeadRMSNorm(c.head_dim, c.rms_norm_eps, param_dtype=param_dtype)
        self.k_norm = HeadRMSNorm(c.head_dim, c.rms_norm_eps, param_dtype=param_dtype)
        if not dense:
            self.index_q_proj = _linear(c.hidden_size, c.num_index_heads * c.index_head_dim, param_dtype, rngs)
            self.index_k_proj = _linear(c.hidden_size, c.index_head_dim, param_dtype, rngs)
            self.index_q_norm = HeadRMSNorm(c.index_head_dim, c.rms_norm_eps, param_dtype=param_dtype)
            self.index_k_norm = HeadRMSNorm(c.index_head_dim, c.rms_norm_eps, param_dtype=param_dtype)

    def _heads(self, proj, norm, x, num_heads, head_dim, cos, sin):
        y = proj(x.astype(jnp.bfloat16)).reshape(x.shape[0], num_heads, head_dim)
        return apply_partial_rope(norm(y), cos, sin, self.config.rotary_dim)  # fp32

    def index_queries_keys(self, x, cos, sin):
        """(q_idx [T, Hidx, Didx], k_idx [T, Didx]) fp32, after their RMSNorm and RoPE."""
        c = self.config
        q_idx = self._heads(self.index_q_proj, self.index_q_norm, x, c.num_index_heads, c.index_head_dim, cos, sin)
        k_idx = self._heads(self.index_k_proj, self.index_k_norm, x, 1, c.index_head_dim, cos, sin)[:, 0]
        return q_idx, k_idx

    def select_blocks(self, q_idx, index_cache, batch: PagedBatch):
        """topk [Hkv, T, K] int32 from the indexer (index cache already holding this step's keys)."""
        c = self.config
        common = dict(seq_lens=batch.seq_lens, block_table=batch.block_table, topk=c.topk,
                      num_init_blocks=c.num_init_blocks)
        if batch.is_decode:
            return indexer_decode(q_idx, index_cache, decode_query_len=batch.decode_query_len, **common)
        return indexer_prefill(q_idx, index_cache, cu_seqlens_q=batch.cu_seqlens_q, **common)

    def __call__(self, x, kv_cache, index_cache, batch: PagedBatch, *, return_topk: bool = False):
        """x [T, hidden] -> (y [T, hidden] bf16, kv_cache, index_cache[, topk]).

        kv_cache: bf16 [pages, Hkv, 128, 2*head_dim]; index_cache: bf16 [pages, 1, 128, index_head_dim]
        (``None`` for a dense layer; returned unchanged). ``return_topk`` adds the indexer's selection
        (``None`` for a dense layer)."""
        c = self.config
        t = x.shape[0]
        if batch.is_decode and t != batch.seq_lens.shape[0] * batch.decode_query_len:
            # decode has no padding rows: a row past B * decode_query_len would take the last request's slot
            raise ValueError(f"a decode step's x must be [B * decode_query_len, hidden] = "
                             f"[{batch.seq_lens.shape[0] * batch.decode_query_len}, {c.hidden_size}]; got {tuple(x.shape)}")
        req, pos, in_batch = batch.token_positions(t)
        slots = batch.slot_mapping(t)
        cos, sin = rope_cos_sin(pos, c.rotary_dim, c.rope_theta)
        q = self._heads(self.q_proj, self.q_norm, x, c.num_q_heads, c.head_dim, cos, sin).astype(jnp.bfloat16)
        k = self._heads(self.k_proj, self.k_norm, x, c.num_kv_heads, c.head_dim, cos, sin).astype(jnp.bfloat16)
        v = self.v_proj(x.astype(jnp.bfloat16)).reshape(t, c.num_kv_heads, c.head_dim)
        kv_cache = jax_msa.write_kv(kv_cache, k, v, slots, impl=self.impl)
        topk = None
        if self.dense:
            out = dense_paged_attention(q, kv_cache, req=req, pos=pos, in_batch=in_batch, seq_lens=batch.seq_lens,
                                        block_table=batch.block_table, scale=c.softmax_scale)
        else:
            q_idx, k_idx = self.index_queries_keys(x, cos, sin)
            index_cache = write_index_keys(index_cache, k_idx, slots)
            topk = self.select_blocks(q_idx, index_cache, batch)
            common = dict(seq_lens=batch.seq_lens, block_table=batch.block_table, scale=c.softmax_scale,
                          impl=self.impl)
            if batch.is_decode:
                out = jax_msa.sparse_decode(q, kv_cache, topk, decode_query_len=batch.decode_query_len,
                                            num_splits=self.decode_num_splits, **common)
            else:
                out = jax_msa.sparse_attention(q, kv_cache, topk, cu_seqlens_q=batch.cu_seqlens_q,
                                               query_chunk_size=self.query_chunk_size, **common)
        y = self.o_proj(out.reshape(t, c.num_q_heads * c.head_dim).astype(jnp.bfloat16))
        if return_topk:
            return y, kv_cache, index_cache, topk
        return y, kv_cache, index_cache
