"""Shared pytest setup: tests marked ``gpu`` run only with a CUDA device and the CUDA handlers built.

x64 stays off (the default): every array the ops take is int32 / bf16 / fp32, as in production.
"""

from __future__ import annotations

import functools

import jax
import pytest

import jax_msa


@functools.cache
def gpu_ready() -> bool:
    """A CUDA device is visible to JAX and this build has the CUDA handlers."""
    try:
        has_gpu = any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        has_gpu = False
    return has_gpu and jax_msa.cuda_available()


def pytest_collection_modifyitems(config, items):
    if gpu_ready():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device and a jax_msa build with the CUDA handlers")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
