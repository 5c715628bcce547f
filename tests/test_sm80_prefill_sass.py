"""What the warp-MMA prefill kernels of cc/sm80/prefill compile to for sm_90a, checked on any machine with nvcc (their
numerics are checked on the H200 by test_gpu_prefill.py with JAX_MSA_DISABLE_SM90_KERNELS=1, `.ci/gpu_run.sh
test_warp_mma`): mma.sync (HMMA) for both products and their local-memory spills held where they are. They sit at their
register budget (128 registers, kCtasPerSm CTAs an SM) and share the softmax and the chunk loaders with the decode
kernels, so a change made for the decode can push them over it: since the decode's ex2.approx softmax (v10) the bf16
kernel spills 12 bytes (one local load a chunk in its loop; docs/BENCHMARKS.md, "v10"), the others none. This test
keeps that from growing unnoticed; lower the bound when a change removes the spill.

On the default build's other architectures the budget is what register_budget_ctas() (config.h) gives: one CTA an SM
on sm_80, sm_86, sm_89 and sm_120, whose shared memory holds only one of these ~100 KB CTAs, so no spill there (they
spilled 12-20 bytes under the two-CTA cap they can never use); two on sm_100a, where they spill 16 bytes each."""

from __future__ import annotations

import re

import pytest

import sass as sass_tools

# unit -> (registers, largest spill-store bytes allowed, as of the twenty-first session's v10)
UNITS = {
    "prefill_bf16.cu": (128, 12),
    "prefill_fp8.cu": (128, 0),
    "prefill_nvfp4.cu": (128, 0),
    "prefill_bf16_pipelined.cu": (None, 0),  # the opt-in persistent bf16 kernel (JAX_MSA_PREFILL_PIPELINED=1)
}


@pytest.mark.parametrize("unit", UNITS)
def test_warp_mma_prefill_sm90a_spills(unit, tmp_path):
    registers, spill_bytes = UNITS[unit]
    sass, log = sass_tools.compile_unit(sass_tools.tools(), f"sm80/prefill/{unit}", "sm_90a", tmp_path)
    assert re.search(r"\.text\.\S*sparse_prefill\S*kernel", sass)
    assert len(re.findall(r"\bHMMA\.16816\.F32", sass)) >= 16, "mma.sync for S and O"
    spills = [(int(s), int(l)) for s, l in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)]
    assert len(spills) == 1, log
    assert spills[0][0] <= spill_bytes and spills[0][1] <= spill_bytes, (unit, spills, log)
    if spill_bytes == 0:
        assert not re.search(r"\b(STL|LDL)\b", sass), "local-memory spills"
    if registers is not None:
        assert re.findall(r"Used (\d+) registers", log) == [str(registers)], log


# The default build's other architectures (CMakeLists.txt, JAX_MSA_CUDA_ARCHS) -> the largest spill (bytes) allowed at
# the register budget register_budget_ctas() gives each: none where one CTA an SM fits; sm_100a as of the
# twenty-ninth session (two CTAs, 128 registers, like sm_90a).
OTHER_ARCHS = {"sm_80": 0, "sm_86": 0, "sm_89": 0, "sm_120": 0, "sm_100a": 16}
FORMAT_UNITS = ["prefill_bf16.cu", "prefill_fp8.cu", "prefill_nvfp4.cu"]


@pytest.mark.parametrize("arch", OTHER_ARCHS)
@pytest.mark.parametrize("unit", FORMAT_UNITS)
def test_warp_mma_prefill_other_arch_spills(unit, arch, tmp_path):
    spill_bytes = OTHER_ARCHS[arch]
    sass, log = sass_tools.compile_unit(sass_tools.tools(), f"sm80/prefill/{unit}", arch, tmp_path)
    assert re.search(r"\.text\.\S*sparse_prefill\S*kernel", sass)
    spills = [(int(s), int(l)) for s, l in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)]
    assert len(spills) == 1, log
    assert spills[0][0] <= spill_bytes and spills[0][1] <= spill_bytes, (unit, arch, spills, log)
    if spill_bytes == 0:
        assert not re.search(r"\b(STL|LDL)\b", sass), "local-memory spills"
