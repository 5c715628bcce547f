"""examples/bench/bench_decode.py: the distinct-block share it reports for q_len > 1 (its bandwidth over distinct
blocks) is the expectation of the top-k rows its own generator draws."""

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
