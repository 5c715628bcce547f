"""Where a decode call's time goes, phase by phase, stamped on the GPU (run on the GPU machine).

Needs a diagnostic build of the CUDA module, never one for serving:

    JAX_MSA_CUDA=ON JAX_MSA_CUDA_ARCHS=90a-real JAX_MSA_DECODE_TIMELINE=ON BUILD_DIR=build/timeline \\
        .ci/build_inplace.sh

In it, every decode CTA that merges its split inside a thread-block cluster (split-K on sm_90+, the default there),
and every two-team CTA (FP8 / NVFP4 with 2 splits: the splits as the teams of one CTA, no cluster), stamps the global
nanosecond timer and its SM's cycle counter at its phase boundaries (cc/sm80/decode/timeline.cuh) into the split
workspace, which jax_msa._ffi.decode_call(return_workspace=True) hands back. The timeline build's kernels are not the
shipped ones (the stamps take registers: the NVFP4 two-team kernel 185 against 167 on sm_90a), so its durations
locate the time rather than reproduce it. For each case the call
runs on `--calls` rotating top-k sets (as bench_decode.py draws them), one jitted call at a time with the L2 flushed
before each (a 256 MB read: reading leaves no dirty lines, whose write-back would load the next call; `--no-flush`
keeps what the previous call left), and the stamps of every call are pooled. Printed per case:

- per phase, over the CTAs: duration in ns (median, p90, max) and in cycles (median);
- the warps before the warps' merge (4, or a two-team CTA's 8): how far the last warp's loop end trails warp 0's
  (and team 1's first warp's, for a two-team CTA), each warp's staging of its partial, and the merge's time from the
  last warp's staged partial to thread 0's partial staged for the cluster (a two-team CTA: its output stored);
- the kernel's span (first CTA entry to last CTA exit, ns), the spread of the CTAs' entries and exits;
- the cluster skew: per CTA, how long its staged partial waited for the cluster's last sibling (ns, median / max);
  a two-team CTA has no cluster phases (its rows for them are left out).

    python examples/bench/decode_timeline.py --case 64/4,1,32768,1,FP8 --case 16/1,32,32768,1,BF16
"""

import argparse
import os
import types

import jax
import jax.numpy as jnp
import numpy as np

from bench_decode import K, make_inputs, pool_pages
from jax_msa import KVFormat, _ffi, ops

# The constants below mirror the CUDA sources named beside them; tests/test_bench_selection.py
# (test_decode_timeline_constants_match_the_sources) checks each against its header.
# What each duration covers, from thread 0's marks (cc/sm80/decode/timeline.cuh, Phase)
PHASES = ["chunk table (top-k row, block table)", "query + chunks (warp 0)", "warp merge (slowest warp, staging)",
          "cluster barrier (last split staged)", "cluster merge (thread 0's units)", "exit barrier (cluster's tail)"]
WORDS = 32  # u64 a CTA (cc/sm80/decode/timeline.cuh: kTimelineWords)
WARP_LOOP_DONE, WARP_STAGED = 16, 24  # first word of each WarpPhase's per-warp stamps (ns; 8 slots, kTimelineWarps)
MAGIC = 0x54494D454C494E45  # word 7 of a stamped CTA (kTimelineMagic)
MAX_CLUSTER_SPLITS = 16  # cc/sm80/decode/cluster_launch.h: more splits take the combine kernel (no stamps)
TEAM_SPLITS = 2  # cc/sm80/decode/config.h, FormatTraits<F>::kTeamSplits: one CTA of two teams, 8 warps
TEAM_WARPS = 4  # cc/sm80/decode/config.h, kWarps: a one-team CTA's warps, and each team's
TEAM_FORMATS = (KVFormat.FP8, KVFormat.NVFP4)  # the formats that have a team variant
THREE_TEAM_FORMATS = (KVFormat.NVFP4,)  # 3 splits as three teams (config.h, FormatTraits::kThreeTeamStages > 0)
TIMELINE_WARPS = 8  # per-warp stamp slots (timeline.cuh: kTimelineWarps); a three-team CTA's last 4 warps have none


def stamps(partial_o, ctas):
    """[ctas, WORDS] uint64 from the workspace: [0, 7) ns at each phase, [7] MAGIC, [8, 15) cycles, [15] smid << 32 |
    chunks, [16, 24) ns at each warp's loop end, [24, 32) ns at each warp's partial staged (warps 0-3, or 0-7 in a
    two-team CTA). Raises when a CTA's magic
    word is missing (not a timeline build, or the splits were merged by the combine kernel, whose partials fill the
    workspace)."""
    raw = np.asarray(partial_o).reshape(-1).view(np.uint64)
    s = raw[: ctas * WORDS].reshape(ctas, WORDS)
    missing = int((s[:, 7] != MAGIC).sum())
    if missing:
        raise ValueError(f"{missing} of {ctas} CTAs left no timeline (a timeline build merging in clusters?)")
    return s


def run_case(case, calls, splits_override, flush):
    heads, batch, context, q_len, fmt = case.split(",")
    hq, hkv = (int(x) for x in heads.split("/"))
    batch, context, q_len, fmt = int(batch), int(context), int(q_len), KVFormat[fmt]
    cfg = types.SimpleNamespace(batch=batch, num_kv_heads=hkv, topk=K, kv_format=fmt)
    splits = splits_override or ops.decode_num_splits(cfg, q_len)
    if not 2 <= splits <= MAX_CLUSTER_SPLITS:
        print(f"| {case} | {splits} splits: not merged in a cluster (2..{MAX_CLUSTER_SPLITS}), no stamps |")
        return
    if os.environ.get("JAX_MSA_DECODE_CLUSTER_MERGE") == "0":  # every split count to the combine kernel
        print(f"| {case} | JAX_MSA_DECODE_CLUSTER_MERGE=0: the combine kernel's partials fill the workspace, no stamps |")
        return
    # the teams of one CTA a (token, KV head), no cluster: their number (0: clusters)
    as_teams = (fmt in TEAM_FORMATS and splits == TEAM_SPLITS) or (fmt in THREE_TEAM_FORMATS and splits == 3)
    teams = splits if as_teams else 0
    rng = np.random.default_rng(0)
    q, cache, topks, seq, bt = make_inputs(rng, fmt, hq, hkv, batch, context, q_len, calls,
                                           pool_pages(fmt, hkv, batch, context))
    scale = 1.0 if fmt == KVFormat.BF16 else 0.5
    scales = _ffi.scale_operands(None, jnp.float32(scale), jnp.float32(scale))
    call = jax.jit(lambda q, c, t, s, b: _ffi.decode_call(
        q, c, scales, t, s, b, softmax_scale=128 ** -0.5, kv_format=int(fmt), decode_query_len=q_len,
        workspace=_ffi.DecodeWorkspace(splits), return_workspace=True))
    ctas = (1 if teams else splits) * hkv * batch * q_len
    jax.block_until_ready(call(q, cache, topks[0], seq, bt))  # compile, warm up
    evict = jax.jit(jnp.sum)  # a read of 256 MB, five times the L2, that leaves no dirty lines behind
    buf = jnp.ones((64 << 20,), jnp.float32)
    calls_stamps = []
    for topk in topks:
        if flush:
            jax.block_until_ready(evict(buf))
        out = call(q, cache, topk, seq, bt)
        calls_stamps.append(stamps(jax.block_until_ready(out[2]), ctas).astype(np.int64))
    summarize(case, splits, calls_stamps, teams)


def summarize(case, splits, calls_stamps, teams=0):
    """Prints the phase table of one case from its calls' stamps ([ctas, WORDS] int64 each); teams: the CTAs' teams
    (True: TEAM_SPLITS; 0 / False: one-team CTAs merged in clusters), no cluster phases, the first TIMELINE_WARPS
    warps stamped."""
    teams = TEAM_SPLITS if teams is True else int(teams)
    ctas = len(calls_stamps[0])
    # a CTA's stamps must be ordered (a module without the timeline leaves the workspace as it was)
    ordered = [(np.diff(r[:, 0:7], axis=1) >= 0).all() and (r[:, 0] > 0).all() for r in calls_stamps]
    if not all(ordered):
        print(f"| {case} | {ordered.count(False)} of {len(ordered)} calls with unordered stamps: dropped |")
    good = [r for r, o in zip(calls_stamps, ordered) if o]
    if not good:
        return
    s = np.concatenate(good)  # [calls * ctas, WORDS]
    d_ns, d_cyc = np.diff(s[:, 0:7], axis=1), np.diff(s[:, 8:15], axis=1)
    steps = np.unique(d_ns[d_ns > 0])
    kind = f"as the {({2: 'two', 3: 'three'}).get(teams, teams)} teams of one CTA" if teams else "in clusters"
    print(f"\n{case}: {splits} splits {kind}, {ctas} CTAs a call, {len(good)} calls pooled; smallest timer step "
          f"{steps.min() if steps.size else 0} ns; chunks {'a split (team 0)' if teams else 'a CTA'} "
          f"{np.median(s[:, 15] & 0xFFFFFFFF):.0f} (median)")
    print("| phase | ns median | ns p90 | ns max | cycles median |")
    print("|---|---|---|---|---|")
    for i, name in enumerate(PHASES):
        if teams and i > 2:  # the cluster phases: one stamp with the merge's end in a two-team CTA
            continue
        print(f"| {name} | {np.median(d_ns[:, i]):.0f} | {np.percentile(d_ns[:, i], 90):.0f} | {d_ns[:, i].max():.0f} "
              f"| {np.median(d_cyc[:, i]):.0f} |")
    t0 = np.array([r[:, 0].min() for r in good])
    span = np.array([r[:, 6].max() for r in good]) - t0
    entries = np.array([r[:, 0].max() for r in good]) - t0
    exits = np.array([r[:, 6].max() - r[:, 6].min() for r in good])
    # the CTAs of one cluster, one (token, KV head), are consecutive in the linear index (split fastest): how long
    # each CTA's staged partial waited for its cluster's last one
    warps = min(teams * TEAM_WARPS, TIMELINE_WARPS) if teams else TEAM_WARPS
    loop_done = s[:, WARP_LOOP_DONE:WARP_LOOP_DONE + warps]
    staged_w = s[:, WARP_STAGED:WARP_STAGED + warps]
    trail = loop_done.max(axis=1) - loop_done[:, 0]  # the last warp's loop end after warp 0's
    staging = (staged_w - loop_done).reshape(-1)  # per warp: its loop end to its partial staged
    merge = s[:, 3] - staged_w.max(axis=1)  # the last warp's partial staged to thread 0's partial for the cluster
    exit_name = "CTA exits spread" + (" (thread 0's output stored)" if teams else "")
    rows = [("kernel span (first entry to last exit)", span), ("CTA entries spread", entries), (exit_name, exits)]
    if teams:  # team 1's first warp against team 0's: how unevenly the two splits' loops end
        rows.append((f"team 1's loop end after team 0's (warp {TEAM_WARPS} - warp 0)",
                     loop_done[:, TEAM_WARPS] - loop_done[:, 0]))
    else:
        staged = np.concatenate([r[:, 3].reshape(-1, splits) for r in good])
        rows.append(("wait for the cluster's last partial", (staged.max(axis=1, keepdims=True) - staged).reshape(-1)))
    rows += [("last warp's loop end after warp 0's", trail), ("a warp's staging (loop end to partial)", staging),
             ("warps' merge after the last warp staged", merge)]
    for name, x in rows:
        print(f"| {name} | {np.median(x):.0f} | {np.percentile(x, 90):.0f} | {x.max():.0f} | |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", action="append", help="heads,batch,context,q_len,fmt, e.g. 64/4,1,32768,1,FP8")
    ap.add_argument("--calls", type=int, default=16)
    ap.add_argument("--splits", type=int, help="force the split-K factor (default: the library's rule)")
    ap.add_argument("--no-flush", action="store_true", help="leave L2 as the previous call left it")
    args = ap.parse_args()
    if not _ffi.cuda_build_options().get("decode_timeline"):
        raise SystemExit("decode_timeline.py needs a CUDA module built with JAX_MSA_DECODE_TIMELINE=ON (docstring)")
    print(f"device: {jax.devices()[0].device_kind}")
    for case in args.case or ["64/4,1,32768,1,FP8", "64/4,1,32768,1,BF16", "64/4,1,32768,1,NVFP4",
                              "16/1,32,32768,1,BF16", "64/4,32,32768,1,FP8", "64/4,32,32768,1,NVFP4"]:
        run_case(case, args.calls, args.splits, not args.no_flush)


if __name__ == "__main__":
    main()
