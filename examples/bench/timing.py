"""Wall-clock timing shared by the benchmark scripts: warm up (compile), then `repeats` timed calls, each
waited for with block_until_ready. Returns (median, p10, p90) in seconds."""

import statistics
import time

import jax


def median_p10_p90(fn, args, repeats):
    jax.block_until_ready(fn(*args))  # compile
    jax.block_until_ready(fn(*args))  # warm up
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - t0)
    samples.sort()
    return statistics.median(samples), samples[len(samples) // 10], samples[-1 - len(samples) // 10]
