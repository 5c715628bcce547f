"""Trace-time checks of the public ops' arguments. Every message names the argument and what was expected."""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from jax_msa import kv_cache as kvc

SUPPORTED_TOPK_HINT = "K in {4, 8, 16, 32} is what the kernels are tuned for; any K >= 1 is accepted"


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Static facts of one call, used for validation messages and kernel dispatch."""
    total_q: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    topk: int
    batch: int
    max_blocks: int
    num_pages: int
    kv_format: kvc.KVFormat
    q_is_fp8: bool

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads


def _shape(x, name):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array; got {type(x).__name__}")
    return tuple(x.shape)


def _int32(x, name, rank, what):
    s = _shape(x, name)
    if len(s) != rank:
        raise ValueError(f"{name} must be {what} (rank {rank}); got shape {s}")
    if jnp.dtype(x.dtype) != jnp.int32:
        raise TypeError(f"{name} must be int32 {what}; got dtype {x.dtype}")
    return s


def _scalar(x, name):
    if x is None:
        return
    if hasattr(x, "shape") and tuple(x.shape) not in ((), (1,)):
        raise ValueError(f"{name} must be a scalar (fp32); got shape {tuple(x.shape)}")


def static_softmax_scale(scale, head_dim: int) -> float:
    """The softmax scale as the Python float the kernels are compiled with (default head_dim^-0.5)."""
    if scale is None:
        return head_dim**-0.5
    shape = tuple(getattr(scale, "shape", ()))
    if shape not in ((), (1,)):
        raise ValueError(f"scale must be a scalar (a static Python number); got shape {shape}")
    try:
        return float(np.asarray(scale).reshape(()) if shape == (1,) else scale)
    except (TypeError, jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        raise TypeError(
            "scale must be a static Python number: it is compiled into the kernels (an ffi attribute); got "
            f"{type(scale).__name__}. Pass a float, or fold a traced factor into q (jax_msa.reference accepts "
            "a traced scale).") from None


def check_query_cache_topk(q, kv_cache, topk, *, q_scale=None, k_scale=None, v_scale=None) -> dict:
    qs = _shape(q, "q")
    if len(qs) != 3:
        raise ValueError(f"q must be [total_q, Hq, D]; got shape {qs}")
    qdt = jnp.dtype(q.dtype)
    if qdt not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float8_e4m3fn)):
        raise TypeError(f"q must be bfloat16 (or float8_e4m3fn with q_scale); got dtype {q.dtype}")
    total_q, hq, d = qs
    if hq < 1:
        raise ValueError(f"q must have at least one head; got shape {qs}")
    if d < 1:
        raise ValueError(f"q head_dim must be >= 1; got shape {qs}")
    fmt, hkv = kvc.detect_format(kv_cache, d, name="kv_cache")
    ts = _int32(topk, "topk", 3, "[Hkv, total_q, K]")
    if ts[0] != hkv or ts[1] != total_q:
        raise ValueError(f"topk must be [Hkv, total_q, K] = [{hkv}, {total_q}, K]; got shape {ts}")
    if ts[2] < 1:
        raise ValueError(f"topk must select at least one block (K >= 1); got shape {ts}")
    if hq % hkv:
        raise ValueError(f"Hq must be a multiple of Hkv: q has {hq} heads, kv_cache has {hkv} KV heads")
    for x, n in ((q_scale, "q_scale"), (k_scale, "k_scale"), (v_scale, "v_scale")):
        _scalar(x, n)
    if q_scale is not None and qdt != jnp.dtype(jnp.float8_e4m3fn):
        raise ValueError("q_scale is only meaningful for a float8_e4m3fn q")
    if fmt == kvc.KVFormat.BF16 and (k_scale is not None or v_scale is not None):
        raise ValueError("k_scale / v_scale apply to FP8 and NVFP4 caches; this kv_cache is bfloat16")
    return dict(total_q=total_q, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, topk=ts[2],
                num_pages=kv_cache.shape[0], kv_format=fmt, q_is_fp8=qdt == jnp.dtype(jnp.float8_e4m3fn))


def check_paging(seq_lens, block_table, batch_hint=None):
    ss = _int32(seq_lens, "seq_lens", 1, "[B]")
    bs = _int32(block_table, "block_table", 2, "[B, max_blocks]")
    if bs[0] != ss[0]:
        raise ValueError(f"block_table must be [B, max_blocks] with B = {ss[0]} (from seq_lens); got shape {bs}")
    if bs[1] < 1:
        raise ValueError(f"block_table needs at least one column; got shape {bs}")
    return ss[0], bs[1]


def check_attention(q, kv_cache, topk, cu_seqlens_q, seq_lens, block_table, **scales) -> AttentionConfig:
    base = check_query_cache_topk(q, kv_cache, topk, **scales)
    batch, max_blocks = check_paging(seq_lens, block_table)
    cs = _int32(cu_seqlens_q, "cu_seqlens_q", 1, "[B+1]")
    if cs[0] != batch + 1:
        raise ValueError(f"cu_seqlens_q must be [B+1] = [{batch + 1}] (B = {batch} from seq_lens); got shape {cs}")
    return AttentionConfig(batch=batch, max_blocks=max_blocks, **base)


def check_decode(q, kv_cache, topk, seq_lens, block_table, decode_query_len, **scales) -> AttentionConfig:
    if (isinstance(decode_query_len, bool) or not isinstance(decode_query_len, numbers.Integral)
            or decode_query_len < 1):
        raise ValueError(f"decode_query_len must be a static int >= 1; got {decode_query_len!r}")
    base = check_query_cache_topk(q, kv_cache, topk, **scales)
    batch, max_blocks = check_paging(seq_lens, block_table)
    if base["total_q"] != batch * decode_query_len:
        raise ValueError(
            f"q must be [B * decode_query_len, Hq, D] = [{batch * decode_query_len}, ...] "
            f"(B = {batch}, decode_query_len = {decode_query_len}); got shape {tuple(q.shape)}")
    return AttentionConfig(batch=batch, max_blocks=max_blocks, **base)


MAX_DECODE_SPLITS = 32  # the CUDA decode merges at most 32 split-K partials a row (cc/sm80/decode)


def check_num_splits(num_splits) -> int | None:
    """sparse_decode's num_splits: None (the split rule) or a static int in [1, MAX_DECODE_SPLITS]."""
    if num_splits is None:
        return None
    what = f"num_splits must be None (the split rule) or a static int in [1, {MAX_DECODE_SPLITS}]; got {num_splits!r}"
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
        raise TypeError(what)
    if not 1 <= num_splits <= MAX_DECODE_SPLITS:
        raise ValueError(what)
    return int(num_splits)


def check_plan(plan, cfg: AttentionConfig) -> None:
    from jax_msa.plan import PrefillPlan

    if not isinstance(plan, PrefillPlan):
        raise TypeError(f"plan must be a jax_msa.PrefillPlan; got {type(plan).__name__}")
    rows = cfg.batch * cfg.max_blocks
    want = {
        "row_ptr": (cfg.num_kv_heads, rows + 1),
        "edge_query": (cfg.num_kv_heads, cfg.total_q * cfg.topk),
        "edge_rank": (cfg.num_kv_heads, cfg.total_q * cfg.topk),
        "query_edge_count": (cfg.num_kv_heads, cfg.total_q),
        "num_work": (1,),
    }
    for field, shape in want.items():
        got = tuple(getattr(plan, field).shape)
        if got != shape:
            raise ValueError(f"plan.{field} must be {list(shape)} for these inputs; got {list(got)} "
                             f"(was the plan built for other shapes?)")
    work = tuple(plan.work.shape)
    if len(work) != 2 or work[1] != 4:
        raise ValueError(f"plan.work must be [W, 4] (head, row, edge_begin, edge_count); got {list(work)}")
    for field in (*want, "work"):
        dtype = getattr(plan, field).dtype
        if dtype != jnp.int32:
            raise TypeError(f"plan.{field} must be int32; got {dtype}")
    if plan.max_blocks != cfg.max_blocks:
        raise ValueError(f"plan was built with max_blocks={plan.max_blocks}; block_table has {cfg.max_blocks}")


def check_write_kv(kv_cache, k, v, slot_mapping, k_scale=None, v_scale=None):
    ks = _shape(k, "k")
    if len(ks) != 3:
        raise ValueError(f"k must be [N, Hkv, D]; got shape {ks}")
    if ks[2] < 1:
        raise ValueError(f"k head_dim must be >= 1; got shape {ks}")
    if _shape(v, "v") != ks:
        raise ValueError(f"v must have k's shape {ks}; got {tuple(v.shape)}")
    for x, n in ((k, "k"), (v, "v")):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{n} must be a floating array (bf16 preferred); got {x.dtype}")
    fmt, hkv = kvc.detect_format(kv_cache, ks[2], name="kv_cache")
    if hkv != ks[1]:
        raise ValueError(f"k has {ks[1]} KV heads but kv_cache holds {hkv}")
    ss = _int32(slot_mapping, "slot_mapping", 1, "[N]")
    if ss[0] != ks[0]:
        raise ValueError(f"slot_mapping must be [N] = [{ks[0]}]; got shape {ss}")
    _scalar(k_scale, "k_scale")
    _scalar(v_scale, "v_scale")
    if fmt == kvc.KVFormat.BF16 and (k_scale is not None or v_scale is not None):
        raise ValueError("k_scale / v_scale apply to FP8 and NVFP4 caches; this kv_cache is bfloat16")
    return fmt
