"""Loading an M3 attention layer's weights from a safetensors file with Hugging Face tensor names.

The names below are assumed (the real M3 checkpoint index could not be fetched): the standard HF
attention names for q/k/v/o and the per-head q/k norms, and ``index_*`` names for the indexer. They are
kept in ``HF_TENSOR_NAMES`` only; change them there. Shapes are HF's: a projection ``weight`` is
[out_features, in_features] (transposed onto flax's [in, out] kernel); a norm ``weight`` is [head_dim].

    model.layers.{i}.self_attn.q_proj.weight         [Hq * D, hidden]
    model.layers.{i}.self_attn.k_proj.weight         [Hkv * D, hidden]
    model.layers.{i}.self_attn.v_proj.weight         [Hkv * D, hidden]
    model.layers.{i}.self_attn.o_proj.weight         [hidden, Hq * D]
    model.layers.{i}.self_attn.q_norm.weight         [D]
    model.layers.{i}.self_attn.k_norm.weight         [D]
    model.layers.{i}.self_attn.index_q_proj.weight   [Hidx * Didx, hidden]   (sparse layers only)
    model.layers.{i}.self_attn.index_k_proj.weight   [Didx, hidden]
    model.layers.{i}.self_attn.index_q_norm.weight   [Didx]
    model.layers.{i}.self_attn.index_k_norm.weight   [Didx]
"""

from __future__ import annotations

import jax.numpy as jnp
from safetensors import safe_open

from jax_msa.nn.attention import MSAAttention

LAYER_PREFIX = "model.layers.{layer}.self_attn."
# module attribute -> (HF tensor suffix, is a linear projection stored [out, in])
HF_TENSOR_NAMES: dict[str, tuple[str, bool]] = {
    "q_proj": ("q_proj.weight", True),
    "k_proj": ("k_proj.weight", True),
    "v_proj": ("v_proj.weight", True),
    "o_proj": ("o_proj.weight", True),
    "q_norm": ("q_norm.weight", False),
    "k_norm": ("k_norm.weight", False),
    "index_q_proj": ("index_q_proj.weight", True),
    "index_k_proj": ("index_k_proj.weight", True),
    "index_q_norm": ("index_q_norm.weight", False),
    "index_k_norm": ("index_k_norm.weight", False),
}
_INDEX_ATTRS = ("index_q_proj", "index_k_proj", "index_q_norm", "index_k_norm")


def module_tensor_names(module: MSAAttention, layer: int) -> dict[str, str]:
    """module attribute -> full HF tensor name, for the attributes this (dense or sparse) module has."""
    prefix = LAYER_PREFIX.format(layer=layer)
    return {attr: prefix + suffix for attr, (suffix, _) in HF_TENSOR_NAMES.items()
            if not (module.dense and attr in _INDEX_ATTRS)}


def _param(module, attr):
    sub = getattr(module, attr)
    return sub.kernel if HF_TENSOR_NAMES[attr][1] else sub.weight


def load_attention_weights(module: MSAAttention, path: str, layer: int) -> None:
    """Copies layer ``layer``'s tensors from the safetensors file at ``path`` into ``module`` (in place),
    cast to the module's parameter dtype. Raises KeyError for a missing tensor and ValueError for a
    shape mismatch, naming the tensor."""
    with safe_open(path, framework="flax") as f:
        present = set(f.keys())
        for attr, name in module_tensor_names(module, layer).items():
            if name not in present:
                raise KeyError(f"{path}: tensor {name!r} (for {attr}) not found")
            value = f.get_tensor(name)
            if HF_TENSOR_NAMES[attr][1]:
                value = value.T  # HF [out, in] -> flax kernel [in, out]
            param = _param(module, attr)
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(f"{path}: tensor {name!r} has shape {tuple(value.shape)} (after transpose "
                                 f"for projections), the module expects {tuple(param.shape)}")
            param[...] = jnp.asarray(value, param.dtype)


def attention_state_dict(module: MSAAttention, layer: int) -> dict:
    """The module's weights under their HF names and layouts (what load_attention_weights reads)."""
    out = {}
    for attr, name in module_tensor_names(module, layer).items():
        value = _param(module, attr)[...]
        out[name] = value.T if HF_TENSOR_NAMES[attr][1] else value
    return out
