"""The CUDA decode's split-K rule (ops.decode_num_splits): one CTA an SM for bf16 caches, two for FP8 / NVFP4, on the
H200's 132 SMs, at most top-k splits. The expected factors are the fastest ones of the H200 sweep in
docs/BENCHMARKS.md ("Split rule per format")."""

import types

import pytest

from jax_msa import ops
from jax_msa.kv_cache import KVFormat


def _cfg(fmt, batch, num_kv_heads, topk=16):
    return types.SimpleNamespace(kv_format=fmt, batch=batch, num_kv_heads=num_kv_heads, topk=topk)


@pytest.mark.parametrize("fmt, batch, hkv, q_len, want", [
    (KVFormat.BF16, 32, 4, 1, 1),    # 128 pairs: 35.4 us against 37.7 with 2 splits
    (KVFormat.BF16, 16, 4, 1, 2),    # 64 pairs: 23.4 us against 29.9 with 4
    (KVFormat.BF16, 32, 1, 1, 4),    # 32 pairs: 15.9 us against 21.9 with 8
    (KVFormat.BF16, 32, 1, 4, 1),    # q_len 4: 128 pairs
    (KVFormat.FP8, 32, 4, 1, 2),     # 25.3 us against 26.8 with 1
    (KVFormat.NVFP4, 32, 4, 1, 2),   # 28.6 us against 31.5 with 1
    (KVFormat.FP8, 32, 1, 1, 8),     # 14.9 us against 15.7 with 4
    (KVFormat.BF16, 1, 4, 1, 16),    # B = 1: as many splits as top-k slots
    (KVFormat.FP8, 1, 1, 1, 16),
    (KVFormat.BF16, 256, 4, 1, 1),   # enough pairs: no split
])
def test_decode_split_factor(fmt, batch, hkv, q_len, want):
    assert ops.decode_num_splits(_cfg(fmt, batch, hkv), q_len) == want


def test_decode_splits_never_exceed_topk():
    for fmt in KVFormat:
        assert ops.decode_num_splits(_cfg(fmt, 1, 1, topk=4), 1) == 4


def test_decode_splits_follow_the_sm_count():
    """Another GPU's SM count scales the rule (an H100 PCIe has 114); without a CUDA device, the H200's 132."""
    assert ops.cuda_sm_count() == 132  # no CUDA device in the CPU suite
    cfg = _cfg(KVFormat.BF16, 16, 4)  # 64 pairs
    assert ops.decode_num_splits(cfg, 1) == 2
    assert ops.decode_num_splits(cfg, 1, num_sms=114) == 1
    assert ops.decode_num_splits(_cfg(KVFormat.FP8, 32, 1), 1, num_sms=114) == 7
