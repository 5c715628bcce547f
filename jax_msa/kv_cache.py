"""KV-cache formats: bf16, FP8 E4M3 and NVFP4 (MSA.md sections 3-4), in jnp.

This module owns the byte layouts on the Python side: quantize, dequantize, allocate, and the pure-jnp
twin of the ``write_kv`` custom call. The C++ side mirrors it in ``cc/common/kv_format.h``.

Layouts (P pages, Hkv KV heads, 128 tokens a page, head_dim D):

======== ================================= ===============================================
format   array                             per token and KV head
======== ================================= ===============================================
bf16     bfloat16 [P, Hkv, 128, 2*D]       K = [..., :D], V = [..., D:]  (4*D bytes)
fp8      float8_e4m3fn [P, Hkv, 128, 2*D]  same, value = e4m3 * k_scale / v_scale (2*D bytes)
nvfp4    uint8 [P, 2*Hkv, 128, D/2 + D/16] slot 2g = K of head g, slot 2g+1 = V; per slot:
                                           data [128, D/2] (low nibble = even dim), then
                                           E4M3 scales, K linear, V in 4x4 token quads
                                           (D + D/8 bytes for K and V)
======== ================================= ===============================================
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
import numpy as np

PAGE_SIZE = 128  # tokens per page == tokens per sparse block
NVFP4_GROUP = 16  # head-dim values per E4M3 block scale
E4M3_MAX = 448.0
E2M1_MAX = 6.0
_MIN_NVFP4_SCALE = 2.0**-9


class KVFormat(enum.IntEnum):
    """The cache format; the integer is the ``kv_format`` attribute the custom calls receive."""

    BF16 = 0
    FP8 = 1
    NVFP4 = 2


def detect_format(kv_cache, head_dim: int, *, name: str = "kv_cache") -> tuple[KVFormat, int]:
    """Returns (format, num_kv_heads) of a cache array, or raises ValueError naming what is wrong.

    The format follows from dtype and shape alone: bf16 and float8_e4m3fn caches are
    [pages, Hkv, 128, 2*D]; an NVFP4 cache is uint8 [pages, 2*Hkv, 128, D/2 + D/16].
    """
    fmt, hkv = _format_and_heads(kv_cache, head_dim, name)
    if hkv < 1:
        raise ValueError(f"{name} holds no KV head (Hkv = 0); got shape {tuple(kv_cache.shape)}")
    return fmt, hkv


def _format_and_heads(kv_cache, head_dim: int, name: str) -> tuple[KVFormat, int]:
    shape = tuple(kv_cache.shape)
    dtype = jnp.dtype(kv_cache.dtype)
    if len(shape) != 4:
        raise ValueError(f"{name} must have rank 4 ([pages, heads, 128, bytes]); got shape {shape}")
    if shape[2] != PAGE_SIZE:
        raise ValueError(f"{name}.shape[2] is the page size and must be {PAGE_SIZE}; got shape {shape}")
    if dtype == jnp.bfloat16 or dtype == jnp.float8_e4m3fn:
        if shape[3] != 2 * head_dim:
            raise ValueError(
                f"{name} ({dtype}) must be [pages, Hkv, 128, 2*D] = [.., .., 128, {2 * head_dim}] "
                f"for head_dim {head_dim}; got shape {shape}")
        return (KVFormat.BF16 if dtype == jnp.bfloat16 else KVFormat.FP8), shape[1]
    if dtype == jnp.uint8:
        if head_dim % NVFP4_GROUP:
            raise ValueError(f"an NVFP4 {name} needs head_dim % 16 == 0; got head_dim {head_dim}")
        if shape[3] != nvfp4_token_bytes(head_dim):
            raise ValueError(
                f"{name} (uint8, NVFP4) must be [pages, 2*Hkv, 128, D/2 + D/16] = "
                f"[.., .., 128, {nvfp4_token_bytes(head_dim)}] for head_dim {head_dim}; got shape {shape}")
        if shape[1] % 2:
            raise ValueError(f"{name} (uint8, NVFP4) needs an even slot count 2*Hkv; got shape {shape}")
        return KVFormat.NVFP4, shape[1] // 2
    raise ValueError(
        f"{name} dtype must be bfloat16, float8_e4m3fn or uint8 (NVFP4); got {dtype} with shape {shape}")


def nvfp4_token_bytes(head_dim: int) -> int:
    return head_dim // 2 + head_dim // NVFP4_GROUP


def bytes_per_token(fmt: KVFormat, num_kv_heads: int, head_dim: int) -> int:
    """Cache bytes one token occupies over all KV heads (K and V, scales included)."""
    if fmt == KVFormat.BF16:
        return num_kv_heads * 4 * head_dim
    if fmt == KVFormat.FP8:
        return num_kv_heads * 2 * head_dim
    return num_kv_heads * 2 * nvfp4_token_bytes(head_dim)


def allocate_cache(fmt, num_pages: int, num_kv_heads: int, head_dim: int = 128):
    """An all-zero cache of the given format (zero decodes to 0.0 in every format)."""
    fmt = KVFormat(fmt)
    if fmt == KVFormat.BF16:
        return jnp.zeros((num_pages, num_kv_heads, PAGE_SIZE, 2 * head_dim), jnp.bfloat16)
    if fmt == KVFormat.FP8:
        return jnp.zeros((num_pages, num_kv_heads, PAGE_SIZE, 2 * head_dim), jnp.float8_e4m3fn)
    if head_dim % NVFP4_GROUP:
        raise ValueError(f"NVFP4 needs head_dim % 16 == 0; got {head_dim}")
    return jnp.zeros((num_pages, 2 * num_kv_heads, PAGE_SIZE, nvfp4_token_bytes(head_dim)), jnp.uint8)


# ---------------------------------------------------------------------------------------------------------
# Scalar codecs (elementwise, exact; the C++ twins live in cc/common/numeric.h)
# ---------------------------------------------------------------------------------------------------------

def div_rn(a, b):
    """Correctly rounded fp32 division a / b (round to nearest, ties to even), in integer arithmetic.

    XLA's CPU backend computes fp32 division approximately (off by an ulp for about 1 in 10 inputs), and
    the quantizers must agree bit for bit with the CUDA kernels and with numpy. Exact for every finite a
    and finite nonzero b, subnormal operands and results included; the IEEE results of the other cases
    (infinities, zeros, NaN) are assembled as bits too: XLA may compute `a / b` as `a * (1 / b)`, which turns
    inf / 2^127 into inf * 0 = NaN.
    """
    a = jnp.asarray(a, jnp.float32)
    b = jnp.asarray(b, jnp.float32)
    a, b = jnp.broadcast_arrays(a, b)
    u32 = jnp.uint32
    ua = jax.lax.bitcast_convert_type(a, u32)
    ub = jax.lax.bitcast_convert_type(b, u32)
    sign = (ua ^ ub) & u32(0x80000000)

    def unpack(u):
        e = ((u >> 23) & u32(0xFF)).astype(jnp.int32)
        m = u & u32(0x7FFFFF)
        m = jnp.where(e == 0, m, m | u32(0x800000))
        e = jnp.where(e == 0, -126, e - 127)
        sh = jax.lax.clz(m).astype(jnp.int32) - 8  # bring the leading one to bit 23
        sh = jnp.where(m == 0, 0, sh)
        return m << sh.astype(u32), e - sh

    ma, ea = unpack(ua)
    mb, eb = unpack(ub)
    lt = ma < mb
    ma = jnp.where(lt, ma << u32(1), ma)  # quotient now in [1, 2)
    e = ea - eb - lt.astype(jnp.int32)
    def step(_, qr):  # one quotient bit; 25 of them: 1 integer + 23 fraction + 1 guard
        q, r = qr
        bit = r >= mb
        return (q << u32(1)) | bit.astype(u32), jnp.where(bit, r - mb, r) << u32(1)

    q, r = jax.lax.fori_loop(0, 25, step, (jnp.zeros_like(ma), ma))
    sticky = r != 0
    d = 1 + jnp.maximum(0, -126 - e)  # bits to drop: the guard bit, plus more for subnormal results
    dd = jnp.minimum(d, 26).astype(u32)
    kept = q >> dd
    rem = q & ((u32(1) << dd) - u32(1))
    half = u32(1) << (dd - u32(1))
    up = (rem > half) | ((rem == half) & (sticky | ((kept & u32(1)) == 1)))
    kept = kept + up.astype(u32)
    kept = jnp.where(d >= 26, u32(0), kept)
    bits = (jnp.maximum(e, -126) + 126).astype(u32) * u32(1 << 23) + kept
    bits = jnp.minimum(bits, u32(0x7F800000))  # overflow -> inf
    # Select on the bits: XLA's CPU backend treats subnormal floats as zero (and may fold a float select
    # of them), so the result is assembled as an integer and bitcast once.
    a_zero = ma == 0  # not `(ua & 0x7fffffff) == 0`: XLA rewrites that into a float compare
    # b != 0 on the normalized mantissa too: XLA turns `(ub & 0x7fffffff) != 0` into a float compare that
    # flushes a subnormal b to zero.
    a_special = ((ua >> 23) & u32(0xFF)) == 0xFF  # inf or NaN
    b_special = ((ub >> 23) & u32(0xFF)) == 0xFF
    b_zero = mb == 0
    finite = ~a_special & ~b_special & ~b_zero
    a_nan = a_special & ((ua & u32(0x7FFFFF)) != 0)
    b_nan = b_special & ((ub & u32(0x7FFFFF)) != 0)
    nan = a_nan | b_nan | (a_special & b_special) | (a_zero & b_zero)
    # not NaN: inf / finite and finite / 0 -> inf; finite / inf -> 0 (signs xor)
    special = jnp.where(nan, u32(0x7FC00000), jnp.where(a_special | b_zero, u32(0x7F800000) | sign, sign))
    out = jnp.where(finite, jnp.where(a_zero, sign, bits | sign), special)
    return jax.lax.bitcast_convert_type(out, jnp.float32)


def e4m3_satfinite(x):
    """fp32 -> float8_e4m3fn, round to nearest even, saturating at +-448, in integer arithmetic. A NaN of either sign
    or payload gives the one code 0x7F, as the C++ / CUDA quantizer (cc/common/numeric.h) does.

    Not `astype(float8_e4m3fn)`: the code is built as an integer and bitcast, so that XLA cannot drop the rounding.
    With excess precision allowed (XLA's GPU default), `x.astype(e4m3).astype(f32)` in one computation returns x
    itself (all of 1M random inputs on an H100), and the NVFP4 codes were then divided by the unrounded block scale
    (99,785 of 1,048,576 data bytes differed from the CPU's). The bytes must be the same on every backend and the
    CUDA kernels' (cvt.rn.satfinite). Exact for every fp32 input, subnormal ones included (-> +-0).
    """
    u32 = jnp.uint32
    x = jnp.clip(jnp.asarray(x, jnp.float32), -E4M3_MAX, E4M3_MAX)  # clip keeps NaN
    ux = jax.lax.bitcast_convert_type(x, u32)
    sign = (ux >> u32(24)) & u32(0x80)
    field = (ux >> u32(23)) & u32(0xFF)
    sig = jnp.where(field == 0, u32(0), (ux & u32(0x7FFFFF)) | u32(0x800000))  # fp32 subnormals round to 0
    e = field.astype(jnp.int32) - 127
    # Quantum 2^(max(e, -6) - 3): drop 20 significand bits for E4M3 normals, more below 2^-6 (E4M3 subnormals).
    drop = jnp.minimum(20 + jnp.maximum(-6 - e, 0), 31).astype(u32)
    kept = sig >> drop
    rem = sig & ((u32(1) << drop) - u32(1))
    half = u32(1) << (drop - u32(1))
    kept = kept + ((rem > half) | ((rem == half) & ((kept & u32(1)) == 1))).astype(u32)
    # kept counts quanta: code = (max(e, -6) + 6) * 8 + kept covers subnormals (kept < 8), normals (kept in
    # [8, 16)) and the carry into the next binade (kept == 16); |x| <= 448 keeps it <= 0x7E.
    code = (jnp.maximum(e, -6) + 6).astype(u32) * u32(8) + kept
    nan = field == 0xFF  # (clip left no infinity)
    code = jnp.where(nan, u32(0x7F), code | sign)
    return jax.lax.bitcast_convert_type(code.astype(jnp.uint8), jnp.float8_e4m3fn)


# E2M1 magnitudes by code (3 bits); bit 3 is the sign.
_E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def e2m1_encode(x):
    """fp32 -> 4-bit E2M1 code (uint8 in [0, 16)), round to nearest even, saturating at 6; a value that
    rounds to zero is +0 (code 0)."""
    x = jnp.asarray(x, jnp.float32)
    a = jnp.abs(x)
    # Thresholds between neighbouring codes; `<=` where the tie goes to the lower (even) code.
    m = jnp.where(a <= 0.25, 0,
        jnp.where(a < 0.75, 1,
        jnp.where(a <= 1.25, 2,
        jnp.where(a < 1.75, 3,
        jnp.where(a <= 2.5, 4,
        jnp.where(a < 3.5, 5,
        jnp.where(a <= 5.0, 6, 7)))))))
    m = jnp.where(jnp.isnan(x), 7, m)
    neg = jnp.signbit(x) & (m != 0)
    return (m + jnp.where(neg, 8, 0)).astype(jnp.uint8)


def e2m1_decode(code):
    code = jnp.asarray(code, jnp.uint8)
    mag = jnp.asarray(_E2M1_VALUES)[(code & 7).astype(jnp.int32)]
    return jnp.where((code & 8) != 0, -mag, mag)


# ---------------------------------------------------------------------------------------------------------
# FP8 and NVFP4 quantization of [..., D] vectors
# ---------------------------------------------------------------------------------------------------------

def round_to_bf16(x):
    """x rounded to bf16 (nearest even), as fp32. Not `astype(bfloat16).astype(float32)`, which XLA's GPU backend
    may drop (excess precision allowed by default, see e4m3_satfinite): reduce_precision is kept (tested on XLA's CPU
    backend and an H100)."""
    x = jnp.asarray(x)
    if x.dtype == jnp.bfloat16:
        return x.astype(jnp.float32)
    return jax.lax.reduce_precision(x.astype(jnp.float32), exponent_bits=8, mantissa_bits=7)


def quantize_fp8(x, scale=1.0):
    """value -> e4m3 with value ~= e4m3 * scale: round x to bf16, divide by scale, E4M3 satfinite."""
    xb = round_to_bf16(x)
    return e4m3_satfinite(div_rn(xb, jnp.asarray(scale, jnp.float32)))


def dequantize_fp8(codes, scale=1.0):
    return codes.astype(jnp.float32) * jnp.asarray(scale, jnp.float32)


def quantize_nvfp4(x, global_scale=1.0):
    """[..., D] values -> (data uint8 [..., D/2], scales float8_e4m3fn [..., D/16]) per MSA.md section 4.

    Round to bf16; amax per 16-group; sf = e4m3_satfinite(max((max(amax, 1e-12) / 6) / global, 2^-9));
    code = RNE_satfinite_e2m1((x / global) / sf) with fp32 (correctly rounded) divisions. A group holding a NaN
    (outside MSA.md's contract) reads back as 16 NaNs: scale byte 0x7F, data bytes 0, as cc/common/quantize.h.
    """
    x = jnp.asarray(x)
    d = x.shape[-1]
    if d % NVFP4_GROUP:
        raise ValueError(f"NVFP4 needs the last dimension to be a multiple of 16; got {d}")
    gs = jnp.asarray(global_scale, jnp.float32)
    xb = round_to_bf16(x)
    groups = xb.reshape(*x.shape[:-1], d // NVFP4_GROUP, NVFP4_GROUP)
    nan = jnp.isnan(groups)
    has_nan = jnp.any(nan, axis=-1)
    amax = jnp.max(jnp.where(nan, 0.0, jnp.abs(groups)), axis=-1)
    sf = e4m3_satfinite(jnp.maximum(div_rn(div_rn(jnp.maximum(amax, 1e-12), 6.0), gs), _MIN_NVFP4_SCALE))
    sf = jnp.where(has_nan, jax.lax.bitcast_convert_type(jnp.uint8(0x7F), jnp.float8_e4m3fn), sf)
    codes = e2m1_encode(div_rn(div_rn(groups, gs), sf.astype(jnp.float32)[..., None]))
    codes = jnp.where(has_nan[..., None], jnp.uint8(0), codes)
    codes = codes.reshape(*x.shape[:-1], d // 2, 2)
    data = codes[..., 0] | (codes[..., 1] << 4)
    return data.astype(jnp.uint8), sf


def dequantize_nvfp4(data, scales, global_scale=1.0):
    """(data uint8 [..., D/2], scales e4m3 [..., D/16]) -> fp32 [..., D] (exact)."""
    lo = e2m1_decode(data & 0xF)
    hi = e2m1_decode(data >> 4)
    vals = jnp.stack([lo, hi], axis=-1).reshape(*data.shape[:-1], data.shape[-1] * 2)
    d = vals.shape[-1]
    sf = scales.astype(jnp.float32)
    vals = vals.reshape(*data.shape[:-1], d // NVFP4_GROUP, NVFP4_GROUP) * sf[..., None]
    return vals.reshape(*data.shape[:-1], d) * jnp.asarray(global_scale, jnp.float32)


# ---------------------------------------------------------------------------------------------------------
# NVFP4 slot layout: (data [128, D/2], scales [128, D/16]) <-> slot bytes [128 * (D/2 + D/16)]
# ---------------------------------------------------------------------------------------------------------

def _scale_perm(head_dim: int, is_v: bool) -> np.ndarray:
    """Byte offset (within the scale region) of the scale of (token t, group c), as [128, D/16]."""
    ng = head_dim // NVFP4_GROUP
    t = np.arange(PAGE_SIZE)[:, None]
    c = np.arange(ng)[None, :]
    if is_v:
        return (t // 4) * (4 * ng) + 4 * c + (t % 4)
    return t * ng + c


def split_nvfp4_slots(kv_cache, head_dim: int):
    """uint8 [P, 2*Hkv, 128, D/2 + D/16] -> (data uint8 [P, 2*Hkv, 128, D/2],
    scales float8_e4m3fn [P, 2*Hkv, 128, D/16]) with the scales in (token, group) order."""
    p, s = kv_cache.shape[:2]
    flat = kv_cache.reshape(p, s, -1)
    nd = PAGE_SIZE * head_dim // 2
    data = flat[:, :, :nd].reshape(p, s, PAGE_SIZE, head_dim // 2)
    sc = flat[:, :, nd:]
    k_idx = jnp.asarray(_scale_perm(head_dim, False))
    v_idx = jnp.asarray(_scale_perm(head_dim, True))
    k_sc = sc[:, 0::2][:, :, k_idx]
    v_sc = sc[:, 1::2][:, :, v_idx]
    scales = jnp.stack([k_sc, v_sc], axis=2).reshape(p, s, PAGE_SIZE, head_dim // NVFP4_GROUP)
    return data, jax.lax.bitcast_convert_type(scales, jnp.float8_e4m3fn)


def dequantize_cache(kv_cache, head_dim: int, k_scale=1.0, v_scale=1.0):
    """Any-format cache -> (K, V) fp32 [P, Hkv, 128, D], exactly the values every kernel sees."""
    fmt, hkv = detect_format(kv_cache, head_dim)
    if fmt == KVFormat.BF16:
        c = kv_cache.astype(jnp.float32)
        return c[..., :head_dim], c[..., head_dim:]
    if fmt == KVFormat.FP8:
        c = kv_cache.astype(jnp.float32)
        return (c[..., :head_dim] * jnp.asarray(k_scale, jnp.float32),
                c[..., head_dim:] * jnp.asarray(v_scale, jnp.float32))
    data, scales = split_nvfp4_slots(kv_cache, head_dim)
    k = dequantize_nvfp4(data[:, 0::2], scales[:, 0::2], k_scale)
    v = dequantize_nvfp4(data[:, 1::2], scales[:, 1::2], v_scale)
    return k, v


# ---------------------------------------------------------------------------------------------------------
# write_kv in jnp (the reference twin of the `jax_msa_write_kv` custom call)
# ---------------------------------------------------------------------------------------------------------

def write_kv_reference(kv_cache, k, v, slot_mapping, *, k_scale=1.0, v_scale=1.0):
    """Scatters k, v [N, Hkv, D] into the cache at slot = page * 128 + offset; a negative slot or one
    beyond the cache is skipped. Returns the updated cache (same format)."""
    n, hkv, d = k.shape
    fmt, _ = detect_format(kv_cache, d)
    pages = kv_cache.shape[0]
    slot = slot_mapping.astype(jnp.int32)
    ok = (slot >= 0) & (slot <= min(pages * PAGE_SIZE, 2**31) - 1)  # (slot_mapping is int32)
    page = jnp.where(ok, slot // PAGE_SIZE, 0)
    off = jnp.where(ok, slot % PAGE_SIZE, 0)
    g = jnp.arange(hkv, dtype=jnp.int32)
    # The scatters index (row, position in the row) of a 2-D or 3-D view, never a flat byte or element offset: the
    # indices are int32 (no x64), and a cache of 2 GB or more has offsets past 2^31. A skipped slot gets the row
    # past the last, which mode="drop" drops.
    if fmt in (KVFormat.BF16, KVFormat.FP8):
        rows = jnp.where(ok[:, None], page[:, None] * hkv + g[None, :], pages * hkv)  # [N, Hkv]: (page, head) rows
        if fmt == KVFormat.BF16:
            vals = jnp.concatenate([k, v], axis=-1).astype(jnp.bfloat16)
        else:
            vals = jnp.concatenate([quantize_fp8(k, k_scale), quantize_fp8(v, v_scale)], axis=-1)
        tokens = kv_cache.reshape(pages * hkv, PAGE_SIZE, 2 * d)
        tokens = tokens.at[rows, jnp.broadcast_to(off[:, None], rows.shape)].set(vals, mode="drop")
        return tokens.reshape(kv_cache.shape)

    # NVFP4: bytes of the [pages * 2 * Hkv, slot bytes] slot view.
    slot_bytes = PAGE_SIZE * nvfp4_token_bytes(d)
    nd = PAGE_SIZE * d // 2
    slots = kv_cache.reshape(pages * 2 * hkv, slot_bytes)
    for is_v, x, gscale in ((False, k, k_scale), (True, v, v_scale)):
        data, sf = quantize_nvfp4(x, gscale)  # [N, Hkv, D/2], [N, Hkv, D/16]
        rows = jnp.where(ok[:, None], page[:, None] * (2 * hkv) + 2 * g[None, :] + int(is_v), pages * 2 * hkv)
        data_col = off[:, None, None] * (d // 2) + jnp.arange(d // 2, dtype=jnp.int32)  # [N, 1, D/2]
        scale_col = nd + jnp.asarray(_scale_perm(d, is_v), jnp.int32)[off][:, None, :]  # [N, 1, D/16]
        slots = slots.at[rows[..., None], data_col].set(data, mode="drop")
        slots = slots.at[rows[..., None], scale_col].set(jax.lax.bitcast_convert_type(sf, jnp.uint8), mode="drop")
    return slots.reshape(kv_cache.shape)
