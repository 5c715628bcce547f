"""Decode kernel (cc/sm80, warp-MMA) vs the fp32 reference on the GPU (run on the H200: `.ci/gpu_run.sh test`).

Every format x GQA 8/16 x q_len 1/4 x batch 1/7/64 with contexts off the 128 grid (every top-k row also holds
holes, ids beyond the sequence and duplicates), plus corner cases (rows of holes only, short contexts, draft tokens
straddling blocks, contexts shorter than the draft (negative positions), valid blocks whose page is out of range,
top-k sizes, FP8 query, query rows of extreme magnitude, layers with their own scales folded by jax.vmap).
Outputs are poisoned with NaN before each launch (JAX_MSA_DEBUG_POISON=1), so an unwritten element shows.
Bound: the kernel's error against the fp32 reference is at most 2x the error of a bf16 jnp implementation
(jax_msa.reference with precision="bf16") on the same inputs.
"""

import collections
import os

os.environ.setdefault("JAX_MSA_DEBUG_POISON", "1")  # read once by the CUDA handlers, before their first call

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_msa
from jax_msa import KVFormat
from bitwise import assert_bitwise_equal

pytestmark = pytest.mark.gpu

D = 128
HKV = 2
K = 16
# formats whose num_splits == 2 runs as the two 4-warp teams of one CTA (cc/sm80/decode/config.h, kTeamSplits)
TEAM_FORMATS = [KVFormat.FP8, KVFormat.NVFP4]
# formats whose num_splits == 3 runs as the three teams of one CTA (config.h, CtaLayout::kThreeTeams)
THREE_TEAM_FORMATS = [KVFormat.NVFP4]
# (format, num_splits) of every team layout: the two-team CTA (2 splits), the three-team CTA (3)
TEAM_SPLIT_CASES = [(fmt, 2) for fmt in TEAM_FORMATS] + [(fmt, 3) for fmt in THREE_TEAM_FORMATS]
TEAM_SPLIT_IDS = [f"{fmt.name}-{splits}" for fmt, splits in TEAM_SPLIT_CASES]


def _gpu():
    return [d for d in jax.devices() if d.platform == "gpu"]


PAGES = 64 * 26 + 3  # one cache size for every case: fewer distinct shapes to compile


_CACHES = {}


def _random_cache(fmt, k_scale=0.75, v_scale=1.25):
    """The format's random cache of PAGES pages and HKV heads, made once per test session in numpy (no compile) from a
    seed of its own, and shared by the cases, which differ in their queries, top-k rows and block tables: drawing its
    ~10^8 bf16 / e4m3 values took most of a case's time. bf16 normals, e4m3 of normals, random NVFP4 nibbles with e4m3
    block scales; every code decodes to a finite value. jnp arrays are immutable: a test that alters the cache
    builds a new one."""
    key = (fmt, k_scale, v_scale)
    if key not in _CACHES:
        rng = np.random.default_rng(9000 + int(fmt))
        shape = (PAGES, HKV, 128, 2 * D)
        scales = {} if fmt == KVFormat.BF16 else dict(k_scale=k_scale, v_scale=v_scale)
        if fmt == KVFormat.BF16:
            cache = rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.bfloat16)
        elif fmt == KVFormat.FP8:
            cache = rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.float8_e4m3fn)
        else:
            cache = rng.integers(0, 256, (PAGES, 2 * HKV, 128 * (D // 2 + D // 16)), dtype=np.uint8)
            sf = np.abs(rng.standard_normal((PAGES, 2 * HKV, 128 * D // 16))) * 0.3 + 2.0**-9
            cache[:, :, 128 * D // 2:] = sf.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
            cache = cache.reshape(PAGES, 2 * HKV, 128, D // 2 + D // 16)
        _CACHES[key] = jnp.asarray(cache), scales
    return _CACHES[key]


def make_case(seed, fmt, group, q_len, batch, *, corner=None):
    rng = np.random.default_rng(seed)
    hq = HKV * group
    seq = rng.integers(q_len + 1, 3000, batch)
    seq = np.where(seq % 128 == 0, seq + 1, seq)
    if corner == "short":  # contexts shorter than one block
        seq = rng.integers(q_len, 100, batch)
    if corner == "straddle":  # draft tokens fall in different blocks
        seq = 128 * rng.integers(1, 20, batch) + rng.integers(1, q_len, batch)
    if corner == "early":  # contexts shorter than the draft: the first tokens sit at negative positions (empty sets)
        seq = rng.integers(0, q_len, batch)
    seq = seq.astype(np.int32)
    max_blocks = 26
    perm = rng.permutation(PAGES).astype(np.int32)
    block_table = perm[: batch * max_blocks].reshape(batch, max_blocks)
    block_table[:, -1] = PAGES + 7  # a column no valid block reaches holds an invalid page id
    if corner == "bad_pages":  # valid blocks whose page is out of range: holes, never read
        bad = rng.random(block_table.shape) < 0.2
        block_table[bad] = rng.choice(np.array([-1, -7, PAGES, PAGES + 9, np.iinfo(np.int32).max,
                                                np.iinfo(np.int32).min], np.int32), size=int(bad.sum()))
    cache, scales = _random_cache(fmt)
    t = batch * q_len
    q = jnp.asarray(rng.standard_normal((t, hq, D)), jnp.bfloat16)
    topk = np.full((HKV, t, K), -1, np.int32)
    for tok in range(t):
        b = tok // q_len
        pos = seq[b] - q_len + tok % q_len
        n_blocks = -(-seq[b] // 128)
        for g in range(HKV):
            row = list(rng.integers(0, max(n_blocks, 1), K))
            row[0] = pos // 128  # the local block (-1 at a negative position)
            for j in range(K):
                r = rng.random()
                if r < 0.15:
                    row[j] = -1  # hole
                elif r < 0.22:
                    row[j] = n_blocks + rng.integers(0, 4)  # beyond the sequence
                elif r < 0.25:
                    row[j] = 10**6
                elif r < 0.35:
                    row[j] = row[rng.integers(0, K)]  # duplicate
            if corner == "holes" and g == 0 and tok % 2 == 0:
                row = [-1] * K
            topk[g, tok] = rng.permutation(row)
    return dict(q=q, kv_cache=cache, topk=jnp.asarray(topk), seq_lens=jnp.asarray(seq),
                block_table=jnp.asarray(block_table), decode_query_len=q_len, **scales)


_DEQUANTIZED = collections.OrderedDict()  # (id(cache), k_scale, v_scale) -> (cache, K, V): the last few caches' values


def _dequantized(case):
    """The case's cache as fp32 numpy K, V [P, Hkv, 128, D] (dequantize_cache: exactly the values every kernel sees;
    fp32 holds them exactly), kept for the next cases that share the cache (both numpy_decode passes of a check, and
    every case of a format)."""
    cache, ks, vs = case["kv_cache"], case.get("k_scale", 1.0), case.get("v_scale", 1.0)
    key = (id(cache), float(ks), float(vs))
    hit = _DEQUANTIZED.get(key)
    if hit is None or hit[0] is not cache:
        kf, vf = jax_msa.kv_cache.dequantize_cache(cache, D, ks, vs)
        hit = (cache, np.asarray(kf, np.float32), np.asarray(vf, np.float32))
        _DEQUANTIZED[key] = hit
        while len(_DEQUANTIZED) > 4:
            _DEQUANTIZED.popitem(last=False)
    _DEQUANTIZED.move_to_end(key)
    return hit[1], hit[2]


def numpy_decode(case, bf16):
    """MSA decode in numpy, straight from MSA.md section 2. bf16=False: float64 oracle. bf16=True: what a
    bf16 implementation computes (bf16 q, K, V and P, fp32 accumulation and softmax)."""
    q = np.asarray(case["q"].astype(jnp.float32), np.float64)
    if "q_scale" in case:
        q = q * case["q_scale"]
    kf, vf = _dequantized(case)
    topk, seq = np.asarray(case["topk"]), np.asarray(case["seq_lens"])
    bt, ql = np.asarray(case["block_table"]), case["decode_query_len"]
    t_total, hq, _ = q.shape
    group = hq // HKV
    dt = np.float32 if bf16 else np.float64
    rnd = (lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32)) if bf16 else (lambda x: x)
    out = np.zeros((t_total, hq, D))
    lse = np.full((t_total, hq), -np.inf)
    for t in range(t_total):
        b = t // ql
        pos = seq[b] - ql + t % ql
        n_blocks = min(-(-seq[b] // 128), bt.shape[1])
        for g in range(HKV):
            ids = sorted({i for i in topk[g, t] if 0 <= i < n_blocks and 128 * i <= pos})
            ids = [i for i in ids if 0 <= bt[b, i] < kf.shape[0]]
            if not ids:
                continue
            keys = np.concatenate([kf[bt[b, i], g] for i in ids]).astype(dt)
            vals = np.concatenate([vf[bt[b, i], g] for i in ids]).astype(dt)
            kpos = np.concatenate([128 * i + np.arange(128) for i in ids])
            keep = kpos <= pos
            qg = rnd(q[t, g * group:(g + 1) * group].astype(dt))
            s = (qg @ rnd(keys[keep]).T) * dt(D**-0.5)
            m = s.max(-1, keepdims=True)
            e = np.exp(s - m)
            l = e.sum(-1)
            out[t, g * group:(g + 1) * group] = (rnd(e) @ rnd(vals[keep])) / l[:, None]
            lse[t, g * group:(g + 1) * group] = m[:, 0] + np.log(l)
    return out, lse


def run_kernel(case, **static):
    """The kernel under jit; decode_query_len (and `static`, e.g. num_splits) are static."""
    arrays = {k: v for k, v in case.items() if k != "decode_query_len"}
    ql = case["decode_query_len"]
    return jax.jit(lambda c: jax_msa.sparse_decode(**c, decode_query_len=ql, return_lse=True, impl="kernel",
                                                   **static))(arrays)


def check_case(case, **static):
    return check_outputs(case, *run_kernel(case, **static))


def check_outputs(case, out, lse):
    """The kernel's out / lse for `case` against the float64 oracle, within 2x the bf16 implementation's error."""
    o = np.asarray(out, np.float32)
    lse = np.asarray(lse)
    assert not np.isnan(o).any(), "unwritten (NaN-poisoned) or NaN outputs"
    assert not np.isnan(lse).any()
    ref_out, ref_lse = numpy_decode(case, bf16=False)
    b16_out, b16_lse = numpy_decode(case, bf16=True)
    b16_out = b16_out.astype(ml_dtypes.bfloat16).astype(np.float64)  # outputs are bf16 in both
    empty = np.isneginf(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    assert np.all(o[empty] == 0.0), "empty selections must give exactly 0"
    k_err, b_err = np.abs(o - ref_out), np.abs(b16_out - ref_out)
    norm = max(np.linalg.norm(ref_out), 1e-30)
    assert np.linalg.norm(k_err) / norm <= 2 * np.linalg.norm(b_err) / norm + 1e-7
    assert k_err.max() <= 2 * b_err.max() + 2.0**-12, (k_err.max(), b_err.max())
    live = ~empty
    if live.any():
        # lse is fp32: besides 2x the bf16 implementation's error, allow 4 fp32 ulps of its magnitude (the same
        # 1e-5 as before for |lse| ~ 20; it matters only for the extreme query magnitudes, |lse| ~ 1e6)
        slack = np.maximum(1e-5, 4 * np.finfo(np.float32).eps * np.abs(ref_lse[live]))
        excess = np.abs(lse[live] - ref_lse[live]) - slack
        assert excess.max() <= 2 * np.abs(b16_lse[live] - ref_lse[live]).max(), excess.max()
    return out, lse


def counting_merges(run):
    """run()'s result, and the split-K decode launches it made by merge path ({'combine_kernel', 'cluster', 'teams',
    'teams_two_per_sm'}: the module's counters, cc/sm80/decode/cluster_launch.h; each run_kernel is a fresh jit, so
    nothing is replayed from an earlier capture)."""
    from jax_msa import _ffi

    before = _ffi.decode_merge_launches()
    result = run()
    return result, {k: v - before[k] for k, v in _ffi.decode_merge_launches().items()}


def check_on_teams(case, num_splits=2):
    """check_case with num_splits (None: the split rule's choice, which the caller sets) on a (format, num_splits) of
    TEAM_SPLIT_CASES, and the module's launch counters showing that a team kernel ran (not the cluster, not the
    combine kernel)."""
    result, used = counting_merges(lambda: check_case(case, num_splits=num_splits))
    # one CTA an SM, or (FP8, more pairs than SMs) two: the same bits
    assert used["teams"] + used["teams_two_per_sm"] >= 1 and used["cluster"] == used["combine_kernel"] == 0, used
    return result


@pytest.mark.skipif(not _gpu() or not jax_msa.cuda_available(), reason="needs a CUDA GPU and the CUDA build")
@pytest.mark.parametrize("batch", [1, 7, 64])
@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("group", [8, 16])
@pytest.mark.parametrize("fmt", list(KVFormat), ids=lambda f: f.name)
def test_decode_matrix(fmt, group, q_len, batch):
    check_case(make_case(1000 * int(fmt) + 100 * group + 10 * q_len + batch, fmt, group, q_len, batch))


@pytest.mark.skipif(not _gpu() or not jax_msa.cuda_available(), reason="needs a CUDA GPU and the CUDA build")
@pytest.mark.parametrize("corner", ["holes", "short", "straddle", "early", "bad_pages"])
@pytest.mark.parametrize("fmt", list(KVFormat), ids=lambda f: f.name)
def test_decode_corners(fmt, corner):
    check_case(make_case(7 + int(fmt), fmt, 16, 4, 5, corner=corner))


@pytest.mark.skipif(not _gpu() or not jax_msa.cuda_available(), reason="needs a CUDA GPU and the CUDA build")
@pytest.mark.parametrize("corner", ["holes", "short", "straddle", "early", "bad_pages"])
@pytest.mark.parametrize("fmt, splits", TEAM_SPLIT_CASES, ids=TEAM_SPLIT_IDS)
def test_decode_teams_corners(fmt, splits, corner):
    """The corners on the team kernels (two and three teams): teams with no chunk, empty (token, KV head) pairs."""
    index = TEAM_SPLIT_CASES.index((fmt, splits))
    check_on_teams(make_case(17 + 1000 * index, fmt, 16, 4, 5, corner=corner), num_splits=splits)


@pytest.mark.skipif(not _gpu() or not jax_msa.cuda_available(), reason="needs a CUDA GPU and the CUDA build")
@pytest.mark.parametrize("topk,fmt,splits", [(4, KVFormat.BF16, None), (8, KVFormat.BF16, None),
                                              (32, KVFormat.BF16, None), (32, KVFormat.FP8, 2),
                                              (32, KVFormat.NVFP4, 2), (32, KVFormat.NVFP4, 3)])
def test_decode_topk_sizes(topk, fmt, splits):
    """Top-k 4 / 8 / 32 (random ids: holes, duplicates, out of range), and 32 on the two- and three-team kernels (the
    three-team CTA's chunk table holds 22 chunks a team: 11 blocks of 32)."""
    case = make_case(31 + topk, fmt, 16, 2, 3)
    rng = np.random.default_rng(topk)
    seq = np.asarray(case["seq_lens"])
    t = case["q"].shape[0]
    ids = rng.integers(-1, -(-int(seq.max()) // 128), (HKV, t, topk)).astype(np.int32)
    case["topk"] = jnp.asarray(ids)
    if splits is None:
        check_case(case)
    else:
        check_on_teams(case, num_splits=splits)


@pytest.mark.skipif(not _gpu() or not jax_msa.cuda_available(), reason="needs a CUDA GPU and the CUDA build")
@pytest.mark.parametrize("fmt", list(KVFormat), ids=lambda f: f.name)
def test_decode_fp8_query(fmt):
    """An e4m3 query with its scale, on each KV format's kernel (each has its own straight-line FP8-query path)."""
    case = make_case(77 + int(fmt), fmt, 16, 1, 9)
    q_scale = 0.05
    case["q"] = (case["q"].astype(jnp.float32) / q_scale).astype(jnp.float8_e4m3fn)
    case["q_scale"] = q_scale
    check_case(case)


@pytest.mark.skipif(not _gpu() or not jax_msa.cuda_available(), reason="needs a CUDA GPU and the CUDA build")
@pytest.mark.parametrize("q_fp8", [False, True], ids=["bf16_query", "fp8_query"])
@pytest.mark.parametrize("fmt", TEAM_FORMATS, ids=lambda f: f.name)
def test_decode_vmapped_over_layers_with_per_layer_scales(fmt, q_fp8):
    """jit(vmap(sparse_decode)) over 3 layers that share the cache, each with its own k_scale / v_scale (and q_scale
    for an e4m3 query): one custom call, the layers folded into its batch and the scales into [3] vectors that each
    request indexes (jax_msa/_batching.py, bindings.h group_scales); every layer against its own oracle and bit for
    bit against a call of its own. Batches of 5 and 44 requests a layer x q_len 2 (the split rule picks num_splits from
    one layer's batch; the fold keeps it)."""
    scales = ((0.5, 2.0, 0.05), (1.0, 1.0, 0.03), (3.0, 0.25, 0.08))  # (k_scale, v_scale, q_scale) per layer
    for batch in (5, 44):
        layers = []
        for i, (ks, vs, qs) in enumerate(scales):
            case = make_case(7700 + 10 * batch + i, fmt, 16, 2, batch)
            case.update(k_scale=np.float32(ks), v_scale=np.float32(vs))
            if q_fp8:
                case.update(q=(case["q"].astype(jnp.float32) / qs).astype(jnp.float8_e4m3fn), q_scale=np.float32(qs))
            layers.append(case)
        cache = layers[0].pop("kv_cache")
        for case in layers[1:]:
            assert case.pop("kv_cache") is cache
        stacked = {k: jnp.stack([jnp.asarray(c[k]) for c in layers]) for k in layers[0] if k != "decode_query_len"}

        def decode(kv_cache, arrays):
            return jax_msa.sparse_decode(kv_cache=kv_cache, **arrays, decode_query_len=2, return_lse=True,
                                         impl="kernel")

        fn = jax.jit(jax.vmap(decode, in_axes=(None, 0)))
        lowered = fn.lower(cache, stacked)
        # one call and no loop (the per-layer fallback is a while loop around one call)
        assert lowered.compile().as_text().count('custom_call_target="jax_msa_decode"') == 1
        assert "stablehlo.while" not in lowered.as_text(), "the layers must fold into one call, not a loop"
        out, lse = fn(cache, stacked)
        one_layer = jax.jit(decode)
        for i, case in enumerate(layers):
            check_outputs(dict(case, kv_cache=cache), out[i], lse[i])
            # the fold keeps the unbatched call's split factor: each layer's bits as in a call of its own
            want = one_layer(cache, {k: v[i] for k, v in stacked.items()})
            assert_bitwise_equal((out[i], lse[i]), want)


@pytest.mark.skipif(not _gpu() or not jax_msa.cuda_available(), reason="needs a CUDA GPU and the CUDA build")
@pytest.mark.parametrize("fmt", list(KVFormat), ids=lambda f: f.name)
def test_decode_query_magnitudes(fmt):
    """Query heads scaled by 2^-30 .. 2^20: the FP8 path computes in f16 with a power-of-two scale per query row,
    so a row far outside f16's range (or one below its normals) must neither overflow nor flush."""
    case = make_case(41 + int(fmt), fmt, 16, 2, 6)
    exponents = np.array([-30, -12, -4, 0, 3, 6, 12, 20] * 4, np.float32)[: case["q"].shape[1]]
    q = case["q"].astype(jnp.float32) * jnp.asarray(2.0**exponents)[None, :, None]
    case["q"] = q.astype(jnp.bfloat16)
    check_case(case)


@pytest.mark.skipif(not _gpu() or not jax_msa.cuda_available(), reason="needs a CUDA GPU and the CUDA build")
@pytest.mark.parametrize("regime", ["subnormal", "large", "mixed"])
def test_decode_nvfp4_block_scale_range(regime):
    """NVFP4 block scales at both ends of e4m3: zero and the subnormal codes (2^-9 .. 7 x 2^-9), and 128 .. 448. The
    register path computes e2m1 x scale x 2^-7 in f16 (cc/sm80/decode/chunk_io.cuh), exact only if neither end
    underflows nor overflows f16; a regime of its own each, so that the small end is not swamped by the large."""
    index = ["subnormal", "large", "mixed"].index(regime)
    case = make_case(61 + index, KVFormat.NVFP4, 16, 2, 5)
    rng = np.random.default_rng(index)
    cache = np.asarray(case["kv_cache"]).copy()
    flat = cache.reshape(cache.shape[0], cache.shape[1], -1)
    low, high = np.arange(0, 8, dtype=np.uint8), np.arange(0x70, 0x7F, dtype=np.uint8)  # e4m3 0x7e = 448
    codes = {"subnormal": low, "large": high, "mixed": np.concatenate([low, high])}[regime]
    n_sf = 128 * D // 16
    flat[:, :, -n_sf:] = rng.choice(codes, size=flat[:, :, -n_sf:].shape)
    case["kv_cache"] = jnp.asarray(cache)
    check_case(case)


@pytest.mark.skipif(not _gpu() or not jax_msa.cuda_available(), reason="needs a CUDA GPU and the CUDA build")
@pytest.mark.parametrize("fmt", list(KVFormat), ids=lambda f: f.name)
def test_decode_nan_past_sequence(fmt):
    """The last page of each request holds non-finite codes past seq_len: bf16 NaN, e4m3 0x7f, and for NVFP4 block
    scales 0x7f (NaN) of K and V. Those keys are never attended: the kernel must not read their K / V bytes into a
    product that meets P = 0 (0 x NaN), and NVFP4's scale bytes, loaded for the whole chunk, must not reach a value."""
    case = make_case(83 + int(fmt), fmt, 16, 2, 7)
    cache = np.asarray(case["kv_cache"]).copy()
    table, seq = np.asarray(case["block_table"]), np.asarray(case["seq_lens"])
    for b, n in enumerate(seq):
        if n % 128 == 0:
            continue
        page, first = table[b, (n - 1) // 128], n % 128
        if fmt == KVFormat.BF16:
            cache[page, :, first:, :] = np.nan
        elif fmt == KVFormat.FP8:
            cache.view(np.uint8)[page, :, first:, :] = 0x7F
        else:  # slot bytes: data [128 x D/2], then scales, K linear (t * D/16 + c), V in 4-token quads
            slot = cache.reshape(cache.shape[0], cache.shape[1], -1)[page]
            groups, data = D // 16, 128 * D // 2
            for t in range(first, 128):
                for c in range(groups):
                    slot[0::2, data + t * groups + c] = 0x7F
                    slot[1::2, data + (t // 4) * 4 * groups + 4 * c + t % 4] = 0x7F
    case["kv_cache"] = jnp.asarray(cache)
    check_case(case)


@pytest.mark.skipif(not _gpu() or not jax_msa.cuda_available(), reason="needs a CUDA GPU and the CUDA build")
def test_decode_deterministic():
    case = make_case(5, KVFormat.NVFP4, 16, 1, 2)
    a = run_kernel(case)
    b = run_kernel(case)
    np.testing.assert_array_equal(np.asarray(a[0], np.float32), np.asarray(b[0], np.float32))
    np.testing.assert_array_equal(np.asarray(a[1]), np.asarray(b[1]))


def _compute_capability():
    return tuple(int(x) for x in str(_gpu()[0].compute_capability).split("."))


@pytest.mark.skipif(not _gpu() or not jax_msa.cuda_available(), reason="needs a CUDA GPU and the CUDA build")
@pytest.mark.parametrize("group,batch,q_len,splits", [(16, 1, 1, 16), (16, 11, 1, 12), (16, 7, 4, 4), (16, 64, 1, 2),
                                                      (8, 3, 1, 16), (8, 5, 2, 7), (4, 2, 3, 5), (2, 4, 1, 3),
                                                      (1, 6, 1, 16)])
@pytest.mark.parametrize("fmt", list(KVFormat), ids=lambda f: f.name)
def test_decode_cluster_merge_matches_combine_kernel(fmt, group, batch, q_len, splits, monkeypatch):
    """On sm_90+ the split-K CTAs of a (token, KV head) run as one cluster and merge through distributed shared
    memory; JAX_MSA_DECODE_CLUSTER_MERGE=0 (read per call) sends the partials through global memory to the combine
    kernel. Both use split_merge.cuh's arithmetic: outputs bit-identical. The module's launch counters show which
    path each call took (each run_kernel is a fresh jit, so nothing is replayed from an earlier capture). The split
    count is forced (the rule in ops.decode_num_splits differs per format). The cases cover a CTA's slice of the rows'
    units starting mid-row (12, 7, 5, 3 splits; group 8 at 16), slices of 2 to 256 units and groups of 16, 8, 4, 2
    and 1 heads."""
    from jax_msa import ops

    if (fmt, splits) in TEAM_SPLIT_CASES:
        pytest.skip(f"{fmt.name}'s {splits} splits run as the teams of one CTA: test_decode_splits_run_as_teams")
    monkeypatch.setattr(ops, "decode_num_splits", lambda cfg, decode_query_len: splits)
    case = make_case(500 + 10 * int(fmt) + batch, fmt, group, q_len, batch)
    paths = {}
    for setting, path in (("1", "cluster"), ("0", "combine_kernel")):
        monkeypatch.setenv("JAX_MSA_DECODE_CLUSTER_MERGE", setting)
        paths[path] = counting_merges(lambda: check_case(case) if path == "cluster" else run_kernel(case))
    cluster = _compute_capability() >= (9, 0)
    assert paths["combine_kernel"][1]["cluster"] == 0 and paths["combine_kernel"][1]["combine_kernel"] >= 1
    if cluster:
        assert paths["cluster"][1]["cluster"] >= 1 and paths["cluster"][1]["combine_kernel"] == 0, paths["cluster"][1]
    (out_c, lse_c), (out_k, lse_k) = paths["cluster"][0], paths["combine_kernel"][0]
    np.testing.assert_array_equal(np.asarray(out_c, np.float32), np.asarray(out_k, np.float32))
    np.testing.assert_array_equal(np.asarray(lse_c), np.asarray(lse_k))


@pytest.mark.skipif(not _gpu() or not jax_msa.cuda_available(), reason="needs a CUDA GPU and the CUDA build")
@pytest.mark.parametrize("group,batch,q_len", [(16, 1, 1), (16, 64, 1), (16, 5, 3), (8, 7, 2), (4, 3, 1), (1, 9, 1)])
@pytest.mark.parametrize("fmt, splits", TEAM_SPLIT_CASES, ids=TEAM_SPLIT_IDS)
def test_decode_splits_run_as_teams(fmt, splits, group, batch, q_len, monkeypatch):
    """FP8 and NVFP4 with num_splits == 2, and NVFP4 with 3, run the splits as the 4-warp teams of one CTA a
    (token, KV head) (config.h, CtaLayout; three teams: 12 warps, the merge by the first 256 threads), merged through
    its shared memory: no cluster, no combine kernel (the module's launch counters say which path ran), outputs
    within the oracle bound (NaN-poisoned), the same bits on a second run, and JAX_MSA_DECODE_CLUSTER_MERGE=0 sending
    the splits to the combine kernel instead (within the bound too)."""
    from jax_msa import ops

    monkeypatch.setattr(ops, "decode_num_splits", lambda cfg, decode_query_len: splits)
    index = TEAM_SPLIT_CASES.index((fmt, splits))
    case = make_case(900 + 1000 * index + 10 * group + batch, fmt, group, q_len, batch)
    monkeypatch.setenv("JAX_MSA_DECODE_CLUSTER_MERGE", "1")
    out, lse = check_on_teams(case, num_splits=None)  # the rule's, set above
    again_out, again_lse = run_kernel(case)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(again_out, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(again_lse))
    monkeypatch.setenv("JAX_MSA_DECODE_CLUSTER_MERGE", "0")
    _, used = counting_merges(lambda: check_case(case))
    assert used["combine_kernel"] >= 1 and used["teams"] == used["teams_two_per_sm"] == 0, used


@pytest.mark.skipif(not _gpu() or not jax_msa.cuda_available(), reason="needs a CUDA GPU and the CUDA build")
@pytest.mark.parametrize("fmt, batch, q_len, was, want, path", [
    (KVFormat.FP8, 18, 2, 3, 2, "teams"),       # 72 pairs: the two-team CTA instead of 3-CTA clusters
    (KVFormat.NVFP4, 36, 1, 3, 4, "cluster"),   # 72 pairs: 4-CTA clusters instead of 3
    (KVFormat.NVFP4, 20, 1, 6, 8, "cluster"),   # 40 pairs: 8-CTA clusters instead of 6
    (KVFormat.NVFP4, 31, 2, 2, 3, "teams"),     # 124 pairs: the three-team CTA instead of the two-team one
    (KVFormat.FP8, 36, 2, 1, 2, "teams_two_per_sm"),  # 144 pairs: 2 splits as team CTAs two an SM rather than 1
], ids=["FP8-3to2", "NVFP4-3to4", "NVFP4-6to8", "NVFP4-2to3", "FP8-1to2"])
def test_decode_rule_avoids_slow_cluster_sizes(fmt, batch, q_len, was, want, path):
    """The split rule's replacements (ops.DECODE_SPLITS_INSTEAD) on the GPU: the batch gives the plain rule `was`
    splits, the rule returns `want`, the launch counters show the path that factor takes, and the outputs meet the
    oracle bound (NaN-poisoned)."""
    import types
    from jax_msa import ops

    if ops.cuda_sm_count() != 132:
        pytest.skip("the cases are sized for 132 SMs (H100 SXM / H200)")
    if path == "teams_two_per_sm" and ops.cuda_compute_capability() not in ops.DECODE_TWO_TEAM_CTAS_FIT:
        pytest.skip(f"compute capability {ops.cuda_compute_capability()}: an SM holds one team CTA")
    pairs = batch * q_len * HKV
    assert (132 * ops.DECODE_CTAS_PER_SM[fmt]) // pairs == was
    cfg = types.SimpleNamespace(kv_format=fmt, batch=batch, num_kv_heads=HKV, topk=K)
    assert ops.decode_num_splits(cfg, q_len) == want
    _, used = counting_merges(lambda: check_case(make_case(1700 + 10 * int(fmt) + batch, fmt, 16, q_len, batch)))
    assert used[path] >= 1 and sum(used.values()) == used[path], used


def _requests(case, first, end):
    """Requests [first, end) of a decode case as a batch of their own (same cache)."""
    ql = case["decode_query_len"]
    rows = slice(first * ql, end * ql)
    return {**case, "q": case["q"][rows], "topk": case["topk"][:, rows], "seq_lens": case["seq_lens"][first:end],
            "block_table": case["block_table"][first:end]}


def _batch_past_the_sms(q_len):
    """A batch whose (token, KV head) pairs outnumber the GPU's SMs (FP8's team CTAs then run two an SM, where its SMs
    hold two), within make_case's 64 requests."""
    from jax_msa import ops

    if ops.cuda_compute_capability() not in ops.DECODE_TWO_TEAM_CTAS_FIT:
        pytest.skip(f"compute capability {ops.cuda_compute_capability()}: an SM holds one team CTA")
    batch = ops.cuda_sm_count() // (HKV * q_len) + 2
    if batch > 64:
        pytest.skip(f"{ops.cuda_sm_count()} SMs need more than make_case's 64 requests at q_len {q_len}")
    return batch


@pytest.mark.skipif(not _gpu() or not jax_msa.cuda_available(), reason="needs a CUDA GPU and the CUDA build")
@pytest.mark.parametrize("group,q_len", [(16, 2), (8, 4)])
def test_decode_fp8_teams_two_per_sm_match_one_per_sm(group, q_len):
    """FP8 with num_splits == 2 and more (token, KV head) pairs than SMs runs its team CTAs two an SM
    (config.h, CtaLayout::kTeamsTwoPerSm: 128 registers, Q fragments in shared memory, 2 stages a team): the launch
    counters say so, the outputs meet the oracle bound (NaN-poisoned), and each request's bits equal those of the
    same requests decoded in a batch small enough for the one-an-SM team CTA (a fixed num_splits stays
    batch-invariant across the two layouts)."""
    batch = _batch_past_the_sms(q_len)
    case = make_case(2100 + group + q_len, KVFormat.FP8, group, q_len, batch)
    (whole_out, whole_lse), used = counting_merges(lambda: check_case(case, num_splits=2))
    assert used["teams_two_per_sm"] >= 1 and used["teams"] == used["cluster"] == used["combine_kernel"] == 0, used
    for first, end in ((0, 1), (batch // 2, batch // 2 + 5), (batch - 1, batch)):
        (out, lse), used = counting_merges(lambda: run_kernel(_requests(case, first, end), num_splits=2))
        assert used["teams"] >= 1 and used["teams_two_per_sm"] == 0, used
        rows = slice(first * q_len, end * q_len)
        assert_bitwise_equal(out, whole_out[rows])
        assert_bitwise_equal(lse, whole_lse[rows])


@pytest.mark.skipif(not _gpu() or not jax_msa.cuda_available(), reason="needs a CUDA GPU and the CUDA build")
@pytest.mark.parametrize("splits", [1, 2, 3, 16])
@pytest.mark.parametrize("fmt", list(KVFormat), ids=lambda f: f.name)
def test_decode_fixed_num_splits_is_batch_invariant(fmt, splits):
    """sparse_decode(num_splits=n): a request's outputs are bit for bit the same in a batch of 33, alone, and in a
    batch of 7 (sizes for which the split rule picks other factors: bf16 1 / 16 / 4, FP8 2 / 16 / 9, NVFP4
    3 / 16 / 9); the batch of 33 meets the oracle bound."""
    import types
    from jax_msa import ops

    rule = {b: ops.decode_num_splits(types.SimpleNamespace(kv_format=fmt, batch=b, num_kv_heads=HKV, topk=K), 2)
            for b in (33, 1, 7)}
    assert len(set(rule.values())) > 1, rule  # else the batches would agree without num_splits
    case = make_case(700 + 10 * int(fmt) + splits, fmt, 16, 2, 33)
    whole_out, whole_lse = check_case(case, num_splits=splits)
    for first, end in ((0, 1), (20, 27), (32, 33)):
        out, lse = run_kernel(_requests(case, first, end), num_splits=splits)
        rows = slice(first * 2, end * 2)
        assert_bitwise_equal(out, whole_out[rows])
        assert_bitwise_equal(lse, whole_lse[rows])


@pytest.mark.sanitize
@pytest.mark.skipif(not _gpu() or not jax_msa.cuda_available(), reason="needs a CUDA GPU and the CUDA build")
@pytest.mark.parametrize("fmt", list(KVFormat), ids=lambda f: f.name)
def test_decode_small_for_sanitizer(fmt):
    check_case(make_case(3, fmt, 16, 2, 2))


@pytest.mark.sanitize
@pytest.mark.skipif(not _gpu() or not jax_msa.cuda_available(), reason="needs a CUDA GPU and the CUDA build")
@pytest.mark.parametrize("fmt, splits", TEAM_SPLIT_CASES, ids=TEAM_SPLIT_IDS)
def test_decode_teams_small_for_sanitizer(fmt, splits):
    """The team kernels (two and three teams) under memcheck: G = 8 (rows past the group computed, never stored; a
    three-team CTA's threads 256-383 take no part in the merge)."""
    index = TEAM_SPLIT_CASES.index((fmt, splits))
    check_on_teams(make_case(4 + 1000 * index, fmt, 8, 2, 2), num_splits=splits)


@pytest.mark.sanitize
@pytest.mark.skipif(not _gpu() or not jax_msa.cuda_available(), reason="needs a CUDA GPU and the CUDA build")
def test_decode_fp8_teams_two_per_sm_for_sanitizer():
    """FP8's team CTAs two an SM (more pairs than SMs) under memcheck: G = 8, q_len 4."""
    _, used = counting_merges(lambda: check_case(make_case(5, KVFormat.FP8, 8, 4, _batch_past_the_sms(4)),
                                                 num_splits=2))
    assert used["teams_two_per_sm"] >= 1, used


def test_split_rule_sees_the_gpus_sm_count():
    """ops.cuda_sm_count() reads the SM count from JAX's device (core_count); without the attribute it would quietly
    fall back to the H200's 132, so check the attribute is there and agrees (H100 SXM / H200: 132 SMs)."""
    from jax_msa import ops

    device = jax.devices("cuda")[0]
    assert isinstance(getattr(device, "core_count", None), int), dir(device)
    assert ops.cuda_sm_count() == device.core_count
    if any(name in device.device_kind for name in ("H200", "H100 80GB HBM3")):
        assert device.core_count == 132, device.device_kind
