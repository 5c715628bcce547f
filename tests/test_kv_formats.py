"""FP8 and NVFP4 KV-cache formats end to end on CPU (MSA.md sections 3-4).

Everything is checked against an independent numpy oracle built on ml_dtypes: the quantizers (bit-exact),
the NVFP4 slot packer, the write_kv custom call and its jnp twin (bit-exact, untouched bytes unchanged),
dequantize_cache (exact), round-trip error bounds, attention over FP8 / NVFP4 caches (float64 numpy on
the decoded values), validation of malformed caches, and allocate_cache.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_msa
from jax_msa import kv_cache as kvc

BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn
E2M1 = ml_dtypes.float4_e2m1fn
PAGE = 128
F32 = np.float32
E2M1_TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # midpoints of the E2M1 grid
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
QUANTIZED_FORMATS = pytest.mark.parametrize("fmt", [kvc.KVFormat.FP8, kvc.KVFormat.NVFP4], ids=["fp8", "nvfp4"])


# ---------------------------------------------------------------------------------------------------------
# The numpy oracle (float32 numpy arithmetic is IEEE: divisions correctly rounded, subnormals kept)
# ---------------------------------------------------------------------------------------------------------

def np_bf16(x):
    with np.errstate(invalid="ignore"):  # the edge-case inputs hold NaNs on purpose: no warning for their cast
        return np.asarray(x, F32).astype(BF16).astype(F32)


def np_e4m3_bits(x):
    """fp32 -> E4M3 byte, round to nearest even, saturating at +-448; a NaN of either sign gives 0x7F (docs/FORMATS.md).
    ml_dtypes rounds correctly but turns |x| >= 464 into NaN, hence the clip."""
    x = np.asarray(x, F32)
    bits = np.clip(x, F32(-448), F32(448)).astype(E4M3).view(np.uint8)
    return np.where(np.isnan(x), np.uint8(0x7F), bits)


def np_e4m3_value(bits):
    return np.asarray(bits, np.uint8).view(E4M3).astype(F32)


def np_e2m1_code(y):
    """fp32 -> E2M1 nibble, round to nearest even, saturating at +-6 (ml_dtypes saturates too; the clip
    makes it explicit); a value that rounds to zero is +0 (ml_dtypes would keep -0)."""
    code = np.clip(np.asarray(y, F32), F32(-6), F32(6)).astype(E2M1).view(np.uint8) & 0xF
    return np.where((code & 7) == 0, 0, code).astype(np.uint8)


def np_e2m1_value(code):
    return (np.asarray(code, np.uint8) & 0xF).view(E2M1).astype(F32)


def np_quantize_fp8(x, scale):
    return np_e4m3_bits(np_bf16(x) / F32(scale))


def np_quantize_nvfp4(x, global_scale):
    """[..., D] -> (data uint8 [..., D/2], scale bytes uint8 [..., D/16]) per MSA.md section 4."""
    xb = np_bf16(x)
    d = xb.shape[-1]
    groups = xb.reshape(*xb.shape[:-1], d // 16, 16)
    gs = F32(global_scale)
    # a group holding a NaN (outside MSA.md's contract) reads back as 16 NaNs: scale byte 0x7F, data bytes 0
    has_nan = np.isnan(groups).any(axis=-1)
    groups = np.where(has_nan[..., None], F32(0), groups)
    amax = np.abs(groups).max(axis=-1)
    sf = np_e4m3_bits(np.maximum((np.maximum(amax, F32(1e-12)) / F32(6)) / gs, F32(2.0**-9)))
    sf = np.where(has_nan, np.uint8(0x7F), sf)
    codes = np_e2m1_code((groups / gs) / np_e4m3_value(sf)[..., None])
    codes = np.where(has_nan[..., None], np.uint8(0), codes).reshape(xb.shape)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8), sf


def np_dequantize_nvfp4(data, sf, global_scale):
    codes = np.stack([data & 0xF, data >> 4], axis=-1).reshape(*data.shape[:-1], 2 * data.shape[-1])
    d = codes.shape[-1]
    vals = np_e2m1_value(codes).reshape(*data.shape[:-1], d // 16, 16) * np_e4m3_value(sf)[..., None]
    return vals.reshape(*data.shape[:-1], d) * F32(global_scale)


def np_scale_offset(t, c, groups, is_v):
    """Offset of the E4M3 scale of (token t, group c) inside a slot's scale region."""
    if is_v:
        return (t // 4) * (4 * groups) + 4 * c + t % 4
    return t * groups + c


def np_write_kv(cache_bytes, fmt, k, v, slots, k_scale, v_scale):
    """The byte-level packer: cache_bytes is the cache viewed as uint8; returns an updated copy."""
    out = cache_bytes.copy()
    n, hkv, d = k.shape
    pages = out.shape[0]
    for i, slot in enumerate(np.asarray(slots)):
        if slot < 0 or slot >= pages * PAGE:
            continue
        page, t = divmod(int(slot), PAGE)
        if fmt == kvc.KVFormat.FP8:
            out[page, :, t, :d] = np_quantize_fp8(k[i], k_scale)
            out[page, :, t, d:] = np_quantize_fp8(v[i], v_scale)
            continue
        slot_bytes = out.reshape(pages, 2 * hkv, -1)  # a view: writes land in `out`
        data_bytes = PAGE * d // 2
        for g in range(hkv):
            for is_v, x, gs in ((False, k, k_scale), (True, v, v_scale)):
                data, sf = np_quantize_nvfp4(x[i, g], gs)
                region = slot_bytes[page, 2 * g + int(is_v)]
                region[t * (d // 2):(t + 1) * (d // 2)] = data
                for c in range(d // 16):
                    region[data_bytes + np_scale_offset(t, c, d // 16, is_v)] = sf[c]
    return out


def np_dequantize_cache(cache_bytes, fmt, d, k_scale, v_scale):
    """uint8 cache bytes -> (K, V) float32 [P, Hkv, 128, D]."""
    if fmt == kvc.KVFormat.FP8:
        vals = cache_bytes.view(E4M3).astype(F32)
        return vals[..., :d] * F32(k_scale), vals[..., d:] * F32(v_scale)
    pages, slots = cache_bytes.shape[:2]
    flat = cache_bytes.reshape(pages, slots, -1)
    nd = PAGE * d // 2
    data = flat[:, :, :nd].reshape(pages, slots, PAGE, d // 2)
    t = np.arange(PAGE)[:, None]
    c = np.arange(d // 16)[None, :]
    k_sf = flat[:, 0::2][:, :, nd + np_scale_offset(t, c, d // 16, False)]
    v_sf = flat[:, 1::2][:, :, nd + np_scale_offset(t, c, d // 16, True)]
    return (np_dequantize_nvfp4(data[:, 0::2], k_sf, k_scale),
            np_dequantize_nvfp4(data[:, 1::2], v_sf, v_scale))


def as_bytes(cache):
    return np.asarray(cache).view(np.uint8)


def from_bytes(cache_bytes, fmt):
    return jnp.asarray(cache_bytes.view(E4M3) if fmt == kvc.KVFormat.FP8 else cache_bytes)


def random_cache_bytes(rng, fmt, pages, hkv, d):
    """A cache filled with random bytes (NaN E4M3 codes included): the poison write_kv must leave alone."""
    shape = ((pages, hkv, PAGE, 2 * d) if fmt == kvc.KVFormat.FP8
             else (pages, 2 * hkv, PAGE, kvc.nvfp4_token_bytes(d)))
    return rng.integers(0, 256, shape, dtype=np.uint8)


# ---------------------------------------------------------------------------------------------------------
# The oracle's own building blocks against brute force in float64 (ml_dtypes behaviour is pinned here)
# ---------------------------------------------------------------------------------------------------------

def _nearest_even(x, grid, codes):
    """Round-to-nearest-even on a sorted non-negative grid, saturating at its top; ties pick even codes."""
    a = np.abs(x.astype(np.float64))
    dist = np.abs(a[:, None] - grid[None, :])
    best = dist.min(axis=1, keepdims=True)
    cand = dist == best
    even = cand & (codes[None, :] % 2 == 0)
    pick = np.where(even.any(axis=1), even.argmax(axis=1), cand.argmax(axis=1))
    return pick


def test_oracle_codecs_match_float64_brute_force():
    rng = np.random.default_rng(100)
    # E2M1: every midpoint, its neighbours, random values and saturation.
    mids = np.array(E2M1_TIES, F32)
    y = np.concatenate([mids, np.nextafter(mids, F32(0)), np.nextafter(mids, F32(9)),
                        rng.uniform(0, 8, 4000).astype(F32), F32([6.0, 6.5, 100.0, 0.0])])
    y = np.concatenate([y, -y])
    grid = np.array(E2M1_GRID)
    pick = _nearest_even(y, grid, np.arange(8))
    want = np.where((pick == 0) | ~np.signbit(y), pick, pick + 8)
    np.testing.assert_array_equal(np_e2m1_code(y), want)
    assert not np_e2m1_code(F32([-0.0, -0.2, -0.25, -1e-30])).any()  # +0, never the -0 code 8
    np.testing.assert_array_equal(np_e2m1_value(np.arange(16)), np.concatenate([grid, -grid]).astype(F32))

    # E4M3: all 126 positive finite values, midpoints between neighbours (ties), neighbours of those.
    pos = np.arange(0, 127, dtype=np.uint8)
    vals = pos.view(E4M3).astype(np.float64)
    mids = ((vals[:-1] + vals[1:]) / 2).astype(F32)
    x = np.concatenate([mids, np.nextafter(mids, F32(0)), np.nextafter(mids, F32(1e9)),
                        rng.uniform(0, 460, 4000).astype(F32), 2.0 ** rng.uniform(-12, -5, 2000).astype(F32),
                        F32([448, 449, 463.9, 464, 465, 1e6, 2.0**-10, 2.0**-11])])
    pick = _nearest_even(x, vals, pos.astype(np.int64))
    np.testing.assert_array_equal(np_e4m3_bits(x), pick.astype(np.uint8))
    np.testing.assert_array_equal(np_e4m3_bits(-x), pick.astype(np.uint8) | 0x80)
    np.testing.assert_array_equal(np_e4m3_bits(F32([np.inf, -np.inf])), [0x7E, 0xFE])  # satfinite


def test_div_rn_is_correctly_rounded():
    """kv_cache.div_rn vs IEEE numpy division on random bit patterns, subnormal operands and results
    included (XLA's own CPU division is off by an ulp now and then and flushes subnormals)."""
    rng = np.random.default_rng(101)
    n = 200_000
    a = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(F32)
    b = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(F32)
    sub = (rng.integers(1, 2**23, n) | (rng.integers(0, 2, n) << 31)).astype(np.uint32).view(F32)
    near = rng.uniform(0.25, 8, n).astype(F32)
    a = np.concatenate([a, sub, near, near * F32(2.0**-120), F32([0.0, -0.0, 1.0, 3.0])])
    b = np.concatenate([b, near, sub, near * F32(2.0**10), F32([3.0, 7.0, F32(2.0**-149), -0.0])])
    finite = np.isfinite(a) & np.isfinite(b) & (b != 0)
    a, b = a[finite], b[finite]
    with np.errstate(over="ignore", under="ignore"):
        want = a / b
    got = np.asarray(jax.jit(kvc.div_rn)(a, b))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    # the non-finite cases, IEEE (NaN only as NaN), also with b a compile-time constant, which XLA may turn into
    # a multiplication by 1 / b (inf * (1 / 2^127) = NaN on its CPU backend)
    special = F32([np.inf, -np.inf, np.nan, 0.0, -0.0, 1.5, -2.0**-149, 3e38])
    a2, b2 = (x.reshape(-1) for x in np.meshgrid(special, special))
    with np.errstate(all="ignore"):
        want = a2 / b2
    got = np.asarray(jax.jit(kvc.div_rn)(a2, b2))
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    assert same.all(), list(zip(a2[~same], b2[~same], got[~same]))
    for s in (F32(2.0**127), F32(-0.0), F32(2.0**-149)):
        got = np.asarray(jax.jit(lambda x, s=s: kvc.div_rn(x, s))(special))
        with np.errstate(all="ignore"):
            want = special / s
        same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
        assert same.all(), (s, list(zip(special[~same], got[~same])))


def test_rounding_primitives_are_exact():
    """kv_cache.e4m3_satfinite and round_to_bf16 (integer code + bitcast, reduce_precision) vs the oracle / ml_dtypes
    on random bit patterns, every E4M3 midpoint and its neighbours, subnormal and non-finite inputs."""
    rng = np.random.default_rng(102)
    x = rng.integers(0, 2**32, 400_000, dtype=np.uint64).astype(np.uint32).view(F32)
    vals = np.arange(0, 127, dtype=np.uint8).view(E4M3).astype(np.float64)
    mids = ((vals[:-1] + vals[1:]) / 2).astype(F32)
    # bf16 ties (the low 16 bits 0x8000) with an even and an odd bf16 below them
    ties = ((rng.integers(0, 2**15, 2000).astype(np.uint32) << 17) | (np.arange(2000, dtype=np.uint32) % 2 << 16)
            | np.uint32(0x8000)).view(F32)
    x = np.concatenate([x, mids, np.nextafter(mids, F32(0)), np.nextafter(mids, F32(1e9)), -mids, ties,
                        F32([448, 449, 464, 465, np.inf, -np.inf, 0.0, -0.0, 2.0**-10, 1e-45, -1e-45])])
    got = np.asarray(jax.jit(kvc.e4m3_satfinite)(x)).view(np.uint8)
    finite = ~np.isnan(x)
    np.testing.assert_array_equal(got[finite], np_e4m3_bits(x[finite]))
    assert (got[~finite] == 0x7F).all()  # NaN of either sign -> the one code 0x7F, as cc/common/numeric.h
    assert (np.signbit(x[~finite])).any() and (~np.signbit(x[~finite])).any()
    got = np.asarray(jax.jit(kvc.round_to_bf16)(x))
    with np.errstate(invalid="ignore"):
        want = x.astype(BF16).astype(F32)
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    assert same.all(), x[~same][:5]


@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_quantizers_lowered_for_the_gpu_keep_their_roundings(kv_dtype):
    """What the jnp writer emits for the GPU: no float convert to E4M3 (XLA's GPU backend, excess precision allowed by
    default, drops an fp32 -> E4M3 -> fp32 pair, which made the NVFP4 codes use the unrounded block scale), and fp32
    K/V rounded to bf16 by reduce_precision, never by a bf16 convert pair (dropped alike)."""
    n, hkv, d = 8, 2, 128
    k = jnp.zeros((n, hkv, d), kv_dtype)
    slots = jnp.arange(n, dtype=jnp.int32)
    for fmt in (kvc.KVFormat.FP8, kvc.KVFormat.NVFP4):
        cache = kvc.allocate_cache(fmt, 1, hkv, d)
        fn = lambda c, k, v, s: kvc.write_kv_reference(c, k, v, s, k_scale=0.37, v_scale=0.5)
        text = jax.jit(fn).trace(cache, k, k, slots).lower(lowering_platforms=("cuda",)).as_text()
        converts = re.findall(r"stablehlo\.convert .*-> tensor<(?:[^>]*x)?(f8E4M3FN|bf16)>", text)  # scalars too
        assert not converts, f"{fmt.name}: float converts to {sorted(set(converts))} in the GPU lowering"
        assert ("stablehlo.reduce_precision" in text) == (kv_dtype == jnp.float32), fmt.name


# ---------------------------------------------------------------------------------------------------------
# jnp quantizers under jit vs the oracle (bit-exact)
# ---------------------------------------------------------------------------------------------------------

@jax.jit
def _quantize_fp8_jit(x, scale):
    return jax.lax.bitcast_convert_type(kvc.quantize_fp8(x, scale), jnp.uint8)


@jax.jit
def _quantize_nvfp4_jit(x, global_scale):
    data, sf = kvc.quantize_nvfp4(x, global_scale)
    return data, jax.lax.bitcast_convert_type(sf, jnp.uint8)


# every positive normal bf16 below 2^100 (quotients by the scales below stay finite)
BF16_POSITIVE = np.arange(0x0080, 0x7180, dtype=np.uint16).view(BF16).astype(F32)


def rounding_sensitive(q, code):
    """True where a one-ulp error in the fp32 quotient q would change code(q): q sits on or next to a
    rounding boundary, so only a correctly rounded division encodes these inputs right."""
    with np.errstate(over="ignore"):
        c = code(q)
        return (c != code(np.nextafter(q, F32(np.inf)))) | (c != code(np.nextafter(q, F32(0))))


def fp8_division_sensitive(scale):
    """Every positive bf16 x whose E4M3 code depends on the last bit of x / scale."""
    return BF16_POSITIVE[rounding_sensitive(BF16_POSITIVE / F32(scale), np_e4m3_bits)]


def nvfp4_division_sensitive_groups(rng, global_scale, count):
    """[count, 16] groups whose amax makes the scale byte depend on the last bit of (amax / 6) / global,
    filled with elements whose E2M1 code depends on the last bit of x / global or of (x / global) / sf."""
    g = F32(global_scale)
    amaxes = BF16_POSITIVE[rounding_sensitive(np.maximum((BF16_POSITIVE / F32(6)) / g, F32(2.0**-9)),
                                              np_e4m3_bits)]
    assert amaxes.size >= 10
    groups = []
    for a in rng.choice(amaxes, count):
        sf = np_e4m3_value(np_e4m3_bits(np.maximum((a / F32(6)) / g, F32(2.0**-9))))
        cand = BF16_POSITIVE[BF16_POSITIVE < a]
        sens = (rounding_sensitive(cand / g, lambda q: np_e2m1_code(q / sf))
                | rounding_sensitive((cand / g) / sf, np_e2m1_code))
        elems = rng.permutation(cand[sens])[:15]
        fill = np_bf16(rng.uniform(-a, a, 15 - elems.size))
        grp = np.concatenate([[a], elems * rng.choice([-1, 1], elems.size), fill]).astype(F32)
        groups.append(grp * F32(rng.choice([-1, 1])))
    return np.stack(groups)


def fp8_inputs(rng, scale):
    """Random values over the whole E4M3 range (subnormal to saturating) times scale, -0 and zeros."""
    n = 8192
    mag = 2.0 ** rng.uniform(-13, 10, n)
    x = (rng.choice([-1.0, 1.0], n) * mag * scale).astype(F32)
    x[:64] = -0.0
    x[64:128] = 0.0
    x[128:192] = F32(scale) * rng.uniform(448, 5e4, 64).astype(F32) * rng.choice([-1, 1], 64)  # > 448*scale
    x[192:194] = [np.inf, -np.inf]  # saturate too
    x[194:198] = [np.nan, -np.nan, np.uint32(0x7FC0_1234).view(F32), np.uint32(0xFF80_0001).view(F32)]  # -> 0x7F
    sens = fp8_division_sensitive(scale)  # exhaustive over bf16: 2 (scale 0.3) to 126 (exact ties)
    assert sens.size >= 1
    x[200:200 + sens.size] = sens * rng.choice([-1, 1], sens.size)
    return x


def fp8_tie_inputs(scale):
    """bf16 values x with x / scale exactly halfway between two E4M3 neighbours (scale = 2^i or 3 * 2^i)."""
    vals = np.arange(0, 126, dtype=np.uint8).view(E4M3).astype(np.float64)
    mids = (vals[:-1] + vals[1:]) / 2
    x = (mids * scale).astype(F32)
    keep = (np_bf16(x) == x) & ((x / F32(scale)) == mids.astype(F32))
    x = x[keep]
    return np.concatenate([x, -x])


@pytest.mark.parametrize("scale", [1.0, 0.37, 3.0, 2.0**-7, 1.7, 0.3])
def test_quantize_fp8_matches_numpy(scale):
    rng = np.random.default_rng(1)
    x = fp8_inputs(rng, scale)
    got = np.asarray(_quantize_fp8_jit(x, F32(scale)))
    np.testing.assert_array_equal(got, np_quantize_fp8(x, scale))
    assert (got[128:194] & 0x7F == 0x7E).all()  # saturated at 448, never NaN
    assert (got[194:198] == 0x7F).all()  # NaN inputs (either sign, any payload): one code
    assert (got[:64] == 0x80).all() and (got[64:128] == 0).all()


@pytest.mark.parametrize("scale", [1.0, 3.0, 0.75])
def test_quantize_fp8_ties(scale):
    x = fp8_tie_inputs(scale)
    assert x.size >= 200  # the construction hits (almost) every midpoint
    got = np.asarray(_quantize_fp8_jit(x, F32(scale)))
    np.testing.assert_array_equal(got, np_quantize_fp8(x, scale))
    lo = np.abs(x / F32(scale))
    dec = np.abs(np_e4m3_value(got))
    # A tie went to one of its two neighbours (a real tie, not a round-off victim) and to the even code.
    assert ((got & 1) == 0).all() and (np.abs(dec - lo) > 0).all()


def nvfp4_tie_groups(rng, global_scale, rows):
    """[rows, 16] groups whose sf is known and whose elements sit exactly on E2M1 midpoints (or grid
    points) of x / global / sf; element 0 carries the amax = 6 * global * sf. Returns (x, y) with y the
    exact quotients."""
    sfs = np.concatenate([np.arange(1, 8), np.arange(8, 120, 5)]).astype(np.uint8)  # subnormal + normal e4m3
    xs, ys = [], []
    while len(xs) < rows:
        sf = np_e4m3_value(rng.choice(sfs))
        t = rng.choice(np.array(E2M1_TIES + E2M1_GRID), 15) * rng.choice([-1.0, 1.0], 15)
        y = np.concatenate([[6.0 * rng.choice([-1.0, 1.0])], t]).astype(F32)
        x = (y.astype(np.float64) * sf * global_scale).astype(F32)
        if (np_bf16(x) != x).any() or ((x / F32(global_scale)) / sf != y).any():
            continue
        if np_e4m3_value(np_quantize_nvfp4(x, global_scale)[1])[0] != sf:
            continue
        xs.append(x)
        ys.append(y)
    return np.stack(xs), np.stack(ys)


@pytest.mark.parametrize("global_scale", [1.0, 3.0, 0.5])
def test_quantize_nvfp4_ties(global_scale):
    rng = np.random.default_rng(2)
    x, y = nvfp4_tie_groups(rng, global_scale, 256)
    x = x.reshape(32, 128)  # 8 groups a row
    data, sf = _quantize_nvfp4_jit(x, F32(global_scale))
    want_data, want_sf = np_quantize_nvfp4(x, global_scale)
    np.testing.assert_array_equal(np.asarray(sf), want_sf)
    np.testing.assert_array_equal(np.asarray(data), want_data)
    ties = np.isin(np.abs(y), E2M1_TIES)
    assert ties.sum() >= 1000
    # Every tie went to the even neighbour: codes 0, 2, 4, 6 (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2,
    # 3.5->4, 5->4) in magnitude.
    codes = np.stack([want_data & 0xF, want_data >> 4], -1).reshape(-1)
    assert ((codes[ties.reshape(-1)] & 1) == 0).all()


def nvfp4_edge_rows(rng, global_scale):
    """[rows, 128] float32: random rows plus groups that saturate, land on subnormal / floor scales,
    hold -0 and tiny negatives, are all zero, sit at sf = 448, hold infinities, or sit next to rounding
    boundaries of the divisions."""
    g = F32(global_scale)
    rows = [(rng.standard_normal((48, 128)) * 2.0 ** rng.uniform(-6, 6, (48, 1))).astype(F32)]
    special = []
    for _ in range(16):
        grp = rng.standard_normal(16).astype(F32)
        special.append(grp * F32(1e5) * g)  # amax/6/g > 448: sf saturates at 448, codes saturate at 6
        special.append(grp * F32(2.0**-12) * g)  # tiny amax: sf at the 2^-9 floor
        # s0 = 1.4 * 2^-9 rounds down to sf = 2^-9, so x / sf reaches ~8.4 and saturates at 6
        special.append(np.concatenate([[F32(6 * 1.4 * 2.0**-9) * g], grp[1:] * F32(2.0**-9) * g]))
        special.append(grp * F32(5 * 2.0**-9) * g)  # subnormal e4m3 scale
        special.append(np.where(rng.random(16) < 0.5, F32(-0.0), F32(-1e-30)))  # -0 and tiny negatives
        special.append(np.zeros(16, F32))  # all-zero group
        special.append(np.concatenate([[F32(-3.0) * g], np.full(15, F32(-0.0))]))  # -0 next to a value
        special.append((grp * 0.0).astype(F32))  # signed zeros
        special.append(np.concatenate([F32([np.inf, -np.inf]), grp[2:]]))  # infinities saturate
        # NaN of either sign (a quiet and a signalling payload) among finite values or an infinity: 16 NaNs
        special.append(np.where(np.arange(16) == rng.integers(0, 16), rng.choice(F32([np.nan, -np.nan])), grp))
        special.append(np.concatenate([[np.uint32(0xFF80_0001).view(F32), F32(np.inf)], grp[2:] * F32(1e5)]))
    special.append(nvfp4_division_sensitive_groups(rng, global_scale, 16).reshape(-1))
    rows.append(np.concatenate(special).astype(F32).reshape(-1, 128))
    return np.concatenate(rows)


@pytest.mark.parametrize("global_scale", [1.0, 0.37, 3.0])
def test_quantize_nvfp4_matches_numpy(global_scale):
    rng = np.random.default_rng(3)
    x = nvfp4_edge_rows(rng, global_scale)
    data, sf = _quantize_nvfp4_jit(x, F32(global_scale))
    want_data, want_sf = np_quantize_nvfp4(x, global_scale)
    np.testing.assert_array_equal(np.asarray(sf), want_sf)
    np.testing.assert_array_equal(np.asarray(data), want_data)
    # The edge cases really were hit.
    assert (want_sf == 0x7E).any() and (want_sf == 0x01).any() and ((want_sf > 1) & (want_sf < 8)).any()
    nan_groups = np.isnan(x.reshape(-1, 16)).any(-1)
    assert nan_groups.sum() >= 32 and (want_sf.reshape(-1)[nan_groups] == 0x7F).all()
    assert (want_data.reshape(-1, 8)[nan_groups] == 0).all()
    nib = np.stack([want_data & 0xF, want_data >> 4], -1).reshape(x.shape)
    assert not (nib == 8).any()  # zero is always +0
    xb = np_bf16(x)
    assert ((nib & 7) == 7)[np.abs(xb) > 0].any()


# ---------------------------------------------------------------------------------------------------------
# write_kv: the CPU custom call and the jnp twin vs the numpy packer
# ---------------------------------------------------------------------------------------------------------

WRITE_KV = {  # jitted once; scales are traced
    "kernel": jax.jit(lambda c, k, v, s, ks, vs: jax_msa.write_kv(c, k, v, s, k_scale=ks, v_scale=vs,
                                                                   impl="kernel")),
    "reference": jax.jit(lambda c, k, v, s, ks, vs: jax_msa.reference.write_kv(c, k, v, s, k_scale=ks,
                                                                                v_scale=vs)),
}


def write_case(rng, fmt, d, k_scale, v_scale, hkv=2, pages=3, n=40):
    """A random-byte cache, n tokens with unique valid slots plus negative and beyond-the-cache ones, k
    holding the quantizer edge cases (saturation, infinities, -0, zero groups, floor / subnormal scales)
    and v starting with exact rounding ties for v_scale (a power of two times 1 or 3)."""
    cache = random_cache_bytes(rng, fmt, pages, hkv, d)
    valid = rng.choice(pages * PAGE, n - 6, replace=False)
    slots = np.concatenate([valid, [-1, -200, pages * PAGE, pages * PAGE + 7, 2**31 - 1, -(2**31)]])
    slots = rng.permutation(slots).astype(np.int32)
    k = (rng.standard_normal((n, hkv, d)) * 2.0 ** rng.uniform(-3, 3, (n, hkv, 1))).astype(F32)
    v = (rng.standard_normal((n, hkv, d)) * 2.0 ** rng.uniform(-3, 3, (n, hkv, 1))).astype(F32)
    if fmt == kvc.KVFormat.FP8:
        edges, ties = fp8_inputs(rng, k_scale), fp8_tie_inputs(v_scale)
    else:
        edges = nvfp4_edge_rows(rng, k_scale).reshape(-1)
        ties = nvfp4_tie_groups(rng, v_scale, min(v.size // 16, 160))[0].reshape(-1)
    k.reshape(-1)[:min(k.size, edges.size)] = edges[:k.size]
    v.reshape(-1)[:min(v.size, ties.size)] = ties[:v.size]
    return cache, k, v, slots


@QUANTIZED_FORMATS
@pytest.mark.parametrize("d", [128, 64])
@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_write_kv_matches_numpy_packer(fmt, d, impl):
    rng = np.random.default_rng(4 + 10 * int(fmt) + d)
    k_scale, v_scale = (F32(0.37), F32(3.0)) if fmt == kvc.KVFormat.NVFP4 else (F32(1.7), F32(0.75))
    cache, k, v, slots = write_case(rng, fmt, d, k_scale, v_scale)
    got = as_bytes(WRITE_KV[impl](from_bytes(cache, fmt), jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots),
                                  k_scale, v_scale))
    want = np_write_kv(cache, fmt, k, v, slots, k_scale, v_scale)
    assert (want != cache).any()
    np.testing.assert_array_equal(got, want)


@QUANTIZED_FORMATS
@pytest.mark.parametrize("k_scale", [2.0**-100, 1e30], ids=["2^-100", "1e30"])
def test_write_kv_extreme_scales(fmt, k_scale):
    """Bit-exact far from 1 too (any normal fp32 scale down to 2^-100; the CPU handlers run under XLA's
    flush-denormal mode, so subnormal scales are outside the contract)."""
    rng = np.random.default_rng(11)
    cache = random_cache_bytes(rng, fmt, 2, 2, 128)
    n = 16
    slots = rng.choice(2 * PAGE, n, replace=False).astype(np.int32)
    k = (rng.standard_normal((n, 2, 128)) * 2.0 ** rng.uniform(-12, 12, (n, 2, 1)) * k_scale).astype(F32)
    v = rng.standard_normal((n, 2, 128)).astype(F32)
    want = np_write_kv(cache, fmt, k, v, slots, F32(k_scale), F32(1.0))
    for impl in ("kernel", "reference"):
        got = WRITE_KV[impl](from_bytes(cache, fmt), jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots),
                             F32(k_scale), F32(1.0))
        np.testing.assert_array_equal(as_bytes(got), want, err_msg=impl)


@QUANTIZED_FORMATS
def test_write_kv_in_place_under_donation(fmt):
    rng = np.random.default_rng(5)
    cache, k, v, slots = write_case(rng, fmt, 128, 0.5, 2.0, n=12)
    fn = jax.jit(lambda c, k, v, s: jax_msa.write_kv(c, k, v, s, k_scale=0.5, v_scale=2.0, impl="kernel"),
                 donate_argnums=0)
    c = from_bytes(cache, fmt)
    ptr = c.unsafe_buffer_pointer()
    with np.errstate(invalid="ignore"):  # k's edge cases hold NaNs (as in np_bf16)
        k16, v16 = jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16)
    out = fn(c, k16, v16, jnp.asarray(slots))
    assert c.is_deleted() and out.unsafe_buffer_pointer() == ptr
    k_b, v_b = np_bf16(k), np_bf16(v)
    np.testing.assert_array_equal(as_bytes(out), np_write_kv(cache, fmt, k_b, v_b, slots, 0.5, 2.0))


# ---------------------------------------------------------------------------------------------------------
# Decoding: dequantize_cache (exact) and round-trip error bounds
# ---------------------------------------------------------------------------------------------------------

@QUANTIZED_FORMATS
@pytest.mark.parametrize("d", [128, 64])
def test_dequantize_cache_matches_numpy(fmt, d):
    rng = np.random.default_rng(6)
    cache = random_cache_bytes(rng, fmt, 2, 2, d)
    if fmt == kvc.KVFormat.FP8:
        cache[(cache & 0x7F) == 0x7F] = 0x3C  # no NaN codes: compare values
    else:
        # scale bytes: finite E4M3 only
        flat = cache.reshape(2, 4, -1)
        sc = flat[:, :, PAGE * d // 2:]
        sc[(sc & 0x7F) == 0x7F] = 0x21
    ks, vs = F32(0.37), F32(3.0)
    k, v = jax.jit(lambda c: kvc.dequantize_cache(c, d, ks, vs))(from_bytes(cache, fmt))
    want_k, want_v = np_dequantize_cache(cache, fmt, d, ks, vs)
    np.testing.assert_array_equal(np.asarray(k), want_k)
    np.testing.assert_array_equal(np.asarray(v), want_v)


_fp8_round_trip = jax.jit(lambda x, s: kvc.dequantize_fp8(kvc.quantize_fp8(x, s), s))
_nvfp4_round_trip = jax.jit(lambda x, g: kvc.dequantize_nvfp4(*kvc.quantize_nvfp4(x, g), g))


@pytest.mark.parametrize("scale", [1.0, 0.37, 3.0])
def test_fp8_round_trip_error(scale):
    rng = np.random.default_rng(7)
    # |x / scale| across the normal E4M3 range [2^-6, 448]
    x = (rng.choice([-1.0, 1.0], 20000) * 2.0 ** rng.uniform(-6, math.log2(448), 20000) * scale).astype(F32)
    xb = np_bf16(x)
    normal = (np.abs(xb / F32(scale)) >= 2.0**-6) & (np.abs(xb / F32(scale)) <= 448)
    x, xb = x[normal], xb[normal]
    deq = np.asarray(_fp8_round_trip(x, F32(scale)))
    rel = np.abs(deq.astype(np.float64) - xb) / np.abs(xb)
    assert rel.max() <= 2.0**-4  # half an ulp of a 3-bit mantissa
    assert rel.max() > 2.0**-5  # the bound is tight: not trivially met


@pytest.mark.parametrize("global_scale", [1.0, 0.37, 3.0])
def test_nvfp4_round_trip_error(global_scale):
    """Per 16-group bound. Let s0 = amax / (6 * global), s1 = max(s0, 2^-9), sf = RNE_e4m3(s1) and
    y = x_bf16 / (global * sf). The E2M1 error in units of global * sf is at most 1 while |y| <= 6 (half
    the widest grid gap, 4..6) and |y| - 6 beyond (saturation).
    - Normal E4M3 range (2^-6 <= s0 <= 448): sf lies in [s0 * 15/16, s0 * 17/16], so |y| <= 6.4 and every
      element errs by at most global * sf <= (17/16) * amax / 6.
    - Floor / subnormal range (s0 < 2^-6): |sf - s1| <= 2^-10 (half the subnormal step), so the error is at
      most global * max(s1 + 2^-10, 6 * 2^-10).
    (1 + 2^-20) absorbs the fp32 roundings of the two divisions and of the final multiply by global."""
    rng = np.random.default_rng(8)
    g = F32(global_scale)
    x = (rng.standard_normal((512, 128)) * 2.0 ** rng.uniform(-8, 8, (512, 1)) * g).astype(F32)
    x[:64] *= F32(2.0**-8)  # floor and subnormal scales
    x[64, :16] = 0.0
    deq = np.asarray(_nvfp4_round_trip(x, g)).astype(np.float64).reshape(-1, 16)
    xb = np_bf16(x).astype(np.float64).reshape(-1, 16)
    err = np.abs(deq - xb).max(axis=1)
    amax = np.abs(xb).max(axis=1)
    s0 = amax / 6 / global_scale
    normal = (s0 >= 2.0**-6) & (s0 <= 448)
    slack = 1 + 2.0**-20
    assert normal.sum() > 3000 and (~normal).sum() > 300
    assert (err[normal] <= (17 / 16) * amax[normal] / 6 * slack).all()
    assert (err[normal] > amax[normal] / 6 * 0.9).any()  # near-tight: an error of ~1 unit does occur
    s1 = np.maximum(s0[~normal], 2.0**-9)
    assert (err[~normal] <= global_scale * np.maximum(s1 + 2.0**-10, 6 * 2.0**-10) * slack).all()
    assert (deq[amax == 0] == 0).all() and (amax == 0).any()  # zeros stay exact


# ---------------------------------------------------------------------------------------------------------
# Attention over FP8 / NVFP4 caches vs float64 numpy on the decoded values
# ---------------------------------------------------------------------------------------------------------

HKV, HQ, D = 2, 8, 128


def np_attention(q, k, v, topk, req, pos, seq_lens, block_table, scale):
    """float64 MSA (MSA.md section 2): q [T, Hq, D]; k, v [P, Hkv, 128, D] (float64)."""
    t_total, hq, d = q.shape
    hkv = k.shape[1]
    grp = hq // hkv
    out = np.zeros((t_total, hq, d))
    lse = np.full((t_total, hq), -np.inf)
    for t in range(t_total):
        b, p = req[t], pos[t]
        n_blk = min(-(-seq_lens[b] // PAGE), block_table.shape[1])
        for g in range(hkv):
            ids = sorted({int(i) for i in topk[g, t] if 0 <= i < n_blk and PAGE * i <= p})
            if not ids:
                continue
            keys = np.concatenate([k[block_table[b, i], g] for i in ids])
            vals = np.concatenate([v[block_table[b, i], g] for i in ids])
            kpos = np.concatenate([PAGE * i + np.arange(PAGE) for i in ids])
            keys, vals = keys[kpos <= p], vals[kpos <= p]
            for h in range(g * grp, (g + 1) * grp):
                s = scale * keys @ q[t, h]
                m = s.max()
                e = np.exp(s - m)
                out[t, h] = e @ vals / e.sum()
                lse[t, h] = m + np.log(e.sum())
    return out, lse


def attention_case(rng, fmt, prefill):
    """A filled cache (through write_kv) over 2 requests, top-k rows with holes, duplicates, out-of-range
    ids and one all-hole token."""
    if prefill:
        seq_lens = np.array([300, 131], np.int32)
        q_lens = np.array([5, 3])
        cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        req = np.repeat(np.arange(2), q_lens)
        pos = np.concatenate([seq_lens[b] - q_lens[b] + np.arange(q_lens[b]) for b in range(2)])
    else:
        qlen = 2
        seq_lens = np.array([300, 200], np.int32)
        cu = None
        req = np.repeat(np.arange(2), qlen)
        pos = np.concatenate([seq_lens[b] - qlen + np.arange(qlen) for b in range(2)])
    max_blocks, pages = 3, 7
    block_table = rng.permutation(pages)[:2 * max_blocks].reshape(2, max_blocks).astype(np.int32)
    t_total = len(req)
    topk = rng.integers(-1, max_blocks + 1, (HKV, t_total, 4)).astype(np.int32)
    topk[:, :, 0] = pos // PAGE  # the local block
    topk[:, :, 1] = topk[:, :, 2]  # duplicates
    topk[1, -1, :] = -1  # an empty selection
    k_scale, v_scale = (F32(0.05), F32(0.3)) if fmt == kvc.KVFormat.FP8 else (F32(0.37), F32(3.0))
    n = pages * PAGE
    kk = rng.standard_normal((n, HKV, D)).astype(F32) * F32(2.0)
    vv = rng.standard_normal((n, HKV, D)).astype(F32)
    cache = kvc.allocate_cache(fmt, pages, HKV, D)
    cache = WRITE_KV["kernel"](cache, jnp.asarray(kk), jnp.asarray(vv), jnp.arange(n, dtype=jnp.int32),
                               k_scale, v_scale)
    return dict(cache=cache, topk=topk, cu=cu, seq_lens=seq_lens, block_table=block_table, req=req, pos=pos,
                k_scale=k_scale, v_scale=v_scale)


@jax.jit
def _prefill_kernel(q, cache, topk, seq_lens, block_table, k_scale, v_scale, q_scale, cu_seqlens_q):
    return jax_msa.sparse_attention(q, cache, topk, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens,
                                    block_table=block_table, return_lse=True, impl="kernel", k_scale=k_scale,
                                    v_scale=v_scale, q_scale=q_scale)


@jax.jit
def _decode_kernel(q, cache, topk, seq_lens, block_table, k_scale, v_scale, q_scale):
    return jax_msa.sparse_decode(q, cache, topk, seq_lens=seq_lens, block_table=block_table, decode_query_len=2,
                                 return_lse=True, impl="kernel", k_scale=k_scale, v_scale=v_scale,
                                 q_scale=q_scale)


@QUANTIZED_FORMATS
@pytest.mark.parametrize("q_fp8", [False, True])
@pytest.mark.parametrize("op", ["prefill", "decode"])
def test_attention_over_quantized_cache(fmt, q_fp8, op):
    rng = np.random.default_rng(9 + 4 * int(fmt) + 2 * int(q_fp8) + (op == "decode"))
    case = attention_case(rng, fmt, op == "prefill")
    t_total = len(case["req"])
    q32 = rng.standard_normal((t_total, HQ, D)).astype(F32)
    if q_fp8:
        q_scale = F32(0.02)
        q = jnp.asarray(np_quantize_fp8(q32, q_scale).view(E4M3))
        q_vals = np_e4m3_value(np.asarray(q).view(np.uint8)) * q_scale
    else:
        q_scale = None
        q = jnp.asarray(q32, jnp.bfloat16)
        q_vals = np_bf16(q32)
    args = (q, case["cache"], jnp.asarray(case["topk"]), jnp.asarray(case["seq_lens"]),
            jnp.asarray(case["block_table"]), case["k_scale"], case["v_scale"], q_scale)
    if op == "prefill":
        out, lse = _prefill_kernel(*args, jnp.asarray(case["cu"]))
    else:
        out, lse = _decode_kernel(*args)
    k, v = np_dequantize_cache(as_bytes(case["cache"]), fmt, D, case["k_scale"], case["v_scale"])
    want_o, want_lse = np_attention(q_vals.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                                    case["topk"], case["req"], case["pos"], case["seq_lens"],
                                    case["block_table"], D**-0.5)
    out = np.asarray(out, np.float64)
    lse = np.asarray(lse, np.float64)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    empty = np.isinf(want_lse)
    assert empty[-1, HQ // 2:].all() and not empty[:-1].any()
    np.testing.assert_array_equal(lse[empty], -np.inf)
    np.testing.assert_array_equal(out[empty], 0.0)
    assert np.linalg.norm(out - want_o) <= 1e-2 * np.linalg.norm(want_o)
    np.testing.assert_allclose(lse[~empty], want_lse[~empty], rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------
# Malformed caches are rejected with clear errors
# ---------------------------------------------------------------------------------------------------------

def _decode(cache, d=128, hkv=2):
    q = jnp.zeros((1, 4 * hkv, d), jnp.bfloat16)
    topk = jnp.zeros((hkv, 1, 4), jnp.int32)
    return jax_msa.sparse_decode(q, cache, topk, seq_lens=jnp.array([10], jnp.int32),
                                 block_table=jnp.zeros((1, 2), jnp.int32), impl="kernel")


def _write(cache, d=128, hkv=2):
    k = jnp.zeros((3, hkv, d), jnp.bfloat16)
    return jax_msa.write_kv(cache, k, k, jnp.arange(3, dtype=jnp.int32), impl="kernel")


MALFORMED = [
    ("bf16 last dim", lambda: jnp.zeros((2, 2, 128, 255), jnp.bfloat16), 128, r"\[pages, Hkv, 128, 2\*D\]"),
    ("fp8 last dim", lambda: jnp.zeros((2, 2, 128, 128), jnp.float8_e4m3fn), 128, r"128, 256\] for head_dim 128"),
    ("nvfp4 last dim", lambda: jnp.zeros((2, 4, 128, 64), jnp.uint8), 128, r"D/2 \+ D/16\] = \[\.\., \.\., 128, 72\]"),
    ("nvfp4 odd slots", lambda: jnp.zeros((2, 3, 128, 72), jnp.uint8), 128, r"even slot count 2\*Hkv"),
    ("float16", lambda: jnp.zeros((2, 2, 128, 256), jnp.float16), 128,
     r"dtype must be bfloat16, float8_e4m3fn or uint8 \(NVFP4\); got float16"),
    ("nvfp4 head_dim 24", lambda: jnp.zeros((2, 4, 128, 13), jnp.uint8), 24,
     r"NVFP4 kv_cache needs head_dim % 16 == 0"),
    ("page size 64", lambda: jnp.zeros((2, 2, 64, 256), jnp.float8_e4m3fn), 128, r"page size and must be 128"),
    ("rank 3", lambda: jnp.zeros((2, 128, 256), jnp.bfloat16), 128, r"must have rank 4"),
]


@pytest.mark.parametrize("name,make,d,match", MALFORMED, ids=[m[0] for m in MALFORMED])
@pytest.mark.parametrize("op", ["sparse_decode", "write_kv"])
def test_malformed_cache_rejected(name, make, d, match, op):
    cache = make()
    with pytest.raises(ValueError, match=match):
        (_decode if op == "sparse_decode" else _write)(cache, d=d)


def test_write_kv_rejects_head_count_and_scales_on_bf16():
    cache = kvc.allocate_cache(kvc.KVFormat.NVFP4, 2, 2)
    k = jnp.zeros((3, 3, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="k has 3 KV heads but kv_cache holds 2"):
        jax_msa.write_kv(cache, k, k, jnp.arange(3, dtype=jnp.int32))
    k = jnp.zeros((3, 2, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="k_scale / v_scale apply to FP8 and NVFP4 caches"):
        jax_msa.write_kv(kvc.allocate_cache(kvc.KVFormat.BF16, 2, 2), k, k, jnp.arange(3, dtype=jnp.int32),
                         k_scale=0.5)


# ---------------------------------------------------------------------------------------------------------
# allocate_cache
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,shape,dtype,per_token", [
    (kvc.KVFormat.BF16, (5, 4, 128, 256), jnp.bfloat16, 2048),
    (kvc.KVFormat.FP8, (5, 4, 128, 256), jnp.float8_e4m3fn, 1024),
    (kvc.KVFormat.NVFP4, (5, 8, 128, 72), jnp.uint8, 576),
])
def test_allocate_cache(fmt, shape, dtype, per_token):
    cache = kvc.allocate_cache(fmt, 5, 4, 128)
    assert cache.shape == shape and cache.dtype == dtype
    assert kvc.bytes_per_token(fmt, 4, 128) == per_token
    assert cache.nbytes == 5 * PAGE * per_token
    assert kvc.detect_format(cache, 128) == (fmt, 4)
    assert not as_bytes(cache).any()  # all zero bytes: decodes to 0.0 in every format
    k, v = jax.jit(kvc.dequantize_cache, static_argnums=1)(cache, 128)
    assert k.shape == v.shape == (5, 4, 128, 128) and not np.asarray(k).any() and not np.asarray(v).any()


def test_allocate_nvfp4_rejects_head_dim():
    with pytest.raises(ValueError, match="NVFP4 needs head_dim % 16 == 0; got 24"):
        kvc.allocate_cache(kvc.KVFormat.NVFP4, 2, 2, 24)
