"""shard_map wrappers of the ops for the common serving layout (docs/SHARDING.md).

Mesh axes (names are arguments; either may be None to leave that dimension unsharded):

- ``model``: KV heads. A shard holds Hkv/m KV heads and the Hq/m query heads of their groups (q head h
  belongs to KV head h // (Hq/Hkv), so contiguous blocks of q heads follow their KV heads). top-k's head
  axis and the cache's head axis shard with them; for NVFP4 the cache's slot axis 2*Hkv (slot 2g = K of
  head g, 2g+1 = V) shards the same way, so a shard holds whole K/V slot pairs.
- ``data``: requests. A shard holds B/d requests (their tokens, seq_lens and block_table rows) and its own
  P/d pages of the cache. Block-table entries and slot_mapping values are LOCAL to the shard: page p of
  data shard i is global page i*P/d + p. Requests never read another shard's pages.

Every op runs entirely inside its shard (the prefill plan is built there too): no collectives.

=============== ============================= =========================================================
array           shape                         PartitionSpec (data, model = the axis names)
=============== ============================= =========================================================
q               [T, Hq, D]                    (data, model, None)
kv_cache        [P, Hkv, 128, 2D] / NVFP4     (data, model, None, None)
                [P, 2*Hkv, 128, 72]
topk            [Hkv, T, K]                   (model, data, None)
seq_lens        [B]                           (data,)
block_table     [B, max_blocks]               (data, None)
cu_seqlens_q    [d * (B/d + 1)]               (data,): each shard's own prefix sums over its tokens
k, v (write)    [N, Hkv, D]                   (data, model, None)
slot_mapping    [N]                           (data,)
out / lse       [T, Hq, D] / [T, Hq]          (data, model, None) / (data, model)
scales          scalars                       replicated
=============== ============================= =========================================================

Divisibility: Hkv, and so Hq, by the model axis size; B, T (and N) and P by the data axis size. For
prefill every data shard has the same padded token count T/d; its cu_seqlens_q describes its requests.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jax_msa import _validation, ops


@dataclasses.dataclass(frozen=True)
class ServingSpecs:
    """PartitionSpecs of every array of the serving layout for one pair of mesh axis names."""

    data_axis: str | None = "data"
    model_axis: str | None = "model"

    @property
    def q(self) -> PartitionSpec:  # also out, k and v of write_kv
        return PartitionSpec(self.data_axis, self.model_axis, None)

    @property
    def kv_cache(self) -> PartitionSpec:
        return PartitionSpec(self.data_axis, self.model_axis, None, None)

    @property
    def topk(self) -> PartitionSpec:
        return PartitionSpec(self.model_axis, self.data_axis, None)

    @property
    def per_request(self) -> PartitionSpec:  # seq_lens, cu_seqlens_q, slot_mapping
        return PartitionSpec(self.data_axis)

    @property
    def block_table(self) -> PartitionSpec:
        return PartitionSpec(self.data_axis, None)

    @property
    def lse(self) -> PartitionSpec:
        return PartitionSpec(self.data_axis, self.model_axis)

    @property
    def replicated(self) -> PartitionSpec:
        return PartitionSpec()


def _axis_size(mesh: Mesh, axis: str | None) -> int:
    if axis is None:
        return 1
    if axis not in mesh.shape:
        raise ValueError(f"mesh has axes {tuple(mesh.axis_names)}; no axis named {axis!r}")
    return mesh.shape[axis]


def _check_divisible(what: str, size: int, axis: str | None, parts: int) -> None:
    if size % parts:
        raise ValueError(f"jax_msa.sharding: {what} = {size} must be divisible by the size {parts} of mesh "
                         f"axis {axis!r}")


def _scale_args(k_scale, v_scale, q_scale) -> dict:
    """The scales that were given (None ones stay absent so the ops see None)."""
    given = dict(k_scale=k_scale, v_scale=v_scale, q_scale=q_scale)
    return {name: value for name, value in given.items() if value is not None}


def _shard_map(fn: Callable, mesh: Mesh, in_specs, out_specs):
    """shard_map of fn; under a mesh with Explicit axes the inputs are first resharded to in_specs (a no-op
    for inputs already laid out that way; under Auto axes shard_map does this itself)."""
    # check_vma=False: the custom calls carry no varying-manual-axes annotations; every output is
    # computed from its own shard only, which the out_specs state.
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    explicit = all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)

    def call(*args):
        if explicit:
            args = tuple(jax.tree.map(lambda x, spec=spec: jax.sharding.reshard(x, NamedSharding(mesh, spec)), a)
                         for a, spec in zip(args, in_specs))
        return mapped(*args)

    return call


def sharded_sparse_decode(mesh: Mesh, *, data_axis: str | None = "data", model_axis: str | None = "model",
                          decode_query_len: int = 1, scale=None, return_lse: bool = False, impl: str = "auto",
                          num_splits: int | None = None) -> Callable:
    """Returns decode(q, kv_cache, topk, seq_lens, block_table, *, k_scale=None, v_scale=None,
    q_scale=None) -> out (or (out, lse)): jax_msa.sparse_decode run per shard of the serving layout. Each shard
    decodes B/d requests, so the split rule may pick another factor than an unsharded step: num_splits fixes it
    (sparse_decode's num_splits; the same bits on any mesh, within the kernel's limits)."""
    _validation.check_num_splits(num_splits)
    specs = ServingSpecs(data_axis, model_axis)
    d, m = _axis_size(mesh, data_axis), _axis_size(mesh, model_axis)

    def decode(q, kv_cache, topk, seq_lens, block_table, *, k_scale=None, v_scale=None, q_scale=None):
        # the op's own checks on the global shapes first: inside a shard its messages would quote shard sizes
        _validation.check_decode(q, kv_cache, topk, seq_lens, block_table, decode_query_len, q_scale=q_scale,
                                 k_scale=k_scale, v_scale=v_scale)
        _check_divisible("Hkv (topk.shape[0])", topk.shape[0], model_axis, m)
        _check_divisible("B (seq_lens.shape[0])", seq_lens.shape[0], data_axis, d)
        _check_divisible("pages (kv_cache.shape[0])", kv_cache.shape[0], data_axis, d)
        scales = _scale_args(k_scale, v_scale, q_scale)

        def local(q, kv_cache, topk, seq_lens, block_table, scales):
            out, lse = ops.sparse_decode(q, kv_cache, topk, seq_lens=seq_lens, block_table=block_table,
                                         decode_query_len=decode_query_len, scale=scale, return_lse=True,
                                         impl=impl, num_splits=num_splits, **scales)
            return out, lse

        out, lse = _shard_map(local, mesh,
                              (specs.q, specs.kv_cache, specs.topk, specs.per_request, specs.block_table,
                               specs.replicated),
                              (specs.q, specs.lse))(q, kv_cache, topk, seq_lens, block_table, scales)
        return (out, lse) if return_lse else out

    return decode


def sharded_sparse_attention(mesh: Mesh, *, data_axis: str | None = "data", model_axis: str | None = "model",
                             scale=None, return_lse: bool = False, impl: str = "auto",
                             query_chunk_size: int | None = None) -> Callable:
    """Returns attention(q, kv_cache, topk, *, cu_seqlens_q, seq_lens, block_table, k_scale=None,
    v_scale=None, q_scale=None) -> out (or (out, lse)): jax_msa.sparse_attention (prefill) per shard.
    cu_seqlens_q is [d * (B/d + 1)]: each data shard's prefix sums over its own T/d tokens. The prefill
    plan is built inside each shard; query_chunk_size windows each shard's T/d tokens."""
    specs = ServingSpecs(data_axis, model_axis)
    d, m = _axis_size(mesh, data_axis), _axis_size(mesh, model_axis)

    def attention(q, kv_cache, topk, *, cu_seqlens_q, seq_lens, block_table, k_scale=None, v_scale=None,
                  q_scale=None):
        # the op's own checks on the global shapes first (cu_seqlens_q is per data shard: checked below)
        _validation.check_query_cache_topk(q, kv_cache, topk, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)
        _validation.check_paging(seq_lens, block_table)
        _check_divisible("Hkv (topk.shape[0])", topk.shape[0], model_axis, m)
        _check_divisible("B (seq_lens.shape[0])", seq_lens.shape[0], data_axis, d)
        _check_divisible("T (q.shape[0])", q.shape[0], data_axis, d)
        _check_divisible("pages (kv_cache.shape[0])", kv_cache.shape[0], data_axis, d)
        if cu_seqlens_q.shape != (seq_lens.shape[0] + d,):
            raise ValueError(f"jax_msa.sharding: cu_seqlens_q must be [d * (B/d + 1)] = "
                             f"[{seq_lens.shape[0] + d}] (one prefix-sum array per data shard); "
                             f"got {tuple(cu_seqlens_q.shape)}")
        scales = _scale_args(k_scale, v_scale, q_scale)

        def local(q, kv_cache, topk, cu, seq_lens, block_table, scales):
            out, lse = ops.sparse_attention(q, kv_cache, topk, cu_seqlens_q=cu, seq_lens=seq_lens,
                                            block_table=block_table, scale=scale, return_lse=True, impl=impl,
                                            query_chunk_size=query_chunk_size, **scales)
            return out, lse

        out, lse = _shard_map(local, mesh,
                              (specs.q, specs.kv_cache, specs.topk, specs.per_request, specs.per_request,
                               specs.block_table, specs.replicated),
                              (specs.q, specs.lse))(q, kv_cache, topk, cu_seqlens_q, seq_lens, block_table,
                                                    scales)
        return (out, lse) if return_lse else out

    return attention


def sharded_write_kv(mesh: Mesh, *, data_axis: str | None = "data", model_axis: str | None = "model",
                     impl: str = "auto") -> Callable:
    """Returns write(kv_cache, k, v, slot_mapping, *, k_scale=None, v_scale=None) -> kv_cache:
    jax_msa.write_kv per shard; slot_mapping holds slots local to each data shard's pages."""
    specs = ServingSpecs(data_axis, model_axis)
    d, m = _axis_size(mesh, data_axis), _axis_size(mesh, model_axis)

    def write(kv_cache, k, v, slot_mapping, *, k_scale=None, v_scale=None):
        _validation.check_write_kv(kv_cache, k, v, slot_mapping, k_scale, v_scale)  # on the global shapes
        _check_divisible("Hkv (k.shape[1])", k.shape[1], model_axis, m)
        _check_divisible("N (k.shape[0])", k.shape[0], data_axis, d)
        _check_divisible("pages (kv_cache.shape[0])", kv_cache.shape[0], data_axis, d)
        scales = _scale_args(k_scale, v_scale, None)

        def local(kv_cache, k, v, slot_mapping, scales):
            return ops.write_kv(kv_cache, k, v, slot_mapping, impl=impl, **scales)

        return _shard_map(local, mesh, (specs.kv_cache, specs.q, specs.q, specs.per_request, specs.replicated),
                          specs.kv_cache)(kv_cache, k, v, slot_mapping, scales)

    return write
