"""Compiling one kernel translation unit to a cubin and reading its SASS, without a GPU: nvcc (skips when absent) and
nvdisasm (the `nvidia-cuda-nvdisasm` wheel of the test extras, or a CUDA toolkit's). Used by the tests that check what
the tensor-core kernels compile to (test_sm90_kernels.py, test_sm100_kernels.py)."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sysconfig

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def tools():
    """(nvcc, nvdisasm); skips the calling test without nvcc, fails it without nvdisasm."""
    nvcc, nvdisasm = _nvcc(), _nvdisasm()
    if nvcc is None:
        pytest.skip("no nvcc: the CUDA kernels are not built on this machine")
    assert nvdisasm is not None, "nvdisasm not found: pip install nvidia-cuda-nvdisasm (in the test extras)"
    return nvcc, nvdisasm


def compile_unit(tools_, unit, arch, out_dir, defines=()):
    """Compiles cc/<unit> for `arch` (e.g. "sm_90a") as the build does (Release); returns (SASS text, ptxas -v log)."""
    nvcc, nvdisasm = tools_
    cubin = os.path.join(str(out_dir), "unit.cubin")
    cmd = [nvcc, "-cubin", f"-arch={arch}", "-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr",
           "-Xptxas", "-v", "-DJAX_MSA_WITH_CUDA=1", *(f"-D{d}" for d in defines), "-o", cubin,
           os.path.join(REPO, "cc", unit)]
    for inc in _includes():
        cmd += ["-I", inc]
    log = subprocess.run(cmd, check=True, capture_output=True, text=True).stderr
    sass = subprocess.run([nvdisasm, "-c", cubin], check=True, capture_output=True, text=True).stdout
    return sass, log
