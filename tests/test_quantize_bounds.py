"""The NVFP4 quantizer's division-free E2M1 rounding (E2m1Bounds, cc/common/quantize.h) gives the division's codes:
tests/cc/e2m1_bounds_check.cc, built with the host C++ compiler and run (every block scale, the floats around every
bound, random and special values); and the packed quantizer the write_kv kernel runs gives the scalar one's bytes:
tests/cc/nvfp4_bf16x2_check.cc (its shortcuts, every bf16 value's codes, whole groups)."""

import os
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_and_run(check, tmp_path):
    """Builds tests/cc/<check>.cc with the host C++ compiler and runs it; returns its CompletedProcess."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    exe = tmp_path / check
    # -ffp-contract=off: the checks' own divisions must stay correctly rounded ones
    subprocess.run([cxx, "-O2", "-std=c++17", "-ffp-contract=off", "-I", os.path.join(REPO, "cc"),
                    os.path.join(REPO, "tests", "cc", f"{check}.cc"), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def test_e2m1_bounds_match_the_division(tmp_path):
    out = build_and_run("e2m1_bounds_check", tmp_path)
    checks = int(out.stdout.split()[-4])
    assert checks > 8_000_000 and out.stdout.strip().endswith("0 mismatches"), out.stdout


def test_packed_nvfp4_quantizer_matches_the_scalar_one(tmp_path):
    out = build_and_run("nvfp4_bf16x2_check", tmp_path)
    fields = out.stdout.split()
    shortcut_checks, code_checks, group_checks = int(fields[-11]), int(fields[-8]), int(fields[-5])
    assert shortcut_checks > 56_000 and code_checks > 400_000_000 and group_checks > 1_000_000, out.stdout
    assert out.stdout.strip().endswith(" 0 mismatches"), out.stdout
