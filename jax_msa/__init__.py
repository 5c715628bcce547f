"""jax_msa: MiniMax-M3 sparse attention (MSA) for JAX.

Public API::

    jax_msa.sparse_attention(q, kv_cache, topk, *, cu_seqlens_q, seq_lens, block_table, ...)
    jax_msa.sparse_decode(q, kv_cache, topk, *, seq_lens, block_table, decode_query_len=1, ...)
    jax_msa.build_prefill_plan(topk, cu_seqlens_q, seq_lens, *, max_blocks, ...)
    jax_msa.write_kv(kv_cache, k, v, slot_mapping, ...)
    jax_msa.reference.*            # the pure-jnp oracle with the same signatures
    jax_msa.kv_cache.*             # formats: allocate, quantize, dequantize

The contract is MSA.md (semantics, layouts); see README.md.
"""

from jax_msa import kv_cache, reference
from jax_msa._ffi import cuda_archs, cuda_available
from jax_msa.kv_cache import KVFormat, allocate_cache
from jax_msa.ops import sparse_attention, sparse_decode, write_kv
from jax_msa.plan import PrefillPlan, build_prefill_plan

__version__ = "0.1.0"

__all__ = [
    "KVFormat", "PrefillPlan", "allocate_cache", "build_prefill_plan", "cuda_archs", "cuda_available",
    "kv_cache", "reference", "sparse_attention", "sparse_decode", "write_kv",
]
