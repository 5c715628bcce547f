"""What write_kv (cc/cuda/write_kv.cu) compiles to for sm_90a, checked on any machine with nvcc (its bytes:
test_gpu_write_kv.py on the GPU). Measured on an H100 (docs/BENCHMARKS.md): overlapping the slot's load with the
chunk's took 5-16% off (forty-third session), and the NVFP4 write is bound by its instruction issue (forty-fourth
session: the packed quantizer's third fewer instructions took 22-30% off; more registers' worth of loads in flight did
not pay). So:
- the loads of a row (the chunk, its scale, the slot) issue back to back before any branch, so their latencies overlap;
  with a branch on the slot's validity there, ptxas sank the chunk loads below it (forty-second session);
- the NVFP4 kernel's path from the group's NaN test to its stores stays short: one IEEE division (by the global scale;
  the amax's by 6 is two fmas), 32 packed compares, the block scale back to a float by one conversion;
- no spills."""

from __future__ import annotations

import re

import sass as sass_tools

FORMATS = {"0": "bf16", "1": "fp8", "2": "nvfp4"}  # KvFormat's values in the mangled template arguments


def kernel_name(mangled: str) -> tuple[str, bool] | None:
    """(format, vectorized) of a write_kv_kernel instantiation, None for other functions."""
    m = re.search(r"write_kv_kernelILNS_8KvFormatE(\d)ELb([01])E", mangled)
    return (FORMATS[m.group(1)], m.group(2) == "1") if m else None


def kernel_bodies(sass: str) -> dict[tuple[str, bool], str]:
    parts = re.split(r"\n\s*\.text\.(\S+):", "\n" + sass)
    return {kernel_name(n): body for n, body in zip(parts[1::2], parts[2::2]) if kernel_name(n)}


def resource_usage(log: str) -> dict[tuple[str, bool], tuple[int, int]]:
    """{(format, vectorized): (registers, spill store bytes)} from ptxas -v."""
    usage = {}
    for block in re.split(r"Compiling entry function ", log)[1:]:
        key = kernel_name(block.split("'")[1])
        if key is None:
            continue
        registers = int(re.search(r"Used (\d+) registers", block).group(1))
        spills = int(re.search(r"(\d+) bytes spill stores", block).group(1))
        usage[key] = (registers, spills)
    return usage


def test_write_kv_loads_overlap_without_spills(tmp_path):
    sass, log = sass_tools.compile_unit(sass_tools.tools(), "cuda/write_kv.cu", "sm_90a", tmp_path)
    bodies = kernel_bodies(sass)
    assert len(bodies) == 6, sorted(bodies)
    for (fmt, vec), body in bodies.items():
        if not vec:
            continue  # the element-wise fallback (unaligned buffers) is not tuned
        lines = [l for l in body.splitlines() if re.match(r"\s*/\*[0-9a-f]{4}\*/", l)]
        loads = [i for i, l in enumerate(lines) if re.search(r"\bLDG\b", l)]
        chunk = [i for i in loads if "LDG.E.128.CONSTANT" in lines[i]]
        assert len(chunk) == 2, (fmt, [lines[i] for i in loads])
        # chunk (2), slot (1), and the scale (1, ld.relaxed.gpu: LDG.E.STRONG.GPU) for the quantizing formats
        assert len(loads) == (3 if fmt == "bf16" else 4), (fmt, [lines[i] for i in loads])
        if fmt != "bf16":
            assert any("LDG.E.STRONG.GPU" in lines[i] for i in loads), fmt
        first_branch = next((i for i in range(loads[0], len(lines)) if re.search(r"\bBRA\b", lines[i])), len(lines))
        assert loads[-1] < first_branch, (fmt, lines[loads[0]:loads[-1] + 1])
        stores = [i for i, l in enumerate(lines) if re.search(r"\bSTG\b", l)]
        assert stores and min(stores) > loads[-1], fmt
    nvfp4 = [l for l in bodies[("nvfp4", True)].splitlines() if re.match(r"\s*/\*[0-9a-f]{4}\*/", l)]
    nan_test = next(i for i, l in enumerate(nvfp4) if re.search(r"ISETP\.GT\.U32\.AND P\d, PT, R\d+, 0x7f80, PT", l))
    end = next(i for i in range(nan_test + 1, len(nvfp4)) if re.search(r"\*/\s+BRA\b", nvfp4[i]))
    fast_path = nvfp4[nan_test + 1:end]
    count = lambda pattern: sum(bool(re.search(pattern, l)) for l in fast_path)
    assert count(r"\bFCHK\b") == 1 and count(r"\bHSET2\.BF16_V2\b") == 32, fast_path
    assert count(r"F2FP\.F16\.E4M3\.UNPACK_B") == 1 and len(fast_path) <= 200, (len(fast_path), fast_path)
    usage = resource_usage(log)
    assert len(usage) == 6, log
    for (fmt, vec), (registers, spills) in usage.items():
        assert spills == 0, (fmt, vec, registers, spills)
