"""The tcgen05 (sm_100a) prefill and decode kernels of cc/sm100 are UNVERIFIED: no Blackwell GPU has run them.
What can be checked without one is checked here, on any machine with nvcc: each of their translation units compiles
for sm_100a to a kernel whose SASS holds the tensor-core instructions the design relies on (UTCHMMA: tcgen05.mma
kind::f16; LDTM: tcgen05.ld of the accumulators), so the opt-in path is not an empty or fallback body. The SASS is
read with nvdisasm (the `nvidia-cuda-nvdisasm` wheel of the test extras, or a CUDA toolkit's)."""

from __future__ import annotations

import re

import pytest

import sass as sass_tools

# (translation unit under cc/sm100, its kernel): every format of the prefill and of the decode
UNITS = [(f"{phase}/{phase}_{fmt}.cu", f"sparse_{phase}_tcgen05_kernel") for phase in ("prefill", "decode")
         for fmt in ("bf16", "fp8", "nvfp4")]


@pytest.fixture(scope="module")
def tools():
    return sass_tools.tools()


@pytest.mark.parametrize("unit, kernel", UNITS, ids=[u for u, _ in UNITS])
def test_tcgen05_sass(tools, unit, kernel, tmp_path):
    sass, _ = sass_tools.compile_unit(tools, f"sm100/{unit}", "sm_100a", tmp_path)
    kernels = set(re.findall(rf"\.text\.(\S*{kernel}\S*):", sass))
    assert len(kernels) == 1, kernels
    counts = {op: len(re.findall(rf"\b{op}\b", sass)) for op in ("UTCHMMA", "LDTM")}
    # 8 MMAs of K = 16 for the scores and 8 for the output (each may be emitted once per predicate path); the TMEM
    # loads of the two softmax passes and of the output
    assert counts["UTCHMMA"] >= 16, counts
    assert counts["LDTM"] >= 3, counts
    # shared memory is written as such: the operand and P tiles' element addresses come from CuTe's swizzle, which
    # XORs the address bits, so plain stores through them compiled to generic ST (cuda/shared_memory.cuh); global
    # memory by LDG / STG
    assert not re.search(r"\b(?:LD|ST)\.E\b", sass), "generic loads or stores"
