"""Configuration of one MiniMax-M3 attention layer, and the one place that maps Hugging Face config keys.

The real M3 ``config.json`` could not be fetched when this was written, so the HF key names in
``HF_CONFIG_KEYS`` are assumptions (standard HF names where they exist, DeepSeek-V3.2-style names for the
indexer). The values M3 uses (MSA.md section 1) are the defaults of ``M3AttentionConfig``. If the real
config spells a key differently, change it here only: ``from_hf_dict`` is the only reader of HF keys.
"""

from __future__ import annotations

import dataclasses

from jax_msa.kv_cache import PAGE_SIZE

# field of M3AttentionConfig -> the HF config.json keys read for it, first one present wins (assumed names).
HF_CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "hidden_size": ("hidden_size",),
    "num_q_heads": ("num_attention_heads",),
    "num_kv_heads": ("num_key_value_heads",),
    "head_dim": ("head_dim",),
    "rotary_dim": ("rotary_dim", "partial_rotary_dim"),
    "rope_theta": ("rope_theta",),
    "rms_norm_eps": ("rms_norm_eps",),
    "block_size": ("sparse_block_size", "index_block_size"),
    "topk": ("index_topk", "sparse_topk"),
    "num_index_heads": ("index_n_heads", "num_index_heads"),
    "index_head_dim": ("index_head_dim",),
    "num_init_blocks": ("num_init_blocks", "sparse_init_blocks"),
    "num_dense_layers": ("first_k_dense_replace", "num_dense_layers"),
}


@dataclasses.dataclass(frozen=True)
class M3AttentionConfig:
    """Shapes and constants of an M3 attention layer (defaults: the full model, MSA.md section 1)."""

    hidden_size: int = 6144  # assumed (not in MSA.md); any value works
    num_q_heads: int = 64  # HF num_attention_heads
    num_kv_heads: int = 4  # HF num_key_value_heads; GQA group = num_q_heads // num_kv_heads
    head_dim: int = 128  # q, k and v
    rotary_dim: int = 64  # partial NeoX RoPE on dims [0, rotary_dim) of every head
    rope_theta: float = 5_000_000.0
    rms_norm_eps: float = 1e-6
    block_size: int = PAGE_SIZE  # sparse block = KV page (128 tokens; the ops require it)
    topk: int = 16  # blocks selected per (query token, KV head)
    num_index_heads: int = 4  # one index head per KV head
    index_head_dim: int = 128  # index q heads and the one shared index-key head
    force_local_block: bool = True  # the query's own block is always selected (M3: always)
    num_init_blocks: int = 0  # blocks [0, n) always selected ("sink" blocks; M3: none)
    num_dense_layers: int = 3  # layers [0, n) are dense causal GQA (M3: layers 0-2)

    def __post_init__(self):
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads {self.num_q_heads} must be a multiple of num_kv_heads {self.num_kv_heads}")
        if self.num_index_heads != self.num_kv_heads:
            raise ValueError(f"the indexer has one head per KV head: num_index_heads {self.num_index_heads} "
                             f"!= num_kv_heads {self.num_kv_heads}")
        if self.block_size != PAGE_SIZE:
            raise ValueError(f"the sparse block is one KV page: block_size must be {PAGE_SIZE}; got {self.block_size}")
        for name, dim in (("head_dim", self.head_dim), ("index_head_dim", self.index_head_dim)):
            if self.rotary_dim > dim or self.rotary_dim % 2:
                raise ValueError(f"rotary_dim {self.rotary_dim} must be even and <= {name} {dim}")
        if not self.force_local_block:
            raise ValueError("M3 always selects the query's own block (force_local_block=True)")
        if self.topk < 1 or self.num_init_blocks < 0 or self.num_init_blocks >= self.topk:
            raise ValueError(f"need topk >= 1 and 0 <= num_init_blocks < topk; got {self.topk}, {self.num_init_blocks}")

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5

    def is_dense_layer(self, layer_index: int) -> bool:
        return layer_index < self.num_dense_layers

    @classmethod
    def from_hf_dict(cls, hf: dict, **overrides) -> "M3AttentionConfig":
        """Builds the config from a HF-style config dict (keys in HF_CONFIG_KEYS; missing keys keep the M3
        default; unknown keys are ignored). ``overrides`` (field names) win over the dict."""
        values = {}
        for field, keys in HF_CONFIG_KEYS.items():
            for key in keys:
                if key in hf and hf[key] is not None:
                    values[field] = hf[key]
                    break
        values.update(overrides)
        return cls(**values)
