"""jax_msa.nn: the MiniMax-M3 attention layer (flax.nnx) on top of the jax_msa ops.

    config.M3AttentionConfig      shapes and constants; from_hf_dict maps HF config keys (one place)
    batch.PagedBatch              a step's paged-batch metadata (positions, slots) shared by all layers
    norm / rope                   per-head RMSNorm, partial NeoX RoPE
    index_cache / indexer         the index-key paged cache; the MSA indexer (block scores, top-k)
    dense_attention               dense causal GQA over the paged cache (layers 0-2)
    attention.MSAAttention        the layer
    weights                       safetensors loading with HF tensor names

See docs/M3_LAYER.md. Needs flax and safetensors (the ``nn`` extra).
"""

from jax_msa.nn.attention import MSAAttention
from jax_msa.nn.batch import PagedBatch
from jax_msa.nn.config import HF_CONFIG_KEYS, M3AttentionConfig
from jax_msa.nn.index_cache import allocate_index_cache, write_index_keys
from jax_msa.nn.indexer import block_scores, indexer_decode, indexer_prefill, select_blocks
from jax_msa.nn.weights import HF_TENSOR_NAMES, attention_state_dict, load_attention_weights

__all__ = [
    "HF_CONFIG_KEYS", "HF_TENSOR_NAMES", "M3AttentionConfig", "MSAAttention", "PagedBatch", "allocate_index_cache",
    "attention_state_dict", "block_scores", "indexer_decode", "indexer_prefill", "load_attention_weights",
    "select_blocks", "write_index_keys",
]
