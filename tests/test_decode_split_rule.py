"""The CUDA decode's split-K rule (ops.decode_num_splits): one CTA an SM for bf16 caches, two for FP8 / NVFP4, on the
H200's 132 SMs, at most top-k splits, with the cluster sizes found slow replaced (ops.DECODE_SPLITS_INSTEAD). The
expected factors are the fastest ones of the sweeps in docs/BENCHMARKS.md ("Split rule per format", H200; "The split
rule without slow cluster sizes" and "On an H100: FP8's team CTA two an SM and NVFP4's three-team CTA", H100)."""

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
    (KVFormat.NVFP4, 32, 4, 1, 3),   # 128 pairs: 3 teams 23.4 / 23.3 us against 2 teams' 24.4 / 24.0 (H100)
    (KVFormat.FP8, 32, 1, 1, 8),     # 14.9 us against 15.7 with 4
    (KVFormat.BF16, 1, 4, 1, 16),    # B = 1: as many splits as top-k slots
    (KVFormat.FP8, 1, 1, 1, 16),
    (KVFormat.BF16, 256, 4, 1, 1),   # enough pairs: no split
])
def test_decode_split_factor(fmt, batch, hkv, q_len, want):
    assert ops.decode_num_splits(_cfg(fmt, batch, hkv), q_len) == want


@pytest.mark.parametrize("fmt, batch, want, was", [
    (KVFormat.FP8, 17, 2, 3),      # 68 pairs: the two-team CTA instead of 3-CTA clusters, 19.6 us against 21.6
    (KVFormat.FP8, 22, 2, 3),      # 88 pairs: 22.2 us against 25.9 (H100)
    (KVFormat.FP8, 24, 2, 2),      # 96 pairs: the rule's own 2
    (KVFormat.FP8, 12, 5, 5),      # 48 pairs: FP8's 5 stays (within 2.5% of 4)
    (KVFormat.NVFP4, 17, 4, 3),    # 68 pairs: 21.7 against 21.5 (a tie; the same rule as at 88)
    (KVFormat.NVFP4, 22, 4, 3),    # 88 pairs: 22.2 us against 27.4 (H100)
    (KVFormat.NVFP4, 12, 4, 5),    # 48 pairs: 17.3 against 18.4
    (KVFormat.NVFP4, 10, 8, 6),    # 40 pairs: 16.0 against 18.3
    (KVFormat.NVFP4, 9, 8, 7),     # 36 pairs: 15.8 against 18.4
    (KVFormat.NVFP4, 14, 4, 4),    # 56 pairs: the rule's own 4
    (KVFormat.NVFP4, 24, 3, 2),    # 96 pairs: the three-team CTA, 23.1 / 23.2 us against 23.6 / 23.8 (H100)
    (KVFormat.NVFP4, 33, 3, 2),    # 132 pairs: the last of the band (one three-team CTA an SM)
    (KVFormat.NVFP4, 34, 1, 1),    # 136 pairs: 1 split (NVFP4 has no two-an-SM team CTA)
    (KVFormat.BF16, 10, 3, 3),     # 40 pairs: bf16's 3 stays (2 / 3 / 4 within 2.5%)
])
def test_decode_split_factor_avoids_slow_cluster_sizes(fmt, batch, want, was):
    """64/4 (Hkv 4), q_len 1: the factors DECODE_SPLITS_INSTEAD replaces (was: the rule's factor before it)."""
    cfg = _cfg(fmt, batch, 4)
    assert (132 * ops.DECODE_CTAS_PER_SM[fmt]) // (batch * 4) == was
    assert ops.decode_num_splits(cfg, 1) == want


@pytest.mark.parametrize("batch, want", [
    (33, 2),     # 132 pairs: the plain rule's own 2 (the two-team CTA at one CTA an SM)
    (34, 2),     # 136 pairs: 2 splits (two team CTAs an SM) rather than 1
    (40, 2),     # 160 pairs: 29.9 / 30.0 us against 32.0 with 1 (H200)
    (48, 2),     # 192 pairs: 31.2 / 30.7 us against 32.2 / 32.4 (H200)
    (49, 2),     # 196 pairs: the last 2 (<= 1.5 x 132 = 198)
    (50, 1),     # 200 pairs: 1 split
    (64, 1),     # 256 pairs: 1 split 36.7 us, 2 splits 37.0 / 36.8 (a tie, H200)
    (256, 1),    # 1024 pairs: 1 split 132.9 / 133.2 us, 2 splits 140.6 / 140.2 (H200)
])
def test_decode_fp8_two_team_ctas_an_sm(batch, want):
    """FP8, 64/4 (Hkv 4), q_len 1: where the plain rule gives 1 split, 2 up to DECODE_TWO_TEAM_PAIRS_PER_SM (1.5)
    pairs an SM (the launcher then runs the team CTAs two an SM); 132 pairs keep the rule's own 2."""
    assert ops.decode_num_splits(_cfg(KVFormat.FP8, batch, 4), 1, num_sms=132, compute_capability=(9, 0)) == want


@pytest.mark.parametrize("cc, want", [((9, 0), 2), ((10, 0), 2), ((8, 0), 2), ((8, 6), 1), ((8, 9), 1), ((12, 0), 1)])
def test_decode_two_team_band_only_where_two_ctas_fit(cc, want):
    """The 2-split band needs SMs that hold two team CTAs (68 KB of dynamic shared memory each): 228 / 164 KB SMs do,
    the 100 KB ones of sm_86 / sm_89 / sm_120 do not (their launcher keeps one an SM: two waves)."""
    assert ops.decode_num_splits(_cfg(KVFormat.FP8, 40, 4), 1, num_sms=132, compute_capability=cc) == want


def test_cuda_compute_capability_without_a_gpu():
    assert ops.cuda_compute_capability() == (9, 0)  # no CUDA device in the CPU suite: the H200's


def test_decode_two_team_pairs_only_where_the_kernel_has_them():
    """The rule's 2 splits past one pair an SM only for the formats with a two-an-SM team CTA (cc/sm80/decode/config.h:
    FormatTraits::kTwoPerSmTeamStages > 0, FP8); bf16 and NVFP4 keep 1 split at 136-198 pairs; the threshold scales
    with the SM count."""
    from decode_traits import format_traits

    stages = format_traits("kTwoPerSmTeamStages")
    assert {fmt for fmt, n in stages.items() if n > 0} == set(ops.DECODE_TWO_TEAM_PAIRS_PER_SM) == {KVFormat.FP8}
    h200 = dict(num_sms=132, compute_capability=(9, 0))
    for fmt in (KVFormat.BF16, KVFormat.NVFP4):
        assert ops.decode_num_splits(_cfg(fmt, 40, 4), 1, **h200) == 1
    h100_pcie = dict(num_sms=114, compute_capability=(9, 0))
    assert ops.decode_num_splits(_cfg(KVFormat.FP8, 40, 4), 1, **h100_pcie) == 2   # 160 <= 171
    assert ops.decode_num_splits(_cfg(KVFormat.FP8, 44, 4), 1, **h100_pcie) == 1   # 176 > 171
    assert ops.decode_num_splits(_cfg(KVFormat.FP8, 40, 4, topk=1), 1, **h200) == 1  # never more than top-k


def test_decode_split_replacements_fit_the_sm():
    """A replacement never asks more CTAs an SM than the format's kernel fits (FormatTraits::kCtasPerSm: FP8 4,
    NVFP4 3), for any SM count; FP8's 2 is the two-team CTA and NVFP4's 3 (for 2) the three-team CTA, one a (token,
    KV head) each."""
    from decode_traits import format_traits

    fits = format_traits("kCtasPerSm")
    for fmt, table in ops.DECODE_SPLITS_INSTEAD.items():
        for was, instead in table.items():
            if instead > was:  # the most pairs that give `was`: sms * ctas // pairs == was
                assert instead * ops.DECODE_CTAS_PER_SM[fmt] <= fits[fmt] * was, (fmt, was, instead)


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


# ---------------------------------------------------------------------------------------------------------
# sparse_decode(num_splits=n): a fixed factor instead of the rule (batch invariance)
# ---------------------------------------------------------------------------------------------------------

def _decode_problem():
    from problems import make_decode_problem
    return make_decode_problem(31, seq_lens=[300, 129, 5], num_q_heads=16, num_kv_heads=2, topk=8)


def _decode_call_results(text):
    """The result types of every decode custom call in a lowered module's text."""
    import re
    from jax_msa import _ffi
    return [re.findall(r"tensor<([^>]*)>", line.split("->")[-1]) for line in text.splitlines()
            if re.search(rf"custom_call\s*@{_ffi.TARGET_DECODE}\b", line)]


@pytest.mark.parametrize("num_splits, want", [(None, 8), (1, 1), (3, 3), (32, 8)])
def test_fixed_num_splits_shapes_the_cuda_workspace(num_splits, want):
    """The CUDA lowering's split-K workspace has num_splits partial sets (capped at K = 8; None: the rule, here K
    since 6 pairs leave room for 22 CTAs each); one split writes the output directly (no workspace)."""
    import jax
    import jax_msa
    from jax_msa import _ffi

    if _ffi.TARGET_DECODE not in _ffi.cuda_targets():
        pytest.skip("built without the CUDA decode handler")
    p = _decode_problem()

    def fn(q, c, t):
        return jax_msa.sparse_decode(q, c, t, seq_lens=p.seq_lens, block_table=p.block_table, num_splits=num_splits)

    text = jax.jit(fn).trace(p.q, p.kv_cache, p.topk).lower(lowering_platforms=("cuda",)).as_text()
    (results,) = _decode_call_results(text)
    t, hq = p.q.shape[:2]
    if want == 1:
        assert results[2:] == ["0xf32", "0xf32"], results
    else:
        assert results[2:] == [f"{want}x{t}x{hq}x128xf32", f"{want}x{t}x{hq}xf32"], results


def test_bad_num_splits_are_refused():
    import jax
    import jax_msa
    from jax_msa import sharding

    p = _decode_problem()
    for bad, err in [(0, ValueError), (33, ValueError), (-1, ValueError), (2.0, TypeError), ("4", TypeError),
                     (True, TypeError)]:
        with pytest.raises(err, match="num_splits"):
            jax_msa.sparse_decode(p.q, p.kv_cache, p.topk, seq_lens=p.seq_lens, block_table=p.block_table,
                                  num_splits=bad)
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
    with pytest.raises(ValueError, match="num_splits"):
        sharding.sharded_sparse_decode(mesh, data_axis="data", model_axis=None, num_splits=0)
