"""examples/bench: bench_decode.py's distinct-block share for q_len > 1 (its bandwidth over distinct blocks) is the
expectation of the top-k rows its own generator draws; the ncu timing scripts flush the caches unless told not to;
plan_completion.py's schedules cover every plan edge once, in tiles the plan could hold."""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples" / "bench"))
import bench_decode  # noqa: E402

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
