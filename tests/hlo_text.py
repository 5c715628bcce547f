"""Reading XLA's optimized HLO text in tests."""

import re

import jax.numpy as jnp

_HLO_DTYPES = {jnp.bfloat16: "bf16", jnp.float32: "f32", jnp.uint8: "u8", jnp.float8_e4m3fn: "f8e4m3fn"}


def copies_of(hlo: str, array) -> list[str]:
    """HLO instructions that copy a buffer of `array`'s shape and dtype (e.g. a KV cache that was not donated)."""
    dtype = _HLO_DTYPES[jnp.dtype(array.dtype).type]
    shape = re.escape(f"{dtype}[{','.join(map(str, array.shape))}]")
    return re.findall(rf"^\s*\S+ = {shape}\S* copy(?:-start|-done)?\(.*$", hlo, flags=re.M)


def entry_computation(hlo: str) -> str:
    """The top-level (ENTRY) computation of a compiled module's text: fusions have parameters of their own."""
    return hlo[hlo.index("\nENTRY "):]


def scalar_parameters(computation: str, dtype: str = "f32") -> list[tuple[str, int]]:
    """(name, index) of the computation's scalar parameters of `dtype` (an HLO type name: f32, s32, ...)."""
    return [(name, int(i)) for name, i in re.findall(rf"(%\S+) = {dtype}\[\] parameter\((\d+)\)", computation)]


def users_of(computation: str, name: str) -> list[str]:
    """The instructions of the computation that take instruction `name` as an operand (operand comments such as
    /*index=5*/ allowed)."""
    return [line for line in computation.splitlines()
            if re.search(rf"[(,]\s*(/\*[^*]*\*/)?{re.escape(name)}(?![\w.])", line.split("=", 1)[-1])]
