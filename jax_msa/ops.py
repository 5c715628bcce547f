"""The public ops: sparse_attention (prefill), sparse_decode and write_kv.

Each op validates its arguments at trace time, then lowers per platform through
``jax.lax.platform_dependent``: the custom call where a handler exists for that platform and shape (the
C++ handler on CPU, the CUDA kernels on GPU), the jnp reference elsewhere. ``impl="reference"`` always
takes the reference; ``impl="kernel"`` raises when the default backend has no kernel for the call.
The ops are forward-only: differentiating them raises a clear error.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp

from jax_msa import _ffi, _query_chunks, _validation, reference
from jax_msa import kv_cache as kvc
from jax_msa.plan import PrefillPlan, build_prefill_plan, clamp_plan_entries, default_queries_per_tile

_IMPLS = ("auto", "kernel", "reference")


# ---------------------------------------------------------------------------------------------------------
# Which platform has a kernel for which call (static facts of the build and the shapes)
# ---------------------------------------------------------------------------------------------------------

def _cuda_decode_supported(cfg, q_len: int) -> bool:
    # cc/sm80/decode: D = 128, the GQA group zero-padded into 16 MMA rows, a top-k row compacted by one warp.
    return (_ffi.TARGET_DECODE in _ffi.cuda_targets() and cfg.head_dim == 128 and 16 % cfg.group_size == 0
            and 1 <= cfg.topk <= 32 and cfg.batch * q_len <= 65535)


def _cuda_prefill_supported(cfg, plan) -> bool:
    # cc/sm80/prefill: D = 128, a plan tile of at most 128 MMA rows (queries_per_tile * G <= 128).
    return (_ffi.TARGET_PREFILL in _ffi.cuda_targets() and cfg.head_dim == 128 and cfg.group_size <= 128
            and plan.queries_per_tile * cfg.group_size <= 128)


def _cuda_write_kv_supported(head_dim: int) -> bool:
    return _ffi.TARGET_WRITE_KV in _ffi.cuda_targets() and head_dim % 16 == 0 and head_dim <= 256


def _default_platform() -> str:
    backend = jax.default_backend()
    if backend == "gpu":
        version = getattr(jax.devices()[0].client, "platform_version", "").lower()
        return "rocm" if "rocm" in version else "cuda"
    return backend


def _dispatch(name: str, impl: str, kernels: dict, reference_fn, *args):
    """kernels: platform -> callable(*args) for the platforms that have a kernel for this call. The
    kernel path is forward-only; impl="reference" is plain jnp (and differentiable)."""
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}; got {impl!r}")
    if impl == "reference":
        return reference_fn(*args)
    here = _default_platform()
    if here not in kernels:
        if impl == "kernel":
            raise NotImplementedError(
                f"jax_msa.{name}: no kernel for platform '{here}' and these shapes/formats "
                f"(kernels here: {sorted(kernels) or 'none'}); use impl='auto' or impl='reference'")
        _ffi.warn_once(f"jax_msa.{name}: no kernel for platform '{here}' with these shapes/formats; "
                       f"using the jnp reference (slow).")
    return _forward_only(name, lambda *a: jax.lax.platform_dependent(*a, default=reference_fn, **kernels))(*args)


_SHARDED_WRAPPERS = {"sparse_attention": "sharded_sparse_attention", "sparse_decode": "sharded_sparse_decode",
                     "write_kv": "sharded_write_kv"}


@contextlib.contextmanager
def _explained_sharding_errors(name: str):
    """Around a public op (a decorator): inputs sharded over Explicit mesh axes (jax.make_mesh's default), under jit,
    reach jnp code that JAX then refuses with a sharding type error deep inside jnp indexing: the jnp reference,
    traced next to the kernels (lax.platform_dependent traces every branch), and the prefill plan. Say what to do
    instead."""
    try:
        yield
    except Exception as err:
        if type(err).__name__ != "ShardingTypeError":
            raise
        wrapper = _SHARDED_WRAPPERS[name]
        said = (str(err).splitlines() or [""])[0]
        raise TypeError(
            f"jax_msa.{name}: an input is sharded over an Explicit mesh axis, which the op's jnp code (its reference, "
            f"traced alongside the kernels, or the prefill plan) cannot index. Call it through "
            f"jax_msa.sharding.{wrapper}(mesh, ...), which runs it per shard, or use a mesh with Auto axes. JAX "
            f"said: {said}") from err


def _forward_only(name: str, fn):
    """fn(*arrays) with a JVP rule that explains the ops are forward-only."""
    wrapped = jax.custom_jvp(fn)

    def jvp(primals, tangents):
        raise TypeError(f"jax_msa.{name} is a forward-only primitive (inference kernels): it has no "
                        f"gradient. Differentiate jax_msa.reference.{name} instead if you need one.")

    wrapped.defjvp(jvp)
    return wrapped


# ---------------------------------------------------------------------------------------------------------
# Public ops
# ---------------------------------------------------------------------------------------------------------

@_explained_sharding_errors("sparse_attention")
def sparse_attention(q, kv_cache, topk, *, cu_seqlens_q, seq_lens, block_table, scale=None, return_lse=False,
                     plan: PrefillPlan | None = None, impl="auto", k_scale=None, v_scale=None, q_scale=None,
                     query_chunk_size: int | None = None):
    """MSA prefill / chunked prefill over a varlen batch (MSA.md section 2).

    q [total_q, Hq, D] bf16 (or float8_e4m3fn with q_scale); kv_cache in any of the three formats;
    topk [Hkv, total_q, K] int32 request-local block ids (-1 = hole); cu_seqlens_q [B+1]; seq_lens [B]
    (total KV length, new tokens included); block_table [B, max_blocks]. Returns bf16 out [total_q, Hq, D]
    and, with return_lse, fp32 lse [total_q, Hq].

    query_chunk_size (static int): when total_q exceeds it, the tokens run in windows of at most that many, one
    after the other, each with its own plan and workspace (the partial workspace then scales with the window, not
    with total_q); the kernels' results are bit-identical to one call's (the jnp reference's up to rounding). Not
    with ``plan=`` (a plan covers the whole batch).
    """
    cfg = _validation.check_attention(q, kv_cache, topk, cu_seqlens_q, seq_lens, block_table,
                                      q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)
    softmax_scale = _validation.static_softmax_scale(scale, cfg.head_dim)
    chunk_size = _query_chunks.check_chunk_size(query_chunk_size)
    if chunk_size is not None and plan is not None:
        raise ValueError("jax_msa.sparse_attention: plan= and query_chunk_size cannot be combined: a plan covers "
                         "the whole batch, and the windows build their own; pass one or the other")
    scales = _ffi.scale_operands(q_scale, k_scale, v_scale)
    if chunk_size is not None and q.shape[0] > chunk_size:
        if _query_chunks.in_place(q.shape[0], chunk_size):
            out, lse = _windowed_attention(cfg, impl, softmax_scale, chunk_size, q, kv_cache, topk, cu_seqlens_q,
                                           seq_lens, block_table, scales)
        else:  # many windows: one compiled body in a scan, each window a whole call on its slice of q
            def attend(window_q, window_topk, window_cu, window_seq):
                return sparse_attention(window_q, kv_cache, window_topk, cu_seqlens_q=window_cu,
                                        seq_lens=window_seq, block_table=block_table, scale=softmax_scale,
                                        return_lse=True, impl=impl, k_scale=k_scale, v_scale=v_scale,
                                        q_scale=q_scale)

            out, lse = _query_chunks.run_in_windows(attend, q, topk, cu_seqlens_q, seq_lens, chunk_size)
        return (out, lse) if return_lse else out

    def ref(q, kv_cache, topk, cu, sl, bt, scales, plan):
        return reference.sparse_attention(q, kv_cache, topk, cu_seqlens_q=cu, seq_lens=sl, block_table=bt,
                                          scale=softmax_scale, return_lse=True, q_scale=scales.q,
                                          k_scale=scales.k, v_scale=scales.v)

    if impl == "reference":
        out, lse = ref(q, kv_cache, topk, cu_seqlens_q, seq_lens, block_table, scales, None)
        return (out, lse) if return_lse else out

    if plan is None:
        plan = build_prefill_plan(topk, cu_seqlens_q, seq_lens, max_blocks=cfg.max_blocks,
                                  queries_per_tile=default_queries_per_tile(cfg.num_q_heads, cfg.num_kv_heads))
    else:  # a plan from elsewhere: its entries are clamped into range, so that no kernel indexes out of bounds
        _validation.check_plan(plan, cfg)
        plan = clamp_plan_entries(plan)

    def kernel(q, kv_cache, topk, cu, sl, bt, scales, plan, *, partial_dtype):
        return _ffi.prefill_call(q, kv_cache, scales, cu, sl, bt, plan, softmax_scale=softmax_scale,
                                 kv_format=int(cfg.kv_format), partial_dtype=partial_dtype)

    kernels = {"cpu": functools.partial(kernel, partial_dtype=jnp.float32)}
    if _cuda_prefill_supported(cfg, plan):
        kernels["cuda"] = functools.partial(kernel, partial_dtype=jnp.bfloat16)
    out, lse = _dispatch("sparse_attention", impl, kernels, ref, q, kv_cache, topk, cu_seqlens_q, seq_lens,
                         block_table, scales, plan)
    return (out, lse) if return_lse else out


def _windowed_attention(cfg, impl, softmax_scale, chunk_size, q, kv_cache, topk, cu_seqlens_q, seq_lens, block_table,
                        scales):
    """sparse_attention in query windows of at most chunk_size tokens (jax_msa/_query_chunks.py): the kernels run
    each window in place on the whole q / out (one custom call a window, static starts, the windows' plans built in
    one lax.map); the reference runs the windows in a lax.scan."""
    def ref(q, kv_cache, topk, cu, sl, bt, scales, stacked_plans):
        def attend(window_q, window_topk, window_cu, window_seq):
            return reference.sparse_attention(window_q, kv_cache, window_topk, cu_seqlens_q=window_cu,
                                              seq_lens=window_seq, block_table=bt, scale=softmax_scale,
                                              return_lse=True, q_scale=scales.q, k_scale=scales.k,
                                              v_scale=scales.v)
        return _query_chunks.run_in_windows(attend, q, topk, cu, sl, chunk_size)

    if impl == "reference":
        return ref(q, kv_cache, topk, cu_seqlens_q, seq_lens, block_table, scales, None)

    qpt = default_queries_per_tile(cfg.num_q_heads, cfg.num_kv_heads)
    stacked = _query_chunks.window_plans(
        lambda t, c, s: build_prefill_plan(t, c, s, max_blocks=cfg.max_blocks, queries_per_tile=qpt),
        topk, cu_seqlens_q, seq_lens, chunk_size)

    def kernel(q, kv_cache, topk, cu, sl, bt, scales, stacked_plans, *, partial_dtype):
        def call(start, window_cu, window_seq, plan, out, lse):
            return _ffi.prefill_window_call(q, kv_cache, scales, window_cu, window_seq, bt, plan, out, lse,
                                            window_start=start, softmax_scale=softmax_scale,
                                            kv_format=int(cfg.kv_format), partial_dtype=partial_dtype)
        return _query_chunks.run_window_calls(call, q.shape[0], stacked_plans, chunk_size)

    kernels = {"cpu": functools.partial(kernel, partial_dtype=jnp.float32)}
    if _ffi.TARGET_PREFILL_WINDOW in _ffi.cuda_targets() and _cuda_prefill_supported(cfg, stacked[2]):
        kernels["cuda"] = functools.partial(kernel, partial_dtype=jnp.bfloat16)
    return _dispatch("sparse_attention", impl, kernels, ref, q, kv_cache, topk, cu_seqlens_q, seq_lens, block_table,
                     scales, stacked)


H200_SMS = 132
# CTAs an SM the split rule fills, per cache format: bf16 one, FP8 / NVFP4 two (their kernels fit 2, 4 and 3 an SM:
# FormatTraits::kCtasPerSm, cc/sm80/decode/config.h). Measured on the H200 (docs/BENCHMARKS.md, "Split rule per
# format"): bf16 was fastest at one CTA an SM in each case swept with 32-128 (token, KV head) pairs (16/1 B = 32:
# 4 splits 15.9 us, 8 splits 21.9); FP8 and NVFP4 at two with 32 and 128 pairs (64/4 B = 32: 2 splits 25.3 / 28.6 us,
# 1 split 26.8 / 31.5), one at 64 pairs by 5-7% in a single call (see below for 64 pairs on an H100). More CTAs than
# the SM's kernel fits were slower (decode v6-v8).
DECODE_CTAS_PER_SM = {kvc.KVFormat.BF16: 1, kvc.KVFormat.FP8: 2, kvc.KVFormat.NVFP4: 2}
# Factors the rule above lands on that ran slowly as thread-block clusters, and what each format takes instead.
# Measured on an H100 (132 SMs; docs/BENCHMARKS.md, "The split rule without slow cluster sizes"), 64/4 32k:
# at FP8's 3-CTA clusters (pairs 67-88) its two-team CTA (2 splits) took 9-16% off (4 splits no faster than 2); at
# NVFP4's clusters of 3 (at 80-88 pairs; at 68-72 3 and 4 tie), 5, 6 and 7 the power of two beside them took 6-19%
# off (3 -> 4, 5 -> 4, 6 and 7 -> 8). Re-timed on the H200 (thirty-fifth session): FP8 at 88 pairs -16%, NVFP4 at 52
# and 88 pairs -16% / -21%.
# Every replacement stays within the format's CTAs an SM (NVFP4's kernel fits 3; FP8's team CTA is one per pair).
# Left as they were: FP8's 5 and 6 (within 2.5% of their neighbours) and bf16's 3 to 5 (within 4%), FP8's 4 at
# 53-66 pairs (2 splits 2% slower at 60 pairs, 5-7% faster at 64: no clear edge).
# NVFP4's 2 at 89-132 pairs (4 splits 27% slower at 96) -> 3: the three-team CTA (one a pair, 12 warps an SM where the
# two-team CTA gives 8: cc/sm80/decode/config.h, CtaLayout::kThreeTeams). Measured on an H100 (thirty-sixth session, two
# alternated rounds, 32k): 64/4 B = 24 23.6 / 23.8 -> 23.1 / 23.2 us, B = 32 24.4 / 24.0 -> 23.4 / 23.3, 16/1 B = 128
# 24.0 / 24.5 -> 23.4 / 23.4 (-2.3 to -3.5% on the means, -2 to -4.5% per round); at 68 and 88 pairs 3 teams lost to the
# 4-CTA clusters (23.0 against 21.6 / 21.8, 23.2 against 22.7 / 22.5), so 3 -> 4 stays there.
DECODE_SPLITS_INSTEAD = {kvc.KVFormat.BF16: {}, kvc.KVFormat.FP8: {3: 2},
                         kvc.KVFormat.NVFP4: {2: 3, 3: 4, 5: 4, 6: 8, 7: 8}}
# Where the rule above gives 1 split, 2 (the two-team CTA, at two CTAs an SM once the pairs outnumber the SMs:
# cc/sm80/decode/config.h, CtaLayout::kTeamsTwoPerSm) while the (token, KV head) pairs are at most this many an SM.
# FP8, measured on the H200 (docs/BENCHMARKS.md, "FP8's two-team CTA at two an SM"), 64/4 32k, 2 splits against 1:
# 160 pairs 29.9 / 30.0 us against 32.0 (-6%), 192 pairs 31.2 / 30.7 against 32.2 / 32.4 (-4%), 256 pairs 37.0 /
# 36.8 against 36.7 (a tie), 1024 pairs 140.6 / 140.2 against 132.9 / 133.2 (+5.5%). On an H100 (thirty-seventh
# session, two rounds; 160 pairs: one round of the rule), 2 splits against 1: 136 pairs 32.4 / 32.3 us against 33.0 /
# 33.2 (-2.3%), 160 and 192 pairs within 0.3%.
DECODE_TWO_TEAM_PAIRS_PER_SM = {kvc.KVFormat.FP8: 1.5}
# The GPUs whose SMs hold two such CTAs (228 KB or 164 KB of shared memory an SM; not the 100 KB of sm_86 / sm_89 /
# sm_120, where the launcher keeps one an SM and the second wave would cost what the band gains)
DECODE_TWO_TEAM_CTAS_FIT = ((8, 0), (8, 7), (9, 0), (10, 0), (10, 3))


def _first_cuda_device_attribute(name: str):
    """Attribute `name` of the first CUDA device this process sees; None without one (lowering for CUDA on a CPU-only
    machine, say) or without the attribute."""
    try:
        devices = jax.devices("cuda")
    except Exception:  # noqa: BLE001 (no CUDA backend in this process: jax raises RuntimeError or ValueError)
        return None
    return getattr(devices[0], name, None) if devices else None


@functools.cache
def cuda_sm_count() -> int:
    """SMs of the first CUDA device this process sees (what the decode's split rule fills); without one the H200's
    132."""
    count = _first_cuda_device_attribute("core_count")
    return count if isinstance(count, int) and count > 0 else H200_SMS


@functools.cache
def cuda_compute_capability() -> tuple[int, int]:
    """(major, minor) of the first CUDA device this process sees; without one, the H200's (9, 0)."""
    text = _first_cuda_device_attribute("compute_capability")
    try:
        major, minor = (int(x) for x in str(text).split("."))
    except ValueError:  # no CUDA device (None), or an unexpected form
        return (9, 0)
    return (major, minor)


def decode_num_splits(cfg, q_len: int, num_sms: int | None = None,
                      compute_capability: tuple[int, int] | None = None) -> int:
    """Split-K factor of the CUDA decode kernel: when the (token, KV head) pairs alone give fewer than
    DECODE_CTAS_PER_SM[format] CTAs an SM, the largest factor whose CTAs stay within that, or the format's faster
    replacement of it (DECODE_SPLITS_INSTEAD: a neighbouring cluster size, or a team CTA's split count); FP8 up to
    DECODE_TWO_TEAM_PAIRS_PER_SM pairs an SM: 2 rather than 1; never more splits than top-k slots (cfg.topk).
    num_sms: the GPU's SMs (default cuda_sm_count(); the rule was tuned on 132-SM cards, the H200 and the H100);
    compute_capability: the GPU's (default cuda_compute_capability()), for the two-an-SM band."""
    sms = cuda_sm_count() if num_sms is None else num_sms
    pairs = cfg.batch * q_len * cfg.num_kv_heads
    splits = max(1, min(cfg.topk, (sms * DECODE_CTAS_PER_SM[cfg.kv_format]) // max(pairs, 1)))
    cc = cuda_compute_capability() if compute_capability is None else tuple(compute_capability)
    band = DECODE_TWO_TEAM_PAIRS_PER_SM.get(cfg.kv_format, 0) * sms if cc in DECODE_TWO_TEAM_CTAS_FIT else 0
    if splits == 1 and pairs <= band:
        splits = 2
    return min(cfg.topk, DECODE_SPLITS_INSTEAD[cfg.kv_format].get(splits, splits))


@_explained_sharding_errors("sparse_decode")
def sparse_decode(q, kv_cache, topk, *, seq_lens, block_table, decode_query_len=1, scale=None, return_lse=False,
                  impl="auto", k_scale=None, v_scale=None, q_scale=None, num_splits: int | None = None):
    """MSA decode (speculative tokens: decode_query_len > 1). q [B * decode_query_len, Hq, D];
    topk [Hkv, B * decode_query_len, K]. Token i of request b sits at seq_len_b - decode_query_len + i.

    num_splits (static int in [1, 32], at most K used): the CUDA kernel's split-K factor. By default
    (None) decode_num_splits' rule picks the fastest for the call, from the batch size, the top-k and the GPU's SM
    count, so one request's output bits can differ between batch sizes (and between a sharded and an unsharded
    step; vmap's fold keeps the unbatched call's factor). A fixed num_splits makes each token's result independent of
    the rest of the batch (batch invariance), at the rule's speed only where it agrees. The CPU handler and the jnp
    reference ignore it (they do not split).
    """
    cfg = _validation.check_decode(q, kv_cache, topk, seq_lens, block_table, decode_query_len,
                                   q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)
    fixed_splits = _validation.check_num_splits(num_splits)
    decode_query_len = int(decode_query_len)  # a numpy integer is taken too
    softmax_scale = _validation.static_softmax_scale(scale, cfg.head_dim)
    scales = _ffi.scale_operands(q_scale, k_scale, v_scale)

    def ref(q, kv_cache, topk, sl, bt, scales):
        return reference.sparse_decode(q, kv_cache, topk, seq_lens=sl, block_table=bt,
                                       decode_query_len=decode_query_len, scale=softmax_scale, return_lse=True,
                                       q_scale=scales.q, k_scale=scales.k, v_scale=scales.v)

    def make_kernel(splits):
        def kernel(q, kv_cache, topk, sl, bt, scales):
            return _ffi.decode_call(q, kv_cache, scales, topk, sl, bt, softmax_scale=softmax_scale,
                                    kv_format=int(cfg.kv_format), decode_query_len=decode_query_len,
                                    workspace=_ffi.DecodeWorkspace(splits))
        return kernel

    kernels = {"cpu": make_kernel(0)}
    if _cuda_decode_supported(cfg, decode_query_len):
        splits = decode_num_splits(cfg, decode_query_len) if fixed_splits is None else min(fixed_splits, cfg.topk)
        kernels["cuda"] = make_kernel(splits)
    out, lse = _dispatch("sparse_decode", impl, kernels, ref, q, kv_cache, topk, seq_lens, block_table, scales)
    return (out, lse) if return_lse else out


@_explained_sharding_errors("write_kv")
def write_kv(kv_cache, k, v, slot_mapping, *, k_scale=None, v_scale=None, impl="auto"):
    """Writes new tokens k, v [N, Hkv, D] into the cache at slot_mapping [N] (slot = page * 128 + offset;
    a negative slot, or one beyond the cache, is skipped), quantizing for FP8 / NVFP4 caches. Returns the
    updated cache; under jit with the cache donated the update is in place."""
    fmt = _validation.check_write_kv(kv_cache, k, v, slot_mapping, k_scale, v_scale)
    scales = _ffi.scale_operands(None, k_scale, v_scale)

    def ref(cache, k, v, slots, scales):
        return kvc.write_kv_reference(cache, k, v, slots, k_scale=scales.k, v_scale=scales.v)

    def kernel(cache, k, v, slots, scales):
        return _ffi.write_kv_call(cache, k, v, slots, scales, kv_format=int(fmt))

    kernels = {"cpu": kernel}
    if _cuda_write_kv_supported(k.shape[-1]):
        kernels["cuda"] = kernel
    return _dispatch("write_kv", impl, kernels, ref, kv_cache, k, v, slot_mapping, scales)
