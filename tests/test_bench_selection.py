"""examples/bench: bench_decode.py's distinct-block share for q_len > 1 (its bandwidth over distinct blocks) is the
expectation of the top-k rows its own generator draws; the ncu timing scripts flush the caches unless told not to;
plan_completion.py's schedules cover every plan edge once, in tiles the plan could hold; shared_blocks.py counts the
plan's edges and, per tile, what a brute-force count over token sets gives."""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples" / "bench"))
import bench_decode  # noqa: E402
from decode_traits import format_traits  # noqa: E402

from jax_msa import KVFormat  # noqa: E402


@pytest.mark.parametrize("context, q_len", [(4096, 4), (4096 + 2, 4), (8192, 2), (4096, 1)])
def test_distinct_block_fraction_matches_the_generator(context, q_len):
    batch, hkv, rotations = 32, 2, 8
    rng = np.random.default_rng(3)
    _, _, topks, _, _ = bench_decode.make_inputs(rng, KVFormat.BF16, 2 * hkv, hkv, batch, context, q_len, rotations,
                                                 pool_pages=64)
    shares = []
    for topk in topks:  # [hkv, batch * q_len, K]: the ids of one (request, KV head) are q_len consecutive rows
        ids = np.asarray(topk).reshape(hkv, batch, q_len * bench_decode.K)
        shares += [len(np.unique(row)) / row.size for row in ids.reshape(-1, q_len * bench_decode.K)]
    expected = bench_decode.distinct_block_fraction(context, q_len)
    # 512 (request, head) rows: the mean's standard error is below 0.3%
    assert abs(np.mean(shares) - expected) < 0.01, (np.mean(shares), expected)
    if q_len == 1:
        assert expected == 1.0


def test_ncu_command_flushes_caches_unless_told_not_to():
    import ncu_util

    flushed = ncu_util.ncu_command("k", 4, ["python3", "x.py"])
    kept = ncu_util.ncu_command("k", 4, ["python3", "x.py"], flush_caches=False)
    assert "--cache-control" not in flushed  # ncu's default: flush all caches before every profiled kernel
    i = kept.index("--cache-control")
    assert kept[i + 1] == "none"
    assert kept[:i] + kept[i + 2:] == flushed  # nothing else differs
    assert flushed[-2:] == ["python3", "x.py"]


def test_plan_completion_schedules_cover_every_edge_once():
    import jax
    import jax.numpy as jnp
    import plan_completion

    import jax_msa

    n, hkv, window = 1000, 2, 256
    topk = plan_completion.make_topk(np.random.default_rng(1), n, hkv)
    cu, sl = jnp.array([0, n], jnp.int32), jnp.array([n], jnp.int32)
    plan = jax.jit(lambda t: jax_msa.build_prefill_plan(t, cu, sl, max_blocks=8))(jnp.asarray(topk))
    n_items = int(np.asarray(plan.num_work)[0])
    row_ptr, counts = np.asarray(plan.row_ptr), np.asarray(plan.query_edge_count)
    edges = {(h, e) for h in range(hkv) for e in range(row_ptr[h, -1])}

    item, g, edge = plan_completion.edge_items(plan, n_items)
    assert sorted(zip(g.tolist(), edge.tolist())) == sorted(edges)
    wg, wedge, witem, w_items = plan_completion.window_items(plan, window)
    assert sorted(zip(wg.tolist(), wedge.tolist())) == sorted(edges)
    tokens = np.asarray(plan.edge_query)[wg, wedge]
    for i in range(w_items):  # a window item: one head, one row, one window, at most queries_per_tile tokens
        sel = witem == i
        assert 1 <= sel.sum() <= plan.queries_per_tile
        assert len(set(wg[sel])) == 1 and len(set(tokens[sel] // window)) == 1
        rows = {int(np.searchsorted(row_ptr[wg[sel][0]], e, side="right")) - 1 for e in wedge[sel]}
        assert len(rows) == 1

    for times in (plan_completion.contiguous_times(n_items, 7), plan_completion.round_robin_times(n_items, 7, 3)):
        assert times.shape == (n_items,) and times.min() > 0 and times.max() == 1.0
    done, first = plan_completion.completion(hkv, n, g, np.asarray(plan.edge_query)[g, edge],
                                             plan_completion.round_robin_times(n_items, 7, 3)[item])
    assert ((done > 0) == (counts > 0)).all() and (first[counts > 0] <= done[counts > 0]).all()


def test_shared_blocks_counts_the_plan_edges_and_matches_a_brute_force_count():
    import jax
    import jax.numpy as jnp
    import shared_blocks

    import jax_msa

    n, hkv = 1000, 2
    topk = shared_blocks.make_topk(np.random.default_rng(2), n, hkv)
    topk[0, 5, 3] = topk[0, 5, 4]  # a duplicate,
    topk[1, 300, 2] = 5  # a block after the token's own (5 * 128 > 300),
    topk[1, 901, 4] = 8  # an id past the request's 8 blocks,
    topk[1, 901, 5] = -1  # a hole: none of them an edge
    cu, sl = jnp.array([0, n], jnp.int32), jnp.array([n], jnp.int32)
    plan = jax.jit(lambda t: jax_msa.build_prefill_plan(t, cu, sl, max_blocks=8))(jnp.asarray(topk))
    row_ptr, edge_query = np.asarray(plan.row_ptr), np.asarray(plan.edge_query)
    sets = []
    for g in range(hkv):
        plan_pairs = {(int(edge_query[g, e]), r) for r in range(8) for e in range(row_ptr[g, r], row_ptr[g, r + 1])}
        tok, blk = shared_blocks.selected_pairs(topk[g])
        assert sorted(zip(tok.tolist(), blk.tolist())) == sorted(plan_pairs)
        sets.append([{b for (t, b) in plan_pairs if t == q} for q in range(n)])

    for tile, share in [(7, 1.0), (7, 0.5), (128, 0.75)]:  # 1000 / 7: the last tile holds 6 tokens
        edges = partials = shared_pairs = masked = 0
        for g in range(hkv):
            for t0 in range(0, n, tile):
                toks = range(t0, min(n, t0 + tile))
                count = {}
                for q in toks:
                    for b in sets[g][q]:
                        count[b] = count.get(b, 0) + 1
                shared = {b for b, c in count.items() if c >= share * len(toks)}
                shared_pairs += len(shared)
                masked += sum(len(toks) - count[b] for b in shared)
                for q in toks:
                    edges += len(sets[g][q])
                    partials += bool(sets[g][q] & shared) + len(sets[g][q] - shared)
        assert shared_blocks.count_lever(topk, tile, share) == (edges, partials, shared_pairs, masked)


def test_decode_timeline_reads_the_workspace_layout():
    """decode_timeline.py's reader: WORDS (32) u64 a CTA at the start of the split workspace
    (cc/sm80/decode/timeline.cuh), and decode_call(return_workspace=True) hands the workspaces back with their shapes
    (here through the CPU handler, which leaves them alone)."""
    import jax
    import jax.numpy as jnp

    import decode_timeline
    from jax_msa import _ffi

    splits, t, hq, d, ctas = 4, 3, 16, 128, 4 * 2 * 3
    want = np.arange(ctas * decode_timeline.WORDS, dtype=np.uint64).reshape(ctas, decode_timeline.WORDS)
    want[:, 7] = decode_timeline.MAGIC
    po = np.zeros((splits, t, hq, d), np.float32)
    po.reshape(-1)[: want.size * 2] = want.reshape(-1).view(np.float32)
    np.testing.assert_array_equal(decode_timeline.stamps(po, ctas), want)
    po.reshape(-1)[decode_timeline.WORDS * 2 * 5 + 14] = 0  # CTA 5's magic word: no timeline there
    with pytest.raises(ValueError, match="1 of 24 CTAs"):
        decode_timeline.stamps(po, ctas)

    hkv, k, pages = 2, 4, 8
    q = jnp.zeros((t, hq, d), jnp.bfloat16)
    cache = jnp.zeros((pages, hkv, 128, 2 * d), jnp.bfloat16)
    topk = jnp.zeros((hkv, t, k), jnp.int32)
    seq, bt = jnp.full((t,), 128, jnp.int32), jnp.zeros((t, 1), jnp.int32)
    out = jax.jit(lambda *a: _ffi.decode_call(*a, softmax_scale=0.1, kv_format=0, decode_query_len=1,
                                              workspace=_ffi.DecodeWorkspace(splits), return_workspace=True))(
        q, cache, _ffi.scale_operands(None, None, None), topk, seq, bt)
    assert [x.shape for x in out] == [(t, hq, d), (t, hq), (splits, t, hq, d), (splits, t, hq)]


def test_decode_timeline_constants_match_the_sources():
    """decode_timeline.py mirrors the stamp layout and the launch constants of the CUDA sources (it reads a workspace
    the kernel wrote): check each against the header it comes from, so that a change there cannot leave the reader
    silently misreading the stamps."""
    import re

    import decode_timeline

    src = ROOT / "cc" / "sm80" / "decode"
    timeline = (src / "timeline.cuh").read_text()

    def constant(text, name):
        return int(re.search(rf"constexpr\s+\w+\s+{name}\s*=\s*(0x[0-9A-Fa-f]+|\d+)", text).group(1), 0)

    assert decode_timeline.WORDS == constant(timeline, "kTimelineWords")
    assert decode_timeline.MAGIC == constant(timeline, "kTimelineMagic")
    warps = constant(timeline, "kTimelineWarps")
    warp_phases = dict(re.findall(r"(k\w+) = (\d+),", re.search(r"enum class WarpPhase[^}]*}", timeline).group(0)))
    # timeline_warp_mark's slot: 16 + kTimelineWarps * phase + warp
    assert re.search(r"16 \+ kTimelineWarps \* int\(phase\) \+ int\(tid >> 5\)", timeline)
    assert decode_timeline.WARP_LOOP_DONE == 16 + warps * int(warp_phases["kLoopDone"])
    assert decode_timeline.WARP_STAGED == 16 + warps * int(warp_phases["kStaged"])
    phases = re.findall(r"(k\w+) = (\d+),", re.search(r"enum class Phase [^}]*}", timeline).group(0))
    assert len(decode_timeline.PHASES) == len(phases) - 1 == constant(timeline, "kPhases") - 1  # between the marks
    launch = (src / "cluster_launch.h").read_text()
    assert decode_timeline.MAX_CLUSTER_SPLITS == constant(launch, "kMaxClusterSplits")
    config = (src / "config.h").read_text()
    teams = format_traits("kTeamSplits")
    assert {fmt for fmt, n in teams.items() if n > 1} == set(decode_timeline.TEAM_FORMATS), teams
    assert {teams[fmt] for fmt in decode_timeline.TEAM_FORMATS} == {decode_timeline.TEAM_SPLITS}, teams
    assert decode_timeline.TEAM_WARPS == constant(config, "kWarps")
    # the per-warp slots hold a two-team CTA's warps
    assert decode_timeline.TEAM_SPLITS * decode_timeline.TEAM_WARPS <= warps == decode_timeline.TIMELINE_WARPS
    three = {fmt for fmt, n in format_traits("kThreeTeamStages").items() if n > 0}
    assert three == set(decode_timeline.THREE_TEAM_FORMATS), three


def test_decode_timeline_summary(capsys):
    """decode_timeline.summarize on synthetic stamps: per-phase durations and the cluster wait come out as built."""
    import decode_timeline

    splits, ctas = 4, 8  # two clusters of 4
    r = np.zeros((ctas, decode_timeline.WORDS), np.int64)
    r[:, 0:7] = 1000 + np.array([0, 100, 400, 500, 700, 750, 760])  # ns
    r[:, 3] += np.tile([0, 10, 20, 30], 2)  # staged partials 0-30 ns apart within each cluster
    r[:, 4:7] += 30
    r[:, 8:15] = np.array([0, 190, 760, 950, 1330, 1425, 1444])
    r[:, 7] = decode_timeline.MAGIC
    r[:, 15] = (7 << 32) | 2
    r[:, 16:20] = 1400 + np.array([0, 40, 60, 20])  # the warps' loop ends: the last 60 ns after warp 0's
    r[:, 24:28] = r[:, 16:20] + 30  # each warp stages its partial 30 ns after its loop end (the last at 1490)
    decode_timeline.summarize("x", splits, [r, r.copy()])
    text = capsys.readouterr().out
    assert "| chunk table (top-k row, block table) | 100 | 100 | 100 | 190 |" in text
    assert "| query + chunks (warp 0) | 300 | 300 | 300 | 570 |" in text
    assert "| wait for the cluster's last partial | 15 |" in text
    assert "| kernel span (first entry to last exit) | 790 |" in text
    assert "| last warp's loop end after warp 0's | 60 | 60 | 60 | |" in text
    assert "| a warp's staging (loop end to partial) | 30 | 30 | 30 | |" in text
    assert "| warps' merge after the last warp staged | 25 |" in text  # 1500 + (0, 10, 20, 30) - 1490: median 25


def test_decode_timeline_summary_of_two_team_ctas(capsys):
    """The two-team CTA's stamps (8 warps, no cluster phases: phases 3-6 one reading): the cluster rows are left out,
    the 8 warps are read, and team 1's loop end is reported against team 0's."""
    import decode_timeline

    ctas = 6
    r = np.zeros((ctas, decode_timeline.WORDS), np.int64)
    r[:, 0:7] = 1000 + np.array([0, 100, 400, 520, 520, 520, 520])  # ns; the output stored at 1520
    r[:, 8:15] = np.array([0, 190, 760, 990, 990, 990, 990])
    r[:, 7] = decode_timeline.MAGIC
    r[:, 15] = (3 << 32) | 16
    r[:, 16:24] = 1400 + np.array([0, 10, 20, 30, 50, 60, 90, 70])  # team 1 (warps 4-7) ends 50-90 ns later
    r[:, 24:32] = r[:, 16:24] + 20  # the last warp staged at 1510
    decode_timeline.summarize("t", 2, [r], teams=True)
    text = capsys.readouterr().out
    assert "as the two teams of one CTA" in text
    assert "| warp merge (slowest warp, staging) | 120 | 120 | 120 | 230 |" in text
    assert "cluster" not in text.split("calls pooled")[1]  # no cluster rows
    assert "| team 1's loop end after team 0's (warp 4 - warp 0) | 50 |" in text
    assert "| last warp's loop end after warp 0's | 90 |" in text
    assert "| warps' merge after the last warp staged | 10 |" in text  # 1520 - 1510


def _bench_case_with_output(monkeypatch, outputs):
    """bench_case on a small BF16 case (the CPU handler here), with its jitted program's output kept."""
    seen = []
    real = bench_decode.median_p10_p90

    def timed(fn, args, repeats):
        seen.append(fn(*args))
        return real(fn, args, repeats)

    monkeypatch.setattr(bench_decode, "median_p10_p90", timed)
    r = bench_decode.bench_case(KVFormat.BF16, 16, 1, 1, 4096, 1, repeats=1, pool_gb=0.0, outputs=outputs)
    return r, seen[0]


def test_bench_decode_stacked_and_listed_programs(monkeypatch):
    """bench_case's jitted program of R calls: stacked into one array (the default, which keeps the runtime's per-array
    work out of the per-call time) or as R arrays. Both return a finite time, and the stacked rows are the listed
    outputs, call for call (same inputs: same seed)."""
    r_stacked, stacked = _bench_case_with_output(monkeypatch, "stacked")
    r_listed, listed = _bench_case_with_output(monkeypatch, "list")
    rotations = int(min(64, max(8, np.ceil(200e6 / r_stacked["bytes"]))))
    for r in (r_stacked, r_listed):
        assert np.isfinite(r["us"]) and r["us"] > 0
    assert stacked.shape == (rotations, 1, 16, 128)
    assert isinstance(listed, list) and len(listed) == rotations
    for i, out in enumerate(listed):
        assert np.array_equal(np.asarray(stacked[i]), np.asarray(out)), i


def test_bench_decode_main_passes_outputs(monkeypatch):
    got = []

    def fake_case(*args, **kwargs):
        got.append(args[-1])
        return dict(us=1.0, p10=1.0, p90=1.0, bytes=1, tbps=1.0, distinct=1.0)

    monkeypatch.setattr(bench_decode, "bench_case", fake_case)
    monkeypatch.setattr(sys, "argv", ["bench_decode.py", "--heads", "16/1", "--batch", "1", "--context", "4096",
                                      "--q-len", "1", "--fmt", "BF16", "--no-dense", "--outputs", "list"])
    bench_decode.main()
    assert got == ["list"]
