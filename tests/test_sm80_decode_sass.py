"""What the warp-MMA decode kernels of cc/sm80/decode compile to, checked on any machine with nvcc (their numerics are
checked on the H200 by test_gpu_decode.py): for sm_90a the split-K merge inside a thread-block cluster (cluster
barriers, cluster_merge.cuh) and no spills at the register budget of kCtasPerSm CTAs an SM; for sm_80, where clusters
do not exist, no cluster instruction (the launcher takes the combine kernel there); for every other architecture of the
default build, no spills at the budget register_budget_ctas() gives it."""

from __future__ import annotations

import re

import pytest

import sass as sass_tools

FORMATS = ["bf16", "fp8", "nvfp4"]
# the CtaLayout values each format's kernels are compiled for (config.h: kOneTeam 1, kTeams 2, kTeamsTwoPerSm 3 where
# FormatTraits::kTwoPerSmTeamStages > 0, kThreeTeams 4 where kThreeTeamStages > 0)
LAYOUTS = {"bf16": [1], "fp8": [1, 2, 3], "nvfp4": [1, 2, 4]}


def assert_no_spills(log):
    """ptxas reported spill figures and every one of them is 0 (a unit holds several kernels)."""
    assert re.search(r"0 bytes spill stores, 0 bytes spill loads", log), log
    assert not re.search(r"\b[1-9]\d* bytes spill (stores|loads)", log), log


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_sm90a_merges_in_cluster(fmt, tmp_path):
    sass, log = sass_tools.compile_unit(sass_tools.tools(), f"sm80/decode/decode_{fmt}.cu", "sm_90a", tmp_path)
    kernels = set(re.findall(r"\.text\.(\S*sparse_decode_kernel\S*):", sass))
    # the one-team kernel (CtaLayout::kOneTeam = 1), and for FP8 / NVFP4 the team ones (kTeams = 2; FP8 also at two
    # CTAs an SM, kTeamsTwoPerSm = 3; NVFP4 three teams, kThreeTeams = 4), which have no cluster code: the barriers
    # below are the one-team kernel's
    layouts = sorted(int(re.search(r"CtaLayoutE(\d)E", k).group(1)) for k in kernels)
    assert layouts == LAYOUTS[fmt], kernels
    # two cluster barriers (partials staged; nobody leaves while others read), each an arrive and a wait
    assert len(re.findall(r"\bUCGABAR_ARV\b", sass)) == 2, "cluster barrier arrives"
    assert len(re.findall(r"\bUCGABAR_WAIT\b", sass)) == 2, "cluster barrier waits"
    assert_no_spills(log)
    assert not re.search(r"\b(STL|LDL)\b", sass), "local-memory spills"


def test_decode_sm80_has_no_cluster_code(tmp_path):
    sass, log = sass_tools.compile_unit(sass_tools.tools(), "sm80/decode/decode_bf16.cu", "sm_80", tmp_path)
    assert re.search(r"\.text\.\S*sparse_decode_kernel", sass)
    assert not re.search(r"UCGABAR|\bMAPA\b", sass)
    assert_no_spills(log)


# The default build's other architectures (CMakeLists.txt, JAX_MSA_CUDA_ARCHS): no spill at the register budget that
# register_budget_ctas() (config.h) gives each; sm_90a is checked above.
OTHER_ARCHS = ["sm_80", "sm_86", "sm_89", "sm_100a", "sm_120"]


@pytest.mark.parametrize("arch", OTHER_ARCHS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_has_no_spills(fmt, arch, tmp_path):
    sass, log = sass_tools.compile_unit(sass_tools.tools(), f"sm80/decode/decode_{fmt}.cu", arch, tmp_path)
    assert re.search(r"\.text\.\S*sparse_decode_kernel", sass)
    assert_no_spills(log)
    assert not re.search(r"\b(STL|LDL)\b", sass), "local-memory spills"


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_timeline_only_in_its_build(fmt, tmp_path):
    """The phase timeline (cc/sm80/decode/timeline.cuh, diagnostic build switch JAX_MSA_DECODE_TIMELINE): the default
    build reads no timer; in the timeline build the one-team kernel reads %globaltimer and clock64 once at each of the
    7 phase marks and %globaltimer at the 2 per-warp marks, each team kernel (FP8: two teams at one and two CTAs an SM;
    NVFP4: two and three teams) both at its 4 marks (entry, chunk table, loop end, output stored: one reading for its 4 last phases)
    and %globaltimer at the 2 per-warp marks; no spills."""
    unit = f"sm80/decode/decode_{fmt}.cu"
    sass, _ = sass_tools.compile_unit(sass_tools.tools(), unit, "sm_90a", tmp_path)
    assert not re.search(r"SR_GLOBALTIMER|SR_CLOCK", sass)
    sass, log = sass_tools.compile_unit(sass_tools.tools(), unit, "sm_90a", tmp_path,
                                        defines=("JAX_MSA_DECODE_TIMELINE=1",))
    teams = len(LAYOUTS[fmt]) - 1  # team kernels in the unit
    assert len(re.findall(r"SR_GLOBALTIMERLO", sass)) == 9 + 6 * teams
    assert len(re.findall(r"SR_CLOCKLO", sass)) == 7 + 4 * teams
    assert_no_spills(log)


def main_loop(sass, kernel):
    """The SASS instructions of `kernel`'s chunk loop: the shortest backward branch whose body holds the MMAs."""
    text = sass.split(f".text.{kernel}:", 1)[1].split("\n.text.", 1)[0]
    instructions, labels = [], {}
    for line in text.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        op = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if op:
            instructions.append(op.group(1))
    best = None
    for end, ins in enumerate(instructions):
        target = re.search(r"BRA\s+(?:\S+\s+)?`?\(?(\.L_x_\d+)", ins)
        start = labels.get(target.group(1), end) if target else end
        if start < end and any("HMMA" in x for x in instructions[start:end]):
            if best is None or end - start < best[1] - best[0]:
                best = (start, end)
    assert best is not None, f"no loop with MMAs in {kernel}"
    return instructions[best[0]:best[1] + 1]


def test_decode_nvfp4_loop_keeps_lane_addresses(tmp_path):
    """The NVFP4 loop (issue-bound) takes its lane-fixed addresses from registers set before the loop (ChunkIO's
    lane_loads, kept()): no special-register read (S2R / S2UR) inside the loop of any of its kernels (NVVM would
    otherwise rebuild them from %tid.x / %ctaid.y at every chunk, ~40 instructions), its 5 copies a chunk (4 data
    units, 1 scale unit) and its 32 MMAs; at most 560 instructions (555 / 542 / 541 when written)."""
    sass, _ = sass_tools.compile_unit(sass_tools.tools(), "sm80/decode/decode_nvfp4.cu", "sm_90a", tmp_path)
    kernels = sorted(set(re.findall(r"\.text\.(\S*sparse_decode_kernel\S*):", sass)))
    assert len(kernels) == len(LAYOUTS["nvfp4"])
    for kernel in kernels:
        loop = main_loop(sass, kernel)
        ops = [re.sub(r"^@!?U?P\w+\s+", "", x).split()[0] for x in loop]
        assert not [x for x in ops if x.startswith(("S2R", "S2UR"))], kernel
        assert sum(op.startswith("LDGSTS") for op in ops) == 5, kernel
        assert sum(op.startswith("HMMA") for op in ops) == 32, kernel
        assert len(loop) <= 560, (kernel, len(loop))
