"""The NVFP4 quantizer's division-free E2M1 rounding (E2m1Bounds, cc/common/quantize.h) gives the division's codes:
tests/cc/e2m1_bounds_check.cc, built with the host C++ compiler and run (every block scale, the floats around every
bound, random and special values)."""

import os
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_e2m1_bounds_match_the_division(tmp_path):
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    exe = tmp_path / "e2m1_bounds_check"
    # -ffp-contract=off: the check's own y / sf must stay one correctly rounded division
    subprocess.run([cxx, "-O2", "-std=c++17", "-ffp-contract=off", "-I", os.path.join(REPO, "cc"),
                    os.path.join(REPO, "tests", "cc", "e2m1_bounds_check.cc"), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    checks = int(out.stdout.split()[-4])
    assert checks > 8_000_000 and out.stdout.strip().endswith("0 mismatches"), out.stdout
