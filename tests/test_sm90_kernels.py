"""What the Hopper (sm_90a) wgmma prefill kernels of cc/sm90 (bf16, FP8 and NVFP4 KV) compile to, checked on any machine
with nvcc (their numerics are checked on the H200 by test_gpu_prefill.py): warpgroup MMAs (HGMMA) for S = Q K^T and
O = P V, TMA loads (UTMALDG; NVFP4's cache slots by bulk copies, UBLKCP), register reconfiguration, no spills, none of
ptxas's "wgmma serialized" diagnostics (C7520), which a wgmma under a data-dependent branch would bring back, and the
16-byte partial stores of the fragment-order instantiation (the default), shared memory accessed as such (no generic
loads / stores) and P packed into the O wgmma's registers without PRMTs; and that the consumer ping-pong experiment
(JAX_MSA_SM90_PREFILL_PINGPONG, off by default) adds its named barriers only when built."""

from __future__ import annotations

import re

import pytest

import sass as sass_tools


@pytest.fixture(scope="module", params=["bf16", "fp8", "nvfp4"])
def compiled(request, tmp_path_factory):
    tools = sass_tools.tools()
    sass, log = sass_tools.compile_unit(tools, f"sm90/prefill/prefill_{request.param}.cu", "sm_90a",
                                        tmp_path_factory.mktemp("sm90"), defines=("JAX_MSA_SM90_KERNELS=1",))
    return sass, log, request.param


def test_wgmma_prefill_sass(compiled):
    sass, _, fmt = compiled
    kernels = set(re.findall(r"\.text\.(\S*sparse_prefill_wgmma_kernel\S*):", sass))
    # two instantiations: the partials in fragment order (default) and in natural column order
    # (JAX_MSA_PARTIAL_FRAGMENT_ORDER=0)
    assert len(kernels) == 2, kernels
    # S: 2 halves x 8 k-steps of m64n64k16; O: 2 halves x 4 k-steps of m64n128k16 (bf16 in, fp32 out)
    assert len(re.findall(r"HGMMA\.64x64x16\.F32\.BF16", sass)) >= 16
    assert len(re.findall(r"HGMMA\.64x128x16\.F32\.BF16", sass)) >= 8
    assert re.search(r"\bUTMALDG\.2D\b", sass), "no TMA loads"
    if any("KvFormatE2" in k for k in kernels):  # KvFormat::kNvfp4
        assert re.search(r"\bUBLKCP\.S\.G\b", sass), "NVFP4: the cache slots arrive by bulk copies"
    # setmaxnreg: the producer warpgroup drops to 56 (the next item's plan entries, bf16's pending V load, FP8 /
    # NVFP4's converters), the consumers rise to 224; config.h's static_assert keeps the split inside the pool the CTA
    # launches with
    assert set(re.findall(r"USETMAXREG\.DEALLOC\.CTAPOOL (0x[0-9a-f]+)", sass)) == {"0x38"}, fmt
    assert set(re.findall(r"USETMAXREG\.TRY_ALLOC\.CTAPOOL UP\d, (0x[0-9a-f]+)", sass)) == {"0xe0"}, fmt
    # the softmax's 2^x on the MUFU unit without exp2f's subnormal fix-up (ex2.approx.ftz): no compare with -126 (and
    # halving) before it
    assert re.search(r"MUFU\.EX2", sass) and not re.search(r"FSETP\.GEU\.AND P\d, PT, R\d+, -126", sass), fmt
    assert not re.search(r"\b(STL|LDL)\b", sass), "local-memory spills"
    # the shared storage keeps its address space (LDS / STS): no generic LD / ST, which the 1 KB alignment of the
    # dynamic base through an integer had made of every access to it (the tile meta the consumers read per item)
    assert not re.search(r"\b(?:LD|ST)\.E\b", sass), "generic loads / stores"
    # P = bf16(exp2(S - m)) is packed pairwise straight into the O wgmma's A registers: no PRMT moving bf16 halves
    # into place (converted element by element, ptxas added 32 a kernel right before the O wgmma)
    assert not re.search(r"\bPRMT R\d+, R\d+(?:\.reuse)?, 0x(?:5410|7632), R", sass), "P repacked by PRMT"
    # the consumer warpgroup index comes from a shuffle (warp-uniform), so the S wgmmas' descriptors live in uniform
    # registers: no R2UR moves them there right before a wgmma (threadIdx.x / 128 put two before each of the 16)
    lines = sass.splitlines()
    s_wgmma = [i for i, line in enumerate(lines) if "HGMMA.64x64x16" in line]
    assert s_wgmma and not any("R2UR" in line for i in s_wgmma for line in lines[max(0, i - 4):i]), \
        "S wgmma descriptors moved into uniform registers per wgmma"
    # fragment order: each thread stores a partial row's 32 values as four 16-byte stores (2 rows a thread)
    assert len(re.findall(r"\bSTG\.E\.128\b", sass)) >= 8, "no 16-byte partial stores"
    # the default build has no ping-pong: the only CTA-wide barrier is the __syncthreads after the barrier setup
    assert set(re.findall(r"\bBAR\.(?:SYNC|ARV)\S* ([^;]+);", sass)) == {"0x0 "}, "named barriers in the default build"


def test_wgmma_prefill_not_serialized(compiled):
    _, log, _ = compiled
    assert "C7520" not in log and "serialized" not in log, log
    # both instantiations (natural and fragment-order partials)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert len(spills) == 2 and all(s == ("0", "0") for s in spills), log
    # setmaxnreg: 128 x 56 + 256 x 224 registers come out of the 384 x 168 the kernel launches with; with fewer, the
    # consumers' allocation would wait forever
    assert re.findall(r"Used (\d+) registers", log) == ["168", "168"], log


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_wgmma_prefill_pingpong_build(fmt, tmp_path):
    """JAX_MSA_SM90_PREFILL_PINGPONG=1 (CMake option, an experiment, off: within 2% of the default on the H200 before
    the consumers were pipelined across items; the turns split around S and O since; not run on a GPU since):
    warpgroup 1 hands warpgroup 0 the first turn, then each consumer warpgroup syncs on its turn's named barrier and
    arrives on the other's twice an iteration (around its S issue, around its O issue), all counted over the two
    consumer warpgroups (256 threads; ids 8 and 9, past CUTLASS's reserved ones), the S and O wgmmas inside their turns
    (checked in the SASS order), without spills or serialized wgmmas, in both instantiations (natural and
    fragment-order partials). A Python model of the protocol (every interleaving, n = 1..6 items, with the producer's
    stage barriers) found no deadlock and 256 arrivals in every barrier generation."""
    tools = sass_tools.tools()
    sass, log = sass_tools.compile_unit(tools, f"sm90/prefill/prefill_{fmt}.cu", "sm_90a", tmp_path,
                                        defines=("JAX_MSA_SM90_KERNELS=1", "JAX_MSA_SM90_PREFILL_PINGPONG=1"))
    assert len(re.findall(r"BAR\.ARV 0x8, 0x100", sass)) == 2, "first hand-over (one a kernel)"
    assert len(re.findall(r"BAR\.SYNC\.DEFER_BLOCKING R\d+, 0x100", sass)) == 4, "turn waits (S and O, two a kernel)"
    assert len(re.findall(r"BAR\.ARV R\d+, 0x100", sass)) == 4, "hand-overs (S and O, two a kernel)"
    # Where the turns sit, per kernel: the first hand-over, item 0's S (16 HGMMA), then in the loop a turn around the
    # next S (16) and a turn around this item's O (8); no wgmma outside a turn in the loop
    kernels = re.split(r"\n\s*\.text\.", sass)[1:]
    kernels = [k for k in kernels if "HGMMA" in k]
    assert len(kernels) == 2, len(kernels)
    for k in kernels:
        order = "".join("I" if re.search(r"BAR\.ARV 0x8, 0x100", line) else
                        "S" if re.search(r"BAR\.SYNC\.DEFER_BLOCKING R\d+, 0x100", line) else
                        "A" if re.search(r"BAR\.ARV R\d+, 0x100", line) else
                        "H" if "HGMMA" in line else "" for line in k.splitlines())
        assert re.fullmatch(r"IH{16}SH{16}ASH{8}A", order), order
    assert "C7520" not in log and "serialized" not in log, log
    assert not re.search(r"\b(STL|LDL)\b", sass), "local-memory spills"


def test_wgmma_prefill_bulk_store_build(tmp_path):
    """JAX_MSA_SM90_PREFILL_BULK_STORE=1 (CMake option, an experiment, off; on an H100 its small bf16 GPU test
    passed and it ran the 32k bench no faster than the default, README): the bf16 kernel with fragment-order
    partials stages each consumer warp's 16 partial rows in shared memory (four 16-byte STS a row, in place of the
    STG.E.128s) and copies each token's rows with one bulk copy (UBLKCP.G.S, shared -> global) after the async-proxy
    fence; the copies are waited for (DEPBAR on SB0) before the buffer is written again and before the CTA exits. The
    natural-order instantiation keeps its global stores. No spills, no serialized wgmma, the same register split."""
    tools = sass_tools.tools()
    sass, log = sass_tools.compile_unit(tools, "sm90/prefill/prefill_bf16.cu", "sm_90a", tmp_path,
                                        defines=("JAX_MSA_SM90_KERNELS=1", "JAX_MSA_SM90_PREFILL_BULK_STORE=1"))
    kernels = {name: body for name, body in re.findall(r"\n\s*\.text\.(\S*sparse_prefill_wgmma_kernel\S*):(.*?)(?=\n\s*\.text\.|\Z)",
                                                       sass, re.S)}
    assert len(kernels) == 2, list(kernels)
    fragment = next(b for k, b in kernels.items() if k.endswith("ELb1EEEvNS1_14TmaPrefillArgsE"))
    natural = next(b for k, b in kernels.items() if k.endswith("ELb0EEEvNS1_14TmaPrefillArgsE"))
    # two call sites of the partial stores (in the loop, after it), one or two tokens a warp: 4 bulk copies
    assert len(re.findall(r"\bUBLKCP\.G\.S\b", fragment)) == 4, "bulk partial copies"
    assert not re.search(r"\bSTG\.E\.128\b", fragment), "16-byte global partial stores left"
    assert len(re.findall(r"\bSTS\.128\b", fragment)) >= 16, "partial rows staged in shared memory"
    assert not re.search(r"UBLKCP", natural) and not re.search(r"\bSTG\.E\.128\b", natural)
    lines = fragment.splitlines()
    copies = [i for i, line in enumerate(lines) if "UBLKCP.G.S" in line]
    fences = [i for i, line in enumerate(lines) if "FENCE.VIEW.ASYNC.S" in line]
    for i in copies:  # the writers' async-proxy fence precedes each copy, with no partial store in between
        f = max(j for j in fences if j < i)
        assert not any("STS.128" in line for line in lines[f:i]), "a staged store after the fence"
    # each staging store (a computed value; the producer's zero fills store RZ) follows a wait for the previous
    # copies' reads, with no copy issued in between
    for i, line in enumerate(lines):
        if re.search(r"\bSTS\.128 \[[^]]*\], R\d+", line):
            before = [j for j in range(i) if "UBLKCP" in lines[j] or re.search(r"\bDEPBAR\.LE SB0, 0x0\b", lines[j])]
            assert before and "DEPBAR" in lines[before[-1]], f"staging store without a wait before it: {line}"
    waits = [i for i, line in enumerate(lines) if re.search(r"\bDEPBAR\.LE SB0, 0x0\b", line)]
    assert len(waits) >= 3, "bulk waits: before each of the two staging sites and before the exit"
    last_exit = max(i for i, line in enumerate(lines) if re.search(r"\bEXIT\b", line) and i > copies[-1])
    assert any(copies[-1] < w < last_exit for w in waits), "the CTA exits before its copies are done"
    assert "C7520" not in log and "serialized" not in log, log
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert len(spills) == 2 and all(s == ("0", "0") for s in spills), log
    assert re.findall(r"Used (\d+) registers", log) == ["168", "168"], log
