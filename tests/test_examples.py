"""The examples run as a user runs them: `python examples/<name>.py` in a fresh process (the jax_msa this environment
imports, the installed one in CI), on the backend JAX has here. Exit status 0, the jax_msa custom calls in the
compiled programs (the CPU handlers are always built; on a GPU, the CUDA kernels), and the quickstart's printed
errors against jax_msa.reference within what the output's rounding allows.

On the CPU the handlers compute in fp32 like the reference, in another summation order: the two fp32 results differ
by a few fp32 ulps and both are rounded to bf16, so an output element differs by at most one bf16 step of its own
magnitude, at most one step of max|ref|. The lse (fp32, |lse| < 16 here) by a few fp32 ulps: 2e-5 is 20 of them at
|lse| in [8, 16).
"""

from __future__ import annotations

import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
NUMBER = r"([0-9.e+-]+|nan|inf)"  # non-finite values match too, so that their check says what went wrong
ATTENTION_LINE = re.compile(rf"^(sparse_attention|sparse_decode)\s+(.*?)\s+[0-9.]+ ms\s+max\|out - ref\| {NUMBER} "
                            rf"\(max\|ref\| {NUMBER}\), max\|lse - ref\| {NUMBER}$")
WRITE_LINE = re.compile(r"^write_kv\s+(.*?)\s+[0-9.]+ ms\s+bytes differing from the reference: (\d+)$")
LSE_BOUND = 2e-5
KERNEL_OF = {"sparse_attention": "kernel jax_msa_prefill", "sparse_decode": "kernel jax_msa_decode"}  # as printed


def run_example(name: str, *args: str) -> list[str]:
    # the child must not find the GPU's memory preallocated away by this process (XLA takes 75% by default)
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"{name} {' '.join(args)} exited with {proc.returncode}:\n{proc.stderr[-4000:]}"
    return proc.stdout.splitlines()


def bf16_step(printed_max: float) -> float:
    """The spacing of bf16 values (8 significant bits) at the largest magnitude max|ref| can have: it is printed with
    2 decimals, so it is at most printed + 0.005, and every element's step is at most the step there."""
    return 2.0 ** (math.floor(math.log2(printed_max + 0.005)) - 7)


def quickstart_results(fmt: str):
    lines = run_example("quickstart.py", "--format", fmt)
    writes = [WRITE_LINE.match(line) for line in lines if line.startswith("write_kv")]
    attention = [ATTENTION_LINE.match(line) for line in lines if line.startswith("sparse_")]
    assert len(writes) == 1 and writes[0], "\n".join(lines)
    assert len(attention) == 2 and all(attention), "\n".join(lines)
    return writes[0], attention


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_quickstart_runs_the_kernels_and_matches_the_reference(fmt):
    import jax

    if jax.default_backend() != "cpu":
        pytest.skip("the bound below is the CPU handlers' (fp32 like the reference); the GPU kernels are tested "
                    "against their own bounds in test_gpu_*.py, and test_quickstart_on_the_gpu runs this example there")
    write, attention = quickstart_results(fmt)
    assert write.group(1) == "kernel jax_msa_write_kv"
    assert int(write.group(2)) == 0  # the CPU quantizer is the reference's, byte for byte
    for m in attention:
        op, ran, err, max_ref, lse_err = m.group(1), m.group(2), float(m.group(3)), float(m.group(4)), float(m.group(5))
        assert ran == KERNEL_OF[op]
        assert err <= bf16_step(max_ref), f"{op}: max|out - ref| {err} beyond one bf16 step at max|ref| {max_ref}"
        assert lse_err <= LSE_BOUND, f"{op}: max|lse - ref| {lse_err}"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_quickstart_on_the_gpu(fmt):
    """The quickstart on the GPU: it runs, and every op is a jax_msa CUDA kernel (not the jnp reference). Its
    accuracy is the GPU tests' business (bounded there against a bf16 jnp implementation)."""
    write, attention = quickstart_results(fmt)
    assert write.group(1) == "kernel jax_msa_write_kv"
    assert int(write.group(2)) == 0  # the CUDA quantizer is byte-exact with the jnp one (test_gpu_write_kv.py)
    for m in attention:
        assert m.group(2) == KERNEL_OF[m.group(1)]
        assert math.isfinite(float(m.group(3))) and math.isfinite(float(m.group(5)))


def test_serving_example_runs():
    """examples/serve_m3_layer.py --small (3 layers, 3 prompts, prefill then decode with q_len 1 and 4): it runs to
    the end and reports every phase."""
    lines = run_example("serve_m3_layer.py", "--small", "--steps", "2")
    text = "\n".join(lines)
    for phase in (r"^prefill\s+\d+ tokens", r"^decode q_len 1:", r"^decode q_len 4:",
                  r"^split, one MSA layer, prefill", r"^split, one MSA layer, decode q_len 4"):
        assert re.search(phase, text, re.MULTILINE), f"no line matching {phase!r} in:\n{text}"
