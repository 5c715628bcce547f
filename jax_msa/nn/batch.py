"""Where the tokens of one step sit: the paged-batch metadata every M3 attention layer of the step shares.

Prefill (and chunked prefill) packs a varlen batch: ``cu_seqlens_q [B+1]`` prefix sums of new tokens.
Decode has ``decode_query_len`` new tokens per request (1 + speculative tokens), uniform over the batch.
In both, ``seq_lens [B]`` counts the request's KV tokens with the new ones included, so token i of a
request with q_len new tokens sits at position ``seq_len - q_len + i`` (MSA.md section 2), and
``block_table [B, max_blocks]`` maps a request's logical block (= page) to its physical page.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_msa import reference
from jax_msa.kv_cache import PAGE_SIZE


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedBatch:
    seq_lens: jax.Array  # [B] int32
    block_table: jax.Array  # [B, max_blocks] int32
    cu_seqlens_q: jax.Array | None = None  # [B+1] int32 for prefill; None for decode
    decode_query_len: int = dataclasses.field(default=0, metadata=dict(static=True))  # > 0 for decode

    @classmethod
    def prefill(cls, cu_seqlens_q, seq_lens, block_table) -> "PagedBatch":
        return cls(jnp.asarray(seq_lens, jnp.int32), jnp.asarray(block_table, jnp.int32),
                   jnp.asarray(cu_seqlens_q, jnp.int32), 0)

    @classmethod
    def decode(cls, seq_lens, block_table, decode_query_len: int = 1) -> "PagedBatch":
        if decode_query_len < 1:
            raise ValueError(f"decode_query_len must be >= 1; got {decode_query_len}")
        return cls(jnp.asarray(seq_lens, jnp.int32), jnp.asarray(block_table, jnp.int32), None,
                   int(decode_query_len))

    @property
    def is_decode(self) -> bool:
        return self.decode_query_len > 0

    @property
    def max_blocks(self) -> int:
        return self.block_table.shape[1]

    def token_positions(self, total_q: int):
        """(request [T], request-local position [T], in_batch [T] bool) of the step's query tokens.
        Tokens past cu_seqlens_q[-1] (padding) are not in the batch."""
        if self.is_decode:
            return reference.decode_positions(self.seq_lens, self.decode_query_len, total_q)
        return reference.prefill_positions(self.cu_seqlens_q, self.seq_lens, total_q)

    def slot_mapping(self, total_q: int):
        """[T] int32 cache slots (page * 128 + offset) of the new tokens; -1 (skipped) for padding tokens
        and tokens whose block has no valid page in the block table."""
        req, pos, in_batch = self.token_positions(total_q)
        blk = jnp.clip(pos // PAGE_SIZE, 0, self.max_blocks - 1)
        page = self.block_table[req, blk]
        ok = in_batch & (pos >= 0) & (pos // PAGE_SIZE < self.max_blocks) & (page >= 0)
        return jnp.where(ok, page * PAGE_SIZE + pos % PAGE_SIZE, -1).astype(jnp.int32)
