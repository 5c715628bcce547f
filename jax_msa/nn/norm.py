"""Per-head RMSNorm (q, k and the indexer's q and k are normalised over head_dim, one weight vector
shared by all heads)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def rms_norm(x, weight, eps: float):
    """x [..., D] -> x * rsqrt(mean(x^2) + eps) * weight, computed in fp32, returned in fp32."""
    x = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * inv * weight.astype(jnp.float32)


class HeadRMSNorm(nnx.Module):
    """RMSNorm over the last axis (head_dim) with a [head_dim] weight (HF name ``<prefix>.weight``)."""

    def __init__(self, dim: int, eps: float, *, param_dtype=jnp.bfloat16):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))

    def __call__(self, x):
        return rms_norm(x, self.weight[...], self.eps)
