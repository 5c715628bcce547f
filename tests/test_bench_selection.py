"""examples/bench: bench_decode.py's distinct-block share for q_len > 1 (its bandwidth over distinct blocks) is the
expectation of the top-k rows its own generator draws; the ncu timing scripts flush the caches unless told not to."""

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
