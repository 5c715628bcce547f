"""The tcgen05 (sm_100a) prefill and decode kernels of cc/sm100 are UNVERIFIED: no Blackwell GPU has run them.
What can be checked without one is checked here, on any machine with nvcc: each of their translation units compiles
for sm_100a to a kernel whose SASS holds the tensor-core instructions the design relies on (UTCHMMA: tcgen05.mma
kind::f16; LDTM: tcgen05.ld of the accumulators), so the opt-in path is not an empty or fallback body. The SASS is
read with nvdisasm (the `nvidia-cuda-nvdisasm` wheel of the test extras, or a CUDA toolkit's)."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sysconfig

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (translation unit under cc/sm100, its kernel): every format of the prefill and of the decode
UNITS = [(f"{phase}/{phase}_{fmt}.cu", f"sparse_{phase}_tcgen05_kernel") for phase in ("prefill", "decode")
         for fmt in ("bf16", "fp8", "nvfp4")]


def _nvcc():
    cands = [os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    return next((c for c in cands if c and os.path.exists(c)), None)


def _nvdisasm():
    found = shutil.which("nvdisasm")
    if found:
        return found
    pure = sysconfig.get_paths()["purelib"]
    hits = sorted(glob.glob(os.path.join(pure, "nvidia", "*", "bin", "nvdisasm")))
    return hits[-1] if hits else None


def _includes():
    import cutlass_library
    import jax

    cutlass = os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include")
    return [os.path.join(REPO, "cc"), cutlass, jax.ffi.include_dir()]


@pytest.fixture(scope="module")
def tools():
    nvcc, nvdisasm = _nvcc(), _nvdisasm()
    if nvcc is None:
        pytest.skip("no nvcc: the CUDA kernels are not built on this machine")
    assert nvdisasm is not None, "nvdisasm not found: pip install nvidia-cuda-nvdisasm (in the test extras)"
    return nvcc, nvdisasm


@pytest.mark.parametrize("unit, kernel", UNITS, ids=[u for u, _ in UNITS])
def test_tcgen05_sass(tools, unit, kernel, tmp_path):
    nvcc, nvdisasm = tools
    cubin = tmp_path / "unit.cubin"
    cmd = [nvcc, "-cubin", "-arch=sm_100a", "-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr",
           "-DJAX_MSA_WITH_CUDA=1", "-o", str(cubin), os.path.join(REPO, "cc", "sm100", unit)]
    for inc in _includes():
        cmd += ["-I", inc]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    sass = subprocess.run([nvdisasm, "-c", str(cubin)], check=True, capture_output=True, text=True).stdout
    kernels = set(re.findall(rf"\.text\.(\S*{kernel}\S*):", sass))
    assert len(kernels) == 1, kernels
    counts = {op: len(re.findall(rf"\b{op}\b", sass)) for op in ("UTCHMMA", "LDTM")}
    # 8 MMAs of K = 16 for the scores and 8 for the output (each may be emitted once per predicate path); the TMEM
    # loads of the two softmax passes and of the output
    assert counts["UTCHMMA"] >= 16, counts
    assert counts["LDTM"] >= 3, counts
