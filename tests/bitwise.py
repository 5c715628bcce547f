"""Bit-level comparison of arrays and pytrees (bf16, fp8 and fp32 alike): NaN patterns and -0 count."""

import jax
import numpy as np


def bits(x) -> np.ndarray:
    """The array's raw bits as unsigned integers of the same width."""
    x = np.asarray(x)
    return x.view(np.uint8) if x.dtype.itemsize == 1 else x.view(np.dtype(f"u{x.dtype.itemsize}"))


def assert_bitwise_equal(got, want):
    """Every leaf of two pytrees: same shape, dtype and bits."""
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, g.dtype, w.shape, w.dtype)
        np.testing.assert_array_equal(bits(g), bits(w))
