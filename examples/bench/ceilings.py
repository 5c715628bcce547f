"""The card's ceilings, measured: dense GEMM TFLOP/s in bf16 and FP8 E4M3 (XLA's cuBLAS GEMMs, fp32 accumulation)
and HBM copy TB/s (an elementwise pass over a buffer far larger than L2: bytes read + written / time).

The benchmarks report fractions of the H200's measured ceilings (MSA.md section 6: 790 TFLOP/s bf16, 1,513 FP8,
4.3 TB/s). On another card (the device tool may lend an H100) run this first: its row says what those fractions
mean there, and it goes into docs/BENCHMARKS.md with the card's name.

    python examples/bench/ceilings.py                 # ~20 s on an H100 / H200
    python examples/bench/ceilings.py --size 2048 --copy-mb 64   # a small run (CPU too)
"""

import argparse

import jax
import jax.numpy as jnp

from timing import median_p10_p90

H200 = {"bf16 TFLOP/s": 790.0, "FP8 TFLOP/s": 1513.0, "HBM TB/s": 4.3}  # MSA.md section 6


def gemm_tflops(n: int, dtype, repeats: int) -> tuple[float, float, float]:
    """(median, p10, p90) TFLOP/s of an n x n x n GEMM with `dtype` operands and fp32 accumulation."""
    key_a, key_b = jax.random.split(jax.random.key(0))
    a = jax.random.normal(key_a, (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(key_b, (n, n), jnp.float32).astype(dtype)
    fn = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    med, lo, hi = median_p10_p90(fn, (a, b), repeats)
    flop = 2.0 * n**3
    return flop / med / 1e12, flop / hi / 1e12, flop / lo / 1e12


def copy_tbs(megabytes: int, repeats: int) -> tuple[float, float, float]:
    """(median, p10, p90) TB/s of x + 1 over a bf16 buffer of `megabytes` (read once, written once)."""
    x = jnp.zeros((megabytes * 2**20 // 2,), jnp.bfloat16)
    fn = jax.jit(lambda x: x + jnp.bfloat16(1))
    med, lo, hi = median_p10_p90(fn, (x,), repeats)
    moved = 2.0 * x.size * 2
    return moved / med / 1e12, moved / hi / 1e12, moved / lo / 1e12


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=8192, help="GEMM size n (n x n x n)")
    ap.add_argument("--copy-mb", type=int, default=4096, help="copy buffer size in MB")
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args()
    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({device.platform}); GEMM {a.size}^3, copy {a.copy_mb} MB, "
          f"{a.repeats} timed calls each")
    rows = [("bf16 TFLOP/s", gemm_tflops(a.size, jnp.bfloat16, a.repeats)),
            ("FP8 TFLOP/s", gemm_tflops(a.size, jnp.float8_e4m3fn, a.repeats)),
            ("HBM TB/s", copy_tbs(a.copy_mb, a.repeats))]
    print("| ceiling | median | p10-p90 | the H200's (MSA.md 6) | this card / H200 |")
    print("|---|---|---|---|---|")
    for name, (med, lo, hi) in rows:
        print(f"| {name} | {med:.1f} | {lo:.1f}-{hi:.1f} | {H200[name]:g} | {med / H200[name]:.2f} |")


if __name__ == "__main__":
    main()
