"""Partial NeoX-style rotary embedding: dims [0, rotary_dim) of each head are rotated (first half paired
with second half of that slice), dims [rotary_dim, D) pass through. M3: rotary_dim 64 of 128, theta 5e6."""

from __future__ import annotations

import jax.numpy as jnp


def rope_cos_sin(positions, rotary_dim: int, theta: float):
    """positions [T] int -> (cos, sin) [T, rotary_dim // 2] fp32; inv_freq_i = theta^(-2i / rotary_dim)."""
    half = rotary_dim // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) * 2.0 / rotary_dim))
    angle = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angle), jnp.sin(angle)


def apply_partial_rope(x, cos, sin, rotary_dim: int):
    """x [T, H, D] (any float) -> fp32 [T, H, D]: NeoX rotation of x[..., :rotary_dim] by (cos, sin) [T, r/2]."""
    x = x.astype(jnp.float32)
    half = rotary_dim // 2
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, rest], axis=-1)
