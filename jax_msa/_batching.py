"""vmap rules of the decode and write_kv custom calls: a vmapped axis is folded into the call's own batch.

The custom calls take one flat batch. Under ``jax.vmap`` over a leading axis of size L (a layer axis, a
beam axis, ...) the default ``vmap_method="sequential"`` runs L calls one after another. These rules make
one call instead, exactly equivalent to the L calls:

decode     q [L,T,Hq,D] -> [L*T,Hq,D]; topk [L,Hkv,T,K] -> [Hkv,L*T,K]; seq_lens [L,B] -> [L*B];
           block_table [L,B,M] -> [L*B,M]. Request l*B+b of the folded call is request b of element l
           (tokens are request-major with a uniform decode_query_len, so token l*T+t is token t of l).
           A batched cache [L,P,...] becomes [L*P,...] and element l's valid page ids move to l*P + id;
           invalid ones (negative or >= P, holes) become -1, still holes.
write_kv   cache [L,P,...] taken as L*P pages (not reshaped: the custom call reads leading dimensions as pages,
           and a reshape would keep XLA from updating a donated cache in place); k, v [L,N,Hkv,D] ->
           [L*N,Hkv,D]; element l's valid slots move to l*P*128 + slot, skipped ones (negative or >= P*128)
           become -1, still skipped.

Unbatched operands are broadcast first (a shared cache under a batched write_kv is copied L times: the
result holds L caches). Each (token, head) of decode and each written token of write_kv is computed
independently of the others, so the folded call is bit-identical to the loop.

scales     per-element scales (a layer's q_scale / k_scale / v_scale) [L] -> [L] (an inner fold's [L1] -> [L*L1]),
           all three alike, unbatched ones broadcast: the decode's request l*B+b reads entry l (requests_per_scale
           = B, bindings.h group_scales), write_kv's token l*N+n likewise. Scalars shared by every element stay
           scalars.

Sequential fallback (one call per element, still exact): folds whose indices would overflow int32 or
whose decode batch would exceed the CUDA grid limit (L*B*decode_query_len > 65535). Prefill has no rule:
its plan indexes requests and pages of one batch, and its kernels take scalar scales, so it always runs
sequentially.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

PAGE_SIZE = 128
MAX_DECODE_ROWS = 65535  # CUDA decode grid limit on batch * decode_query_len
INT32_LIMIT = 2**31


def _broadcast(x, batched: bool, size: int):
    return x if batched else jnp.broadcast_to(x, (size, *x.shape))


def _relocate(ids, per_element: int):
    """ids [L, ...]: valid ids (0 <= id < per_element) of element l move to l * per_element + id; the
    others become -1."""
    layer = jnp.arange(ids.shape[0], dtype=jnp.int32).reshape((-1,) + (1,) * (ids.ndim - 1))
    valid = (ids >= 0) & (ids < per_element)
    return jnp.where(valid, ids + layer * per_element, -1).astype(jnp.int32)


def _sequential(call: Callable, in_batched, args):
    """One call per element of the vmapped axis (the ffi_call's own vmap_method="sequential"). in_batched: a
    pytree of bools matching args (the scales are a tuple of three)."""
    axes = tuple(jax.tree.map(lambda b: 0 if b else None, b) for b in in_batched)
    return jax.vmap(call, in_axes=axes)(*args)


def _fold_scales(scales, scales_batched, size: int):
    """scales: a NamedTuple of fp32 scalars or [L1] vectors (an inner fold's), all of one shape. Shared scalars stay
    as they are; otherwise each becomes [size * L1]: entry l * L1 + i is element l's entry i, so that the folded call,
    whose requests / tokens are element-major, reads each element's own scales (bindings.h group_scales)."""
    if not any(jax.tree.leaves(scales_batched)) and all(s.ndim == 0 for s in scales):
        return scales
    return type(scales)(*(_broadcast(s, b, size).reshape(-1) for s, b in zip(scales, scales_batched)))


def fold_decode_batch(call: Callable, decode_query_len: int) -> Callable:
    """call(q, kv_cache, scales, topk, seq_lens, block_table) -> (out, lse), the unbatched decode custom
    call; returns the same function with the fold rule above for jax.vmap."""

    @jax.custom_batching.custom_vmap
    def decode(q, kv_cache, scales, topk, seq_lens, block_table):
        return call(q, kv_cache, scales, topk, seq_lens, block_table)

    @decode.def_vmap
    def rule(axis_size, in_batched, q, kv_cache, scales, topk, seq_lens, block_table):
        args = (q, kv_cache, scales, topk, seq_lens, block_table)
        n = axis_size
        q_b, cache_b, scales_b, topk_b, sl_b, bt_b = in_batched
        batch = seq_lens.shape[-1]
        num_pages = kv_cache.shape[1] if cache_b else kv_cache.shape[0]
        if n * batch * decode_query_len > MAX_DECODE_ROWS or (cache_b and n * num_pages >= INT32_LIMIT):
            out, lse = _sequential(call, in_batched, args)
            return (out, lse), (True, True)
        q = _broadcast(q, q_b, n)
        topk = _broadcast(topk, topk_b, n)
        seq_lens = _broadcast(seq_lens, sl_b, n)
        block_table = _broadcast(block_table, bt_b, n)
        if cache_b:
            block_table = _relocate(block_table, num_pages)
            kv_cache = kv_cache.reshape(n * num_pages, *kv_cache.shape[2:])
        t, hq, d = q.shape[1:]
        hkv, _, k = topk.shape[1:]
        out, lse = decode(q.reshape(n * t, hq, d), kv_cache, _fold_scales(scales, scales_b, n),
                          jnp.moveaxis(topk, 0, 1).reshape(hkv, n * t, k), seq_lens.reshape(n * batch),
                          block_table.reshape(n * batch, block_table.shape[-1]))
        return (out.reshape(n, t, hq, d), lse.reshape(n, t, hq)), (True, True)

    return decode


def fold_write_kv_batch(call: Callable) -> Callable:
    """call(kv_cache, k, v, slot_mapping, scales) -> kv_cache, the unbatched write_kv custom call; returns
    the same function with the fold rule above for jax.vmap."""

    @jax.custom_batching.custom_vmap
    def write(kv_cache, k, v, slot_mapping, scales):
        return call(kv_cache, k, v, slot_mapping, scales)

    @write.def_vmap
    def rule(axis_size, in_batched, kv_cache, k, v, slot_mapping, scales):
        args = (kv_cache, k, v, slot_mapping, scales)
        n = axis_size
        cache_b, k_b, v_b, slots_b, scales_b = in_batched
        # pages = every dimension before the page's [heads, 128, bytes] (a nested vmap's inner fold leaves
        # [L, P, ...]), past the batch dimension
        num_pages = math.prod(kv_cache.shape[1 if cache_b else 0:-3])
        capacity = num_pages * PAGE_SIZE
        if n * capacity >= INT32_LIMIT:
            return _sequential(call, in_batched, args), True
        kv_cache = _broadcast(kv_cache, cache_b, n)
        k = _broadcast(k, k_b, n)
        v = _broadcast(v, v_b, n)
        slot_mapping = _relocate(_broadcast(slot_mapping, slots_b, n), capacity)
        tokens = k.shape[1]
        # the cache goes in as it is, [n, pages..., heads, 128, bytes] (the custom call takes leading dimensions as
        # pages): reshaped, it would no longer alias the call's output under donation, and XLA would copy it
        out = write(kv_cache, k.reshape(n * tokens, *k.shape[2:]), v.reshape(n * tokens, *v.shape[2:]),
                    slot_mapping.reshape(n * tokens), _fold_scales(scales, scales_b, n))
        return out, True

    return write
