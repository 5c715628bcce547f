"""The one module that touches ``jax.ffi``: loads the extension modules, guards the FFI ABI, registers
the handlers and builds the ``ffi_call``s of the four custom calls.

Targets (the same name for platform ``cpu`` and ``CUDA``):

====================== =================================================================================
jax_msa_prefill        q, kv_cache, q_scale, k_scale, v_scale (fp32 scalars), cu_seqlens_q, seq_lens, block_table,
                       plan arrays (6)
                       -> out bf16 [T,Hq,D], lse f32 [T,Hq], partial workspaces (2)
jax_msa_prefill_window the prefill's, with the WHOLE q [T_all,Hq,D] and one query window's batch and plan, then
                       optionally the previous window's out / lse (aliased) -> out [T_all,Hq,D], lse [T_all,Hq]
                       (the window's rows written), the window's partial workspaces (2); attr window_start
jax_msa_decode         q, kv_cache, q_scale, k_scale, v_scale (fp32 scalars, or [L] vectors: jax.vmap's fold of
                       per-layer scales, _batching), topk, seq_lens, block_table -> out, lse, split-K workspaces (2)
jax_msa_write_kv       kv_cache (aliased), k, v, slot_mapping, k_scale, v_scale (as decode's) -> kv_cache
====================== =================================================================================

The C++ side of these signatures is ``cc/ffi/bindings.h``.
"""

from __future__ import annotations

import functools
import os
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_msa import _batching

TARGET_PREFILL = "jax_msa_prefill"
TARGET_PREFILL_WINDOW = "jax_msa_prefill_window"
TARGET_DECODE = "jax_msa_decode"
TARGET_WRITE_KV = "jax_msa_write_kv"


# ---------------------------------------------------------------------------------------------------------
# ABI guard and registration
# ---------------------------------------------------------------------------------------------------------

def _running_ffi_api_version() -> tuple[int, int] | None:
    """(major, minor) of the XLA FFI C API of the running jaxlib, read from the headers it ships."""
    try:
        header = os.path.join(jax.ffi.include_dir(), "xla", "ffi", "api", "c_api.h")
        with open(header) as f:
            text = f.read()
    except OSError:
        return None
    major = re.search(r"#define\s+XLA_FFI_API_MAJOR\s+(\d+)", text)
    minor = re.search(r"#define\s+XLA_FFI_API_MINOR\s+(\d+)", text)
    if not (major and minor):
        return None
    return int(major.group(1)), int(minor.group(1))


# The version of the operand lists this module builds (cc/ffi/module_common.h kFfiSignatures; bindings.h).
FFI_SIGNATURES = 3


def _check_abi(module, name: str) -> None:
    signatures = int(getattr(module, "FFI_SIGNATURES", 1))  # modules built before the attribute: the [3] scales
    if signatures != FFI_SIGNATURES:
        raise ImportError(
            f"jax_msa: the extension {name} was built for the custom calls' operand lists version {signatures}, "
            f"but this jax_msa Python package builds version {FFI_SIGNATURES}: the extension modules are stale "
            f"(for example an in-tree build from an older checkout). Rebuild them (pip install . or "
            f".ci/build_inplace.sh).")
    built = (int(module.XLA_FFI_API_MAJOR), int(module.XLA_FFI_API_MINOR))
    running = _running_ffi_api_version()
    if running is None:
        return
    if built[0] != running[0] or built[1] > running[1]:
        import jaxlib

        raise ImportError(
            f"jax_msa: the extension {name} was built against XLA FFI API {built[0]}.{built[1]}, but the "
            f"running jaxlib {jaxlib.__version__} provides API {running[0]}.{running[1]}. Handlers built "
            f"against newer FFI headers than the running jaxlib crash the backend. Rebuild jax_msa against "
            f"this jaxlib's headers (pip install --force-reinstall --no-binary jax_msa jax_msa) or upgrade jaxlib.")


def _load():
    from jax_msa import _jax_msa_cpu  # always built

    _check_abi(_jax_msa_cpu, "_jax_msa_cpu")
    for target, capsule in _jax_msa_cpu.registrations().items():
        jax.ffi.register_ffi_target(target, capsule, platform="cpu")
    try:
        from jax_msa import _jax_msa_cuda
    except ImportError:
        return None
    _check_abi(_jax_msa_cuda, "_jax_msa_cuda")
    for target, capsule in _jax_msa_cuda.registrations().items():
        jax.ffi.register_ffi_target(target, capsule, platform="CUDA")
    return _jax_msa_cuda


_cuda_module = _load()


def cuda_available() -> bool:
    """True when the CUDA handlers were built into this installation (a GPU is not required)."""
    return _cuda_module is not None


# CUDA handlers that are built and registered but not yet verified on a GPU: dispatch uses them only when
# their environment variable is "1" (their GPU tests set it). Empty today: every registered handler has
# passed its GPU tests on the H200 (the prefill kernel left this table on 2026-12-02).
UNVERIFIED_CUDA_TARGETS: dict[str, str] = {}


def cuda_targets() -> frozenset:
    """Names of the custom calls that dispatch may send to CUDA in this build (unverified handlers only
    when enabled, see UNVERIFIED_CUDA_TARGETS)."""
    if _cuda_module is None:
        return frozenset()
    return frozenset(t for t in _cuda_module.registrations()
                     if os.environ.get(UNVERIFIED_CUDA_TARGETS.get(t, ""), "1") == "1")


def cuda_archs() -> tuple[str, ...]:
    """The CUDA architectures compiled into this build (e.g. ('90a',)), empty without CUDA."""
    if _cuda_module is None:
        return ()
    return tuple(_cuda_module.compiled_archs())


def cuda_build_options() -> dict:
    """Build switches compiled into the CUDA module, e.g. {'sm90_prefill_pingpong': False}; empty without CUDA."""
    if _cuda_module is None:
        return {}
    return dict(_cuda_module.build_options())


def kernel_path(major: int, minor: int, *, sm100_enabled: bool = False, sm90_enabled: bool = True) -> str:
    """The attention kernels the CUDA handlers select on a device of compute capability major.minor (the table of
    cc/cuda/kernel_path.h): "warp_mma" (cc/sm80, sm_80 and up), "sm90" (9.0 with a build for sm_90a, unless
    JAX_MSA_DISABLE_SM90_KERNELS=1: the wgmma prefill of cc/sm90 where it serves the call, the warp-MMA kernels for
    the rest; both pass the GPU prefill tests on the H200), "sm100" (the tcgen05 kernels of cc/sm100, unverified: on
    10.x with JAX_MSA_ENABLE_SM100_KERNELS=1 and a build for sm_100a / sm_103a) or "unsupported" (< 8.0: the handler
    raises, impl="reference" still works). Needs the CUDA module (a GPU does not)."""
    if _cuda_module is None:
        raise RuntimeError("jax_msa was built without the CUDA handlers")
    return _cuda_module.select_kernel_path(int(major), int(minor), bool(sm100_enabled), bool(sm90_enabled))


def decode_merge_launches() -> dict:
    """Split-K launches of the CUDA decode since the module loaded, by how their splits were merged:
    {"combine_kernel": n, "cluster": n, "teams": n, "teams_two_per_sm": n} (cc/sm80/decode/cluster_launch.h). On
    sm_90+ the splits of a (token, KV head) merge inside a thread-block cluster; JAX_MSA_DECODE_CLUSTER_MERGE=0 (read
    per call) or more than 16 splits take the combine kernel. FP8 and NVFP4 with 2 splits run them as the two teams of
    one CTA ("teams", cc/sm80/decode/config.h: CtaLayout) on every GPU that runs the warp-MMA decode, unless
    JAX_MSA_DECODE_CLUSTER_MERGE=0; FP8's at two CTAs an SM ("teams_two_per_sm") when the (token, KV head) pairs
    outnumber the SMs; NVFP4 with 3 splits as the three teams of one CTA (the rule's at 89-132 pairs on 132 SMs;
    counted as "teams"). Counted when a handler enqueues (a replayed command buffer is not counted)."""
    if _cuda_module is None:
        raise RuntimeError("jax_msa was built without the CUDA handlers")
    return dict(_cuda_module.decode_merge_launches())


# ---------------------------------------------------------------------------------------------------------
# Calls
# ---------------------------------------------------------------------------------------------------------

class Scales(NamedTuple):
    """The fp32 scales of a call, each a traced scalar operand of its own (None given: 1.0), so that new per-layer
    values passed as jit arguments never retrace. Not stacked into one buffer: a model's per-layer scales (its
    parameters) then reach the custom call as they are, where a stack would add an XLA kernel to every call. Under
    jax.vmap, the decode's and write_kv's fold makes per-element scales [L] vectors (_batching._fold_scales)."""
    q: jax.Array
    k: jax.Array
    v: jax.Array


def scale_operands(q_scale, k_scale, v_scale) -> Scales:
    def one(x):
        return jnp.asarray(1.0 if x is None else x, jnp.float32).reshape(())
    return Scales(one(q_scale), one(k_scale), one(v_scale))


class DecodeWorkspace(NamedTuple):
    num_splits: int  # split-K partial sets; <= 1: the handler writes the output directly, no workspace


def _prefill_args(q, kv_cache, scales, cu_seqlens_q, seq_lens, block_table, plan) -> list:
    """The argument list both prefill targets start with (bindings.h prefill_args)."""
    return [q, kv_cache, *scales, cu_seqlens_q.astype(jnp.int32), seq_lens.astype(jnp.int32),
            block_table.astype(jnp.int32), plan.row_ptr, plan.edge_query, plan.edge_rank, plan.query_edge_count,
            plan.work, plan.num_work]


def _prefill_results(out_tokens: int, t: int, hq: int, d: int, plan, partial_dtype, partials: bool = True) -> tuple:
    """The results of both prefill targets (bindings.h prefill_rets): out bf16 [out_tokens, Hq, D], lse f32
    [out_tokens, Hq], and the partial workspaces of the plan's t tokens, one normalized (O, lse) per (query, head
    group, selected block)."""
    hkv, k = plan.num_kv_heads, plan.topk
    g = hq // hkv
    po = jax.ShapeDtypeStruct((t, hkv, k, g, d) if partials else (0,), partial_dtype)
    pl = jax.ShapeDtypeStruct((t, hkv, k, g) if partials else (0,), jnp.float32)
    return (jax.ShapeDtypeStruct((out_tokens, hq, d), jnp.bfloat16),
            jax.ShapeDtypeStruct((out_tokens, hq), jnp.float32), po, pl)


def prefill_call(q, kv_cache, scales, cu_seqlens_q, seq_lens, block_table, plan, *, softmax_scale: float,
                 kv_format: int, partials: bool = True, partial_dtype=jnp.float32):
    """The prefill custom call for the backend being lowered. Returns (out, lse). The normalized partial outputs
    are float32 for the CPU handler and bfloat16 for the CUDA one (half the partial traffic, which bounds the
    GPU prefill; their rounding moves the error by about 1%, measured against the float64 oracle)."""
    t, hq, d = q.shape
    call = jax.ffi.ffi_call(TARGET_PREFILL, _prefill_results(t, t, hq, d, plan, partial_dtype, partials),
                            vmap_method="sequential")
    out, lse, _, _ = call(*_prefill_args(q, kv_cache, scales, cu_seqlens_q, seq_lens, block_table, plan),
                          softmax_scale=np.float32(softmax_scale), kv_format=np.int32(kv_format))
    return out, lse


def prefill_window_call(q, kv_cache, scales, cu_seqlens_q, seq_lens, block_table, plan, out=None, lse=None, *,
                        window_start: int, softmax_scale: float, kv_format: int, partial_dtype=jnp.float32):
    """One query window of the prefill (``sparse_attention(query_chunk_size=...)``), in place: q is the WHOLE
    [T_all, Hq, D]; cu_seqlens_q / seq_lens / plan are the window's (plan.total_q tokens from window_start). Returns
    (out [T_all, Hq, D], lse [T_all, Hq]) with the window's rows written; out / lse (the previous window's results)
    are reused in place (aliased), and without them the other rows are left as XLA allocated them (every row belongs
    to some window). No copy of the window's q in or of its out back, which a custom call on a slice costs."""
    t_all, hq, d = q.shape
    t = plan.total_q
    if not 0 <= window_start <= t_all - t:
        raise ValueError(f"jax_msa prefill window: window_start={window_start} with a plan of {t} tokens does not "
                         f"fit q's {t_all} tokens")
    if (out is None) != (lse is None):
        raise ValueError("jax_msa prefill window: pass both out and lse of the previous window, or neither")
    args = _prefill_args(q, kv_cache, scales, cu_seqlens_q, seq_lens, block_table, plan)
    aliases = None
    if out is not None:
        aliases = {len(args): 0, len(args) + 1: 1}
        args += [out, lse]
    call = jax.ffi.ffi_call(TARGET_PREFILL_WINDOW, _prefill_results(t_all, t, hq, d, plan, partial_dtype),
                            vmap_method="sequential", input_output_aliases=aliases)
    out, lse, _, _ = call(*args, softmax_scale=np.float32(softmax_scale), kv_format=np.int32(kv_format),
                          window_start=np.int32(window_start))
    return out, lse


def decode_call(q, kv_cache, scales, topk, seq_lens, block_table, *, softmax_scale: float, kv_format: int,
                decode_query_len: int, workspace: DecodeWorkspace, return_workspace: bool = False):
    """The decode custom call. Returns (out, lse), and with return_workspace the split workspaces too (partial_o
    [S, T, Hq, D] f32, partial_lse [S, T, Hq] f32; empty when S <= 1): where a build with the decode timeline
    (cuda_build_options()['decode_timeline']) leaves its per-CTA timestamps (examples/bench/decode_timeline.py)."""
    s = workspace.num_splits

    def one_call(q, kv_cache, scales, topk, seq_lens, block_table):
        t, hq, d = q.shape
        po = jax.ShapeDtypeStruct((s, t, hq, d) if s > 1 else (0,), jnp.float32)
        pl = jax.ShapeDtypeStruct((s, t, hq) if s > 1 else (0,), jnp.float32)
        call = jax.ffi.ffi_call(
            TARGET_DECODE,
            (jax.ShapeDtypeStruct((t, hq, d), jnp.bfloat16), jax.ShapeDtypeStruct((t, hq), jnp.float32), po, pl),
            vmap_method="sequential")
        out, lse, partial_o, partial_lse = call(q, kv_cache, *scales, topk, seq_lens, block_table,
                                                softmax_scale=np.float32(softmax_scale), kv_format=np.int32(kv_format),
                                                decode_query_len=np.int32(decode_query_len))
        return (out, lse, partial_o, partial_lse) if return_workspace else (out, lse)

    args = (q, kv_cache, scales, topk.astype(jnp.int32), seq_lens.astype(jnp.int32), block_table.astype(jnp.int32))
    if return_workspace:  # a diagnostic: the call as it is, no vmap rule for the workspaces
        return one_call(*args)
    # jax.vmap folds a vmapped axis into the decode batch (one call) instead of looping; see _batching.
    return _batching.fold_decode_batch(one_call, decode_query_len)(*args)


def write_kv_call(kv_cache, k, v, slot_mapping, scales, *, kv_format: int):
    """The write_kv custom call; the cache is input 0 aliased to output 0 (in place under donation)."""
    def one_call(kv_cache, k, v, slot_mapping, scales):
        call = jax.ffi.ffi_call(
            TARGET_WRITE_KV, jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype),
            input_output_aliases={0: 0}, vmap_method="sequential")
        return call(kv_cache, k, v, slot_mapping, scales.k, scales.v, kv_format=np.int32(kv_format))

    # jax.vmap folds a vmapped axis into the cache's page axis (one call) instead of looping; see _batching.
    return _batching.fold_write_kv_batch(one_call)(
        kv_cache, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), slot_mapping.astype(jnp.int32), scales)


@functools.cache
def warn_once(message: str) -> None:
    import warnings

    warnings.warn(message, RuntimeWarning, stacklevel=4)
