"""Reading XLA's optimized HLO text in tests."""

import re

import jax.numpy as jnp

_HLO_DTYPES = {jnp.bfloat16: "bf16", jnp.float32: "f32", jnp.uint8: "u8", jnp.float8_e4m3fn: "f8e4m3fn"}


def copies_of(hlo: str, array) -> list[str]:
    """HLO instructions that copy a buffer of `array`'s shape and dtype (e.g. a KV cache that was not donated)."""
    dtype = _HLO_DTYPES[jnp.dtype(array.dtype).type]
    shape = re.escape(f"{dtype}[{','.join(map(str, array.shape))}]")
    return re.findall(rf"^\s*\S+ = {shape}\S* copy(?:-start|-done)?\(.*$", hlo, flags=re.M)
