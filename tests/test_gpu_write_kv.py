"""The CUDA write_kv kernel (cc/cuda/write_kv.cu) against the jnp quantizer run on the CPU, byte for byte.

For every format (bf16, FP8, NVFP4), D in {64, 128} and Hkv in {1, 3, 4}: k / v groups drawn from the corner
cases of MSA.md section 4 (E2M1 midpoint ties, values that saturate E4M3 / E2M1, scales that land in or
below the E4M3 subnormal range, negative zeros, all-zero groups, bf16 subnormals, the bf16 maximum; for FP8 /
NVFP4 also groups holding a NaN of either sign, which docs/FORMATS.md maps to one code each), slots
with -1, negative, out-of-range and INT32_MAX entries, and a cache pre-filled with random (NaN-free) bytes
so that any stray write is caught. The expected cache is jax_msa.reference.write_kv computed on the CPU
device (its divisions are the correctly rounded kvc.div_rn). Also: donation updates the cache in place,
zero new tokens leave it untouched, the GPU lowering is the custom call (never the reference), and jit(vmap(...))
over a donated stack of layer caches is one in-place call that writes each layer's bytes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_msa
from jax_msa import kv_cache as kvc
from jax_msa import reference

pytestmark = pytest.mark.gpu

PAGE = kvc.PAGE_SIZE
INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)
E2M1_MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
BF16_MAX = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)


def _gpu():
    return jax.devices("gpu")[0]


def _cpu():
    return jax.devices("cpu")[0]


def _corner_case_values(rng, shape, global_scale: float, nan_groups: bool = False) -> np.ndarray:
    """float32 [..., D] (D % 16 == 0) built from 16-value groups of one kind each; with nan_groups, some groups hold
    a NaN (FP8: one code 0x7F; NVFP4: scale byte 0x7F, data 0)."""
    *lead, d = shape
    groups = int(np.prod(lead)) * (d // 16)
    out = rng.standard_normal((groups, 16)).astype(np.float32) * 2.0
    kind = rng.integers(0, 10 if nan_groups else 9, groups)
    for i in range(groups):
        k = kind[i]
        if k == 1:  # exact E2M1 ties: amax = 6 * 2^e * global, the rest midpoints * 2^e * global
            e = float(rng.integers(-9, 8))
            vals = rng.choice(E2M1_MIDPOINTS, 16) * rng.choice([-1.0, 1.0], 16)
            vals[rng.integers(0, 16)] = 6.0
            out[i] = vals * 2.0**e * global_scale
        elif k == 2:  # saturating E4M3 (and the NVFP4 scale), the bf16 maximum included
            out[i] *= 1e4
            out[i, rng.integers(0, 16)] = rng.choice([-1.0, 1.0]) * BF16_MAX
        elif k == 3:  # tiny groups: E4M3-subnormal or clamped (2^-9) block scales
            out[i] *= 10.0 ** rng.uniform(-7.0, -1.5)
        elif k == 4:  # negative zeros mixed into a normal group
            out[i, rng.random(16) < 0.5] = -0.0
        elif k == 5:
            out[i] = 0.0
        elif k == 6:
            out[i] = -0.0
        elif k == 7:  # bf16 subnormals
            out[i] *= 1e-39
        elif k == 9:  # a NaN of either sign among finite values
            out[i, rng.integers(0, 16)] = rng.choice([np.nan, -np.nan])
    return out.reshape(shape)


def _random_slots(rng, n: int, pages: int) -> np.ndarray:
    """Distinct valid slots (a shuffled subset of the cache) with skipped entries mixed in."""
    slots = rng.permutation(pages * PAGE)[:n].astype(np.int64)
    r = rng.random(n)
    slots = np.where(r < 0.08, -1, slots)
    slots = np.where((r >= 0.08) & (r < 0.12), rng.integers(INT32_MIN, -1, n), slots)
    slots = np.where((r >= 0.12) & (r < 0.16), pages * PAGE + rng.integers(0, 3 * PAGE, n), slots)
    slots = np.where((r >= 0.16) & (r < 0.18), INT32_MAX, slots)
    return slots.astype(np.int32)


def _random_cache(rng, fmt, pages: int, hkv: int, d: int) -> np.ndarray:
    """Random bytes in the cache's dtype, NaN-free (bf16: finite values; E4M3: the NaN codes replaced)."""
    if fmt == kvc.KVFormat.BF16:
        return (rng.standard_normal((pages, hkv, PAGE, 2 * d)) * 4.0).astype(ml_dtypes.bfloat16)
    if fmt == kvc.KVFormat.FP8:
        b = rng.integers(0, 256, (pages, hkv, PAGE, 2 * d), dtype=np.uint8)
        b[(b & 0x7F) == 0x7F] ^= 0x01
        return b.view(ml_dtypes.float8_e4m3fn)
    return rng.integers(0, 256, (pages, 2 * hkv, PAGE, kvc.nvfp4_token_bytes(d)), dtype=np.uint8)


def _as_bytes(x) -> np.ndarray:
    return np.asarray(x).view(np.uint8)


@functools.cache
def _gpu_write(k_scale, v_scale):
    """jit(write_kv) on the GPU with the cache donated; the kernel path only."""
    def write(cache, k, v, slots):
        return jax_msa.write_kv(cache, k, v, slots, k_scale=k_scale, v_scale=v_scale, impl="kernel")
    return jax.jit(write, donate_argnums=0)


@functools.cache
def _jnp_writer(k_scale, v_scale):
    def write(cache, k, v, slots):
        return reference.write_kv(cache, k, v, slots, k_scale=k_scale, v_scale=v_scale)
    return jax.jit(write)


def _expected_on_cpu(cache, k, v, slots, k_scale, v_scale) -> np.ndarray:
    cpu = _cpu()
    with jax.default_device(cpu):
        args = [jax.device_put(jnp.asarray(x), cpu) for x in (cache, k, v, slots)]
        return _as_bytes(_jnp_writer(k_scale, v_scale)(*args))


def _problem(fmt, d, hkv, seed, n=300, pages=4):
    rng = np.random.default_rng(seed)
    quantized = fmt != kvc.KVFormat.BF16
    # Hkv = 1 or 3: default scales (None = 1.0); Hkv = 4: a power-of-two K scale (ties stay exact) and an
    # arbitrary V scale.
    k_scale, v_scale = (0.5, 0.0371) if (quantized and hkv == 4) else (None, None)
    k_gs, v_gs = 1.0 if k_scale is None else k_scale, 1.0 if v_scale is None else v_scale
    k = _corner_case_values(rng, (n, hkv, d), k_gs, quantized).astype(ml_dtypes.bfloat16)
    v = _corner_case_values(rng, (n, hkv, d), v_gs, quantized).astype(ml_dtypes.bfloat16)
    slots = _random_slots(rng, n, pages)
    cache = _random_cache(rng, fmt, pages, hkv, d)
    return cache, k, v, slots, k_scale, v_scale


def _first_mismatch(got: np.ndarray, want: np.ndarray) -> str:
    bad = np.argwhere(got != want)
    idx = tuple(bad[0])
    return f"{len(bad)} bytes differ; first at {idx}: got {got[idx]:#04x}, want {want[idx]:#04x}"


FORMATS = [kvc.KVFormat.BF16, kvc.KVFormat.FP8, kvc.KVFormat.NVFP4]


@pytest.mark.parametrize("fmt", FORMATS[1:], ids=lambda f: f.name.lower())
def test_jnp_writer_on_the_gpu_matches_cpu_bytes(fmt):
    """The jnp writer (reference.write_kv, the portable path) compiled for the GPU writes the CPU's bytes: XLA's GPU
    backend may drop an fp32 -> E4M3 -> fp32 or fp32 -> bf16 -> fp32 round trip (excess precision, on by default),
    which made the NVFP4 codes use the unrounded block scale (99,785 of 1,048,576 bytes off on an H100) until the
    quantizers rounded by bitcast and reduce_precision. fp32 K/V too, whose bf16 rounding is the quantizer's own."""
    cache, k, v, slots, k_scale, v_scale = _problem(fmt, 128, 4, 2000 + int(fmt))
    for kv_dtype in (ml_dtypes.bfloat16, np.float32):
        kk, vv = k.astype(np.float32), v.astype(np.float32)
        if kv_dtype == np.float32:  # bits below bf16's, so that the bf16 rounding matters
            rng = np.random.default_rng(7)
            kk = kk * (1 + rng.uniform(-2**-9, 2**-9, kk.shape).astype(np.float32))
            vv = vv * (1 + rng.uniform(-2**-9, 2**-9, vv.shape).astype(np.float32))
        kk, vv = kk.astype(kv_dtype), vv.astype(kv_dtype)
        want = _expected_on_cpu(cache, kk, vv, slots, k_scale, v_scale)
        gpu = _gpu()
        args = [jax.device_put(jnp.asarray(x), gpu) for x in (cache, kk, vv, slots)]
        got = _as_bytes(_jnp_writer(k_scale, v_scale)(*args))
        assert got.shape == want.shape
        assert (got == want).all(), f"{np.dtype(kv_dtype).name} K/V: " + _first_mismatch(got, want)


@pytest.mark.parametrize("hkv", [1, 3, 4])  # 3: the kernel's row / Hkv by a multiplier that is not a power of two
@pytest.mark.parametrize("d", [128, 64])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name.lower())
def test_cuda_write_kv_matches_cpu_reference_bytes(fmt, d, hkv):
    seed = 1000 + 100 * int(fmt) + 10 * hkv + d // 64
    cache, k, v, slots, k_scale, v_scale = _problem(fmt, d, hkv, seed)
    want = _expected_on_cpu(cache, k, v, slots, k_scale, v_scale)
    gpu = _gpu()
    args = [jax.device_put(jnp.asarray(x), gpu) for x in (cache, k, v, slots)]
    got = _as_bytes(_gpu_write(k_scale, v_scale)(*args))
    assert got.shape == want.shape
    assert (got == want).all(), _first_mismatch(got, want)
    # The problem really writes something and really keeps something: both regions are checked.
    written = (slots >= 0) & (slots < cache.shape[0] * PAGE)
    assert 0 < written.sum() < cache.shape[0] * PAGE
    assert (want != _as_bytes(cache)).any()


# outside: NVFP4's codes after the division by the global scale (E2m1Bounds::divides_exactly is false)
@pytest.mark.parametrize("scales", [(None, None), (0.5, 0.0371), (3.0e-3, 7.0), (1e-30, 1e35)],
                         ids=["unit", "mixed", "far", "outside"])
@pytest.mark.parametrize("fmt", FORMATS[1:], ids=lambda f: f.name.lower())
def test_cuda_write_kv_every_bf16_value_matches_cpu_bytes(fmt, scales):
    """All 65,536 bf16 bit patterns (NaNs, infinities, subnormals, both zeros) as K, and in another order as V, through
    the kernel's conversions (the E4M3 codes by the hardware's cvt.rn.satfinite.e4m3x2.f32 on sm_89+, the E2M1
    codes by E2m1Bounds on x itself, or after the division by a global scale outside [2^-90, 2^100]), byte for byte the
    CPU's. Scales that keep the quotients in range, that push them into E4M3's subnormals and saturation, and (NVFP4)
    block scales across the whole E4M3 range."""
    k_scale, v_scale = scales
    hkv, d = 2, 128
    n = 65536 // (hkv * d)
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    k = bits.view(ml_dtypes.bfloat16).reshape(n, hkv, d)
    v = np.random.default_rng(11).permutation(bits).view(ml_dtypes.bfloat16).reshape(n, hkv, d)
    pages = n // PAGE
    slots = np.random.default_rng(12).permutation(pages * PAGE).astype(np.int32)
    cache = _random_cache(np.random.default_rng(13), fmt, pages, hkv, d)
    want = _expected_on_cpu(cache, k, v, slots, k_scale, v_scale)
    gpu = _gpu()
    got = _as_bytes(_gpu_write(k_scale, v_scale)(*(jax.device_put(jnp.asarray(x), gpu) for x in (cache, k, v, slots))))
    assert (got == want).all(), _first_mismatch(got, want)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name.lower())
def test_cuda_write_kv_many_rows_matches_cpu_bytes(fmt):
    """More rows than one wave of the kernel's CTAs holds (36,000 rows of Hkv = 3 against at most 132 SMs x 8 CTAs x 16
    rows): the grid's later waves, with skipped slots among the rows; byte for byte the CPU's. (Written for the
    forty-fifth session's pipelined loop, dropped; it passed on HEAD's modules there, in that branch's tree.)"""
    rng = np.random.default_rng(1500 + int(fmt))
    n, hkv, d, pages = 12000, 3, 128, 100
    quantized = fmt != kvc.KVFormat.BF16
    k_scale, v_scale = (0.75, 0.0371) if quantized else (None, None)
    magnitude = lambda: 10.0 ** rng.uniform(-3.0, 3.0, (n, hkv, 1))  # a block-scale spread across rows
    k = (rng.standard_normal((n, hkv, d)) * magnitude()).astype(ml_dtypes.bfloat16)
    v = (rng.standard_normal((n, hkv, d)) * magnitude()).astype(ml_dtypes.bfloat16)
    slots = _random_slots(rng, n, pages)
    cache = _random_cache(rng, fmt, pages, hkv, d)
    want = _expected_on_cpu(cache, k, v, slots, k_scale, v_scale)
    gpu = _gpu()
    got = _as_bytes(_gpu_write(k_scale, v_scale)(*(jax.device_put(jnp.asarray(x), gpu) for x in (cache, k, v, slots))))
    assert (got == want).all(), _first_mismatch(got, want)
    written = (slots >= 0) & (slots < pages * PAGE)
    assert 0.7 * n < written.sum() < n


def test_cuda_write_kv_lowers_to_the_custom_call_with_aliasing():
    cache, k, v, slots, k_scale, v_scale = _problem(kvc.KVFormat.NVFP4, 128, 4, seed=7, n=16, pages=1)
    text = _gpu_write(k_scale, v_scale).lower(cache, k, v, slots).as_text()
    assert "stablehlo.custom_call @jax_msa_write_kv" in text
    assert "output_operand_aliases" in text
    assert "tf.aliasing_output = 0" in text


def test_cuda_write_kv_donated_cache_is_updated_in_place():
    cache, k, v, slots, k_scale, v_scale = _problem(kvc.KVFormat.NVFP4, 128, 4, seed=8)
    _, k2, v2, slots2, _, _ = _problem(kvc.KVFormat.NVFP4, 128, 4, seed=9)
    want = _expected_on_cpu(cache, k, v, slots, k_scale, v_scale)
    want = _expected_on_cpu(want.view(cache.dtype).reshape(cache.shape), k2, v2, slots2, k_scale, v_scale)
    gpu = _gpu()
    fn = _gpu_write(k_scale, v_scale)
    dev_cache = jax.device_put(jnp.asarray(cache), gpu)
    ptr = dev_cache.unsafe_buffer_pointer()
    out = fn(dev_cache, *(jax.device_put(jnp.asarray(x), gpu) for x in (k, v, slots)))
    assert dev_cache.is_deleted()
    assert out.unsafe_buffer_pointer() == ptr
    out2 = fn(out, *(jax.device_put(jnp.asarray(x), gpu) for x in (k2, v2, slots2)))
    assert out2.unsafe_buffer_pointer() == ptr
    got = _as_bytes(out2)
    assert (got == want).all(), _first_mismatch(got, want)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name.lower())
def test_cuda_write_kv_with_only_skipped_or_no_tokens_leaves_the_cache(fmt):
    rng = np.random.default_rng(40 + int(fmt))
    cache = _random_cache(rng, fmt, 2, 2, 128)
    gpu = _gpu()
    for n, slots in ((0, np.zeros((0,), np.int32)),
                     (5, np.array([-1, 2 * PAGE, INT32_MAX, INT32_MIN, -PAGE], np.int32))):
        k = rng.standard_normal((n, 2, 128)).astype(ml_dtypes.bfloat16)
        v = rng.standard_normal((n, 2, 128)).astype(ml_dtypes.bfloat16)
        out = _gpu_write(None, None)(*(jax.device_put(jnp.asarray(x), gpu) for x in (cache, k, v, slots)))
        got = _as_bytes(out)
        assert (got == _as_bytes(cache)).all(), _first_mismatch(got, _as_bytes(cache))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name.lower())
def test_cuda_write_kv_vmapped_over_a_donated_stack(fmt):
    """jit(vmap(write_kv)) over a donated stack of layer caches [L, P, ...] (and vmap(vmap(...)) over [2, L, P, ...]):
    one custom call whose handler reads the leading dims as pages (jax_msa/_batching.py), updating the stack in place,
    byte for byte what the jnp writer gives layer by layer on the CPU. Each layer's slots include ones just past its
    own pages (P * 128 + x): skipped, never landing in the next layer's pages."""
    layers, pages, hkv, d = 6, 4, 4, 128
    probs = [_problem(fmt, d, hkv, seed=500 + 10 * int(fmt) + i, pages=pages) for i in range(layers)]
    k_scale, v_scale = probs[0][4], probs[0][5]
    want = np.stack([_expected_on_cpu(c, k, v, s, k_scale, v_scale) for c, k, v, s, _, _ in probs])
    stacked = [np.stack([p[i] for p in probs]) for i in range(4)]  # cache, k, v, slots
    assert ((stacked[3] >= pages * PAGE) & (stacked[3] < 2 * pages * PAGE)).any()  # slots in a neighbour's range

    def write(cache, k, v, slots):
        return jax_msa.write_kv(cache, k, v, slots, k_scale=k_scale, v_scale=v_scale, impl="kernel")

    gpu = _gpu()
    for fn, lead in ((jax.vmap(write), (layers,)), (jax.vmap(jax.vmap(write)), (2, layers // 2))):
        args = [jax.device_put(jnp.asarray(x.reshape(*lead, *x.shape[1:])), gpu) for x in stacked]
        compiled = jax.jit(fn, donate_argnums=0).lower(*args).compile()
        assert compiled.as_text().count('custom_call_target="jax_msa_write_kv"') == 1
        pointer = args[0].unsafe_buffer_pointer()
        out = compiled(*args)
        assert args[0].is_deleted() and out.unsafe_buffer_pointer() == pointer
        got = _as_bytes(out).reshape(want.shape)
        assert (got == want).all(), _first_mismatch(got, want)


@pytest.mark.sanitize
@pytest.mark.parametrize("tokens", [300, 1], ids=lambda n: f"{n}_tokens")  # 1: tokens_per_scale = 1 (the kernel's d = 1)
@pytest.mark.parametrize("fmt", FORMATS[1:], ids=lambda f: f.name.lower())
def test_cuda_write_kv_vmapped_with_per_layer_scales(fmt, tokens):
    """jit(vmap(write_kv)) over layers that each have their own k_scale / v_scale (and vmap(vmap(...)), the scales
    per element on both axes, shared on the inner one or on the outer one): one custom call, no loop, the scales folded
    into a vector that each token indexes (jax_msa/_batching.py, bindings.h group_scales), byte for byte the jnp
    writer's layer by layer with that layer's scales."""
    layers, pages, hkv, d = 6, 4, 4, 128
    probs = [_problem(fmt, d, hkv, seed=700 + 10 * int(fmt) + i, n=tokens, pages=pages) for i in range(layers)]
    k_scales = np.float32(probs[0][4]) * np.float32([0.25, 0.5, 1.0, 2.0, 4.0, 8.0])
    v_scales = np.float32(probs[0][5]) * np.float32([3.0, 1.0, 0.5, 1.5, 0.125, 6.0])
    stacked = [np.stack([p[i] for p in probs]) for i in range(4)]  # cache, k, v, slots

    def write(cache, k, v, slots, k_scale, v_scale):
        return jax_msa.write_kv(cache, k, v, slots, k_scale=k_scale, v_scale=v_scale, impl="kernel")

    inner_shared = jax.vmap(jax.vmap(write, in_axes=(0, 0, 0, 0, None, None)))
    outer_shared = jax.vmap(jax.vmap(write), in_axes=(0, 0, 0, 0, None, None))
    # (function, leading axes, the scale arguments, each layer's scales)
    cases = ((jax.vmap(write), (layers,), (k_scales, v_scales), (k_scales, v_scales)),
             (jax.vmap(jax.vmap(write)), (2, 3), (k_scales.reshape(2, 3), v_scales.reshape(2, 3)),
              (k_scales, v_scales)),
             (inner_shared, (2, 3), (k_scales[[0, 3]], v_scales[[0, 3]]),
              (np.repeat(k_scales[[0, 3]], 3), np.repeat(v_scales[[0, 3]], 3))),
             # the inner axis' [3] vectors shared by the outer axis: the outer fold broadcasts them to [6]
             (outer_shared, (2, 3), (k_scales[:3], v_scales[:3]),
              (np.tile(k_scales[:3], 2), np.tile(v_scales[:3], 2))))
    gpu = _gpu()
    for fn, lead, scale_args, (layer_ks, layer_vs) in cases:
        want = np.stack([_expected_on_cpu(c, k, v, s, float(ks), float(vs))
                         for (c, k, v, s, _, _), ks, vs in zip(probs, layer_ks, layer_vs)])
        args = [jax.device_put(jnp.asarray(x.reshape(*lead, *x.shape[1:])), gpu) for x in stacked]
        args += [jax.device_put(jnp.asarray(x), gpu) for x in scale_args]
        lowered = jax.jit(fn).lower(*args)
        compiled = lowered.compile()
        # one call and no loop (the per-layer fallback is a while loop around one call)
        assert compiled.as_text().count('custom_call_target="jax_msa_write_kv"') == 1
        assert "stablehlo.while" not in lowered.as_text()
        got = _as_bytes(compiled(*args)).reshape(want.shape)
        assert (got == want).all(), _first_mismatch(got, want)
