"""What the prefill combine (cc/sm80/prefill/combine_partials.cu, shared by every GPU prefill path) compiles to for
sm_90a, checked on any machine with nvcc (its numerics: test_gpu_prefill.py on the H200). It is bound by reading the
bf16 partials once, so each of its two instantiations (fragment / natural column order) must read them with 16-byte
evict-first loads, a batch of them before the first is used, and keep no shuffle or spill on that path."""

from __future__ import annotations

import re

import sass as sass_tools

RANKS_IN_FLIGHT = 8  # kRanksInFlight in combine_partials.cu


def kernel_bodies(sass: str) -> dict[str, str]:
    """{mangled name: SASS text} of each combine_partials_kernel instantiation."""
    parts = re.split(r"\n\s*\.text\.(\S+):", "\n" + sass)
    return {name: body for name, body in zip(parts[1::2], parts[2::2]) if "combine_partials_kernel" in name}


def test_combine_reads_partials_with_streaming_16_byte_loads(tmp_path):
    sass, log = sass_tools.compile_unit(sass_tools.tools(), "sm80/prefill/combine_partials.cu", "sm_90a", tmp_path)
    bodies = kernel_bodies(sass)
    assert len(bodies) == 2, sorted(bodies)
    for name, body in bodies.items():
        loads = re.findall(r"\bLDG\.E\.EF\.128\b", body)
        # the first batch (issued before the lse are read) and the loop's batch
        assert len(loads) >= 2 * RANKS_IN_FLIGHT, (name, len(loads))
        # the first batch is in flight before the first lse load (LDG.E.CONSTANT: the read-only path of __ldg)
        first_lse = re.search(r"\bLDG\.E\.CONSTANT\b", body)
        assert first_lse, name
        assert len(re.findall(r"\bLDG\.E\.EF\.128\b", body[:first_lse.start()])) >= RANKS_IN_FLIGHT, name
        assert not re.search(r"\bSHFL\b", body), name  # a half-warp a row, no cross-lane reduction
        assert not re.search(r"\b(STL|LDL)\b", body), name
    assert re.search(r"0 bytes spill stores, 0 bytes spill loads", log), log
