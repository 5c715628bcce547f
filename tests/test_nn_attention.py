"""MSAAttention (jax_msa.nn) end to end on CPU, small shapes with M3's head geometry per KV head
(head_dim 128, rotary_dim 64, theta 5e6, GQA 4).

- The layer against a float64 numpy implementation of the whole M3 attention layer (projections,
  per-head RMSNorm, partial NeoX RoPE, dense-masked attention over the blocks the layer's indexer picked,
  o_proj); the indexer's picks are checked to be a top-k of the float64 index scores (up to bf16 rounding).
- Chunked prefill over a cached prefix, and decode steps (1 token, then 1 + 3 speculative tokens) after a
  prefill, give the outputs of one prefill over the whole sequence.
- Weight loading from a safetensors file with HF tensor names; the HF config mapping.
Caches start poisoned (NaN everywhere), so any read of an unwritten slot or a foreign page shows.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("safetensors")

from flax import nnx  # noqa: E402
from safetensors.flax import save_file  # noqa: E402

import jax_msa  # noqa: E402
from bitwise import assert_bitwise_equal  # noqa: E402
from jax_msa.kv_cache import PAGE_SIZE  # noqa: E402
from jax_msa.nn import (HF_CONFIG_KEYS, M3AttentionConfig, MSAAttention, PagedBatch,  # noqa: E402
                        attention_state_dict, load_attention_weights)

CFG = M3AttentionConfig(hidden_size=128, num_q_heads=8, num_kv_heads=2, num_index_heads=2, head_dim=128,
                        rotary_dim=64, index_head_dim=64, topk=3)
BF16_EPS = 2.0**-8  # bf16 unit roundoff is 2^-9; one ulp relative is at most 2^-8


def bf16(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16)


def f64(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


@functools.cache
def layer(dense: bool, seed: int = 0):
    module = MSAAttention(CFG, dense=dense, rngs=nnx.Rngs(seed))
    # Non-trivial norm weights so that a wrong norm shows.
    rng = np.random.default_rng(seed + 100)
    for norm in ("q_norm", "k_norm") + (() if dense else ("index_q_norm", "index_k_norm")):
        w = getattr(module, norm).weight
        w[...] = jnp.asarray(bf16(rng.uniform(0.5, 1.5, w.shape)))
    return module


@functools.cache
def jitted(module):
    graphdef, state = nnx.split(module)

    @jax.jit
    def step(state, x, kv_cache, index_cache, batch):
        return nnx.merge(graphdef, state)(x, kv_cache, index_cache, batch, return_topk=True)

    return lambda *args: step(state, *args)


def poisoned_caches(num_pages, dense):
    kv = jnp.full((num_pages, CFG.num_kv_heads, PAGE_SIZE, 2 * CFG.head_dim), jnp.nan, jnp.bfloat16)
    ic = None if dense else jnp.full((num_pages, 1, PAGE_SIZE, CFG.index_head_dim), jnp.nan, jnp.bfloat16)
    return kv, ic


def block_tables(rng, seq_lens, num_pages, max_blocks):
    perm = rng.permutation(num_pages)
    bt = np.full((len(seq_lens), max_blocks), -1, np.int32)
    used = 0
    for b, n in enumerate(seq_lens):
        nb = -(-n // PAGE_SIZE)
        bt[b, :nb] = perm[used:used + nb]
        used += nb
    return jnp.asarray(bt)


# ------------------------------------------------------------------------------------------------------
# float64 numpy M3 attention layer
# ------------------------------------------------------------------------------------------------------

def np_weights(module):
    w = {name: f64(v) for name, v in attention_state_dict(module, 0).items()}
    return {name.split("self_attn.")[1].rsplit(".weight", 1)[0]: v for name, v in w.items()}  # q_proj: [out, in]


def np_rms_norm(x, w):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + CFG.rms_norm_eps) * w


def np_rope(x, pos):
    r = CFG.rotary_dim
    inv_freq = CFG.rope_theta ** (-np.arange(r // 2) * 2.0 / r)
    ang = pos[:, None] * inv_freq[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., :r // 2], x[..., r // 2:r]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, x[..., r:]], axis=-1)


def np_heads(w, x, proj, norm, heads, dim, pos):
    return np_rope(np_rms_norm((x @ w[proj].T).reshape(len(x), heads, dim), w[norm]), pos)


def np_layer(w, x_req, n_new, topk_rows, dense):
    """One request: x_req [L, hidden] (whole sequence), outputs of its last n_new tokens [n_new, hidden].
    topk_rows [Hkv, n_new, K] (the layer's selection) masks the keys unless dense."""
    c = CFG
    L = len(x_req)
    pos = np.arange(L)
    q = np_heads(w, x_req, "q_proj", "q_norm", c.num_q_heads, c.head_dim, pos)[L - n_new:]
    k = np_heads(w, x_req, "k_proj", "k_norm", c.num_kv_heads, c.head_dim, pos)
    v = (x_req @ w["v_proj"].T).reshape(L, c.num_kv_heads, c.head_dim)
    qpos = pos[L - n_new:]
    mask = np.broadcast_to(pos[None, None, :] <= qpos[None, :, None], (c.num_kv_heads, n_new, L)).copy()
    if not dense:
        kblk = pos // PAGE_SIZE
        picked = (kblk[None, None, :, None] == topk_rows[:, :, None, :]).any(-1)  # [Hkv, n_new, L]
        mask &= picked
    g = np.arange(c.num_q_heads) // c.group_size
    s = np.einsum("thd,shd->hts", q, k[:, g]) * c.softmax_scale
    s = np.where(mask[g], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("hts,shd->thd", p, v[:, g]).reshape(n_new, -1)
    return o @ w["o_proj"].T


def np_index_scores(w, x_req, n_new):
    """float64 block scores [Hidx, n_new, n_blocks] of the last n_new tokens (-inf: no visible key)."""
    c = CFG
    L = len(x_req)
    pos = np.arange(L)
    qi = np_heads(w, x_req, "index_q_proj", "index_q_norm", c.num_index_heads, c.index_head_dim, pos)[L - n_new:]
    ki = np_heads(w, x_req, "index_k_proj", "index_k_norm", 1, c.index_head_dim, pos)[:, 0]
    s = np.einsum("thd,sd->hts", qi, ki)
    s = np.where(pos[None, None, :] <= pos[L - n_new:][None, :, None], s, -np.inf)
    nb = -(-L // PAGE_SIZE)
    s = np.pad(s, ((0, 0), (0, 0), (0, nb * PAGE_SIZE - L)), constant_values=-np.inf)
    bound = 2.0**-6 * np.linalg.norm(qi, axis=-1).T[:, :, None] * np.linalg.norm(ki, axis=-1).max()
    return s.reshape(c.num_index_heads, n_new, nb, PAGE_SIZE).max(-1), bound  # bound: bf16 rounding slack


def check_selection_is_topk(scores, bound, rows, qpos):
    """rows [H, n, K] from the layer must be the local block plus a top-(K-1) of the other visible blocks
    under the float64 scores, up to `bound` (bf16 rounding of the index q / k on the layer's side)."""
    h, n, kk = rows.shape
    for j in range(h):
        for t in range(n):
            local = qpos[t] // PAGE_SIZE
            ids = rows[j, t]
            chosen = ids[ids >= 0]
            assert len(set(chosen.tolist())) == len(chosen) == min(kk, local + 1)
            assert local in chosen and (chosen <= local).all()
            rest = [b for b in range(local + 1) if b not in chosen]
            others = [b for b in chosen if b != local]
            if rest and others:
                assert scores[j, t, others].min() >= scores[j, t, rest].max() - bound[j, t, 0], (j, t)


# ------------------------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------------------------

def run_prefill(module, x, seq_lens, new_lens, block_table, kv, ic):
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(new_lens)]), jnp.int32)
    batch = PagedBatch.prefill(cu, jnp.asarray(seq_lens, jnp.int32), block_table)
    return jitted(module)(x, kv, ic, batch)


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
def test_layer_matches_float64_m3_layer(dense):
    """Varlen prefill of two requests, one of them a chunk over a prefix written by an earlier call."""
    module = layer(dense)
    rng = np.random.default_rng(1)
    seq_lens, prefix = [650, 300], [420, 0]  # request 0: 6 blocks (> topk 3); its last 230 tokens are the chunk
    new_lens = [s - p for s, p in zip(seq_lens, prefix)]
    xs = [bf16(rng.standard_normal((n, CFG.hidden_size))) for n in seq_lens]
    block_table = block_tables(rng, seq_lens, num_pages=12, max_blocks=7)
    kv, ic = poisoned_caches(12, dense)
    _, kv, ic, _ = run_prefill(module, jnp.asarray(xs[0][:prefix[0]]), [prefix[0], 0], [prefix[0], 0],
                               block_table, kv, ic)
    pad = bf16(rng.standard_normal((2, CFG.hidden_size)))  # two padding tokens past cu_seqlens_q[-1]
    x = jnp.asarray(np.concatenate([xs[0][prefix[0]:], xs[1], pad]))
    y, kv_after, _, topk = run_prefill(module, x, seq_lens, new_lens, block_table, kv, ic)
    y = f64(y)
    assert np.isfinite(y).all()
    np.testing.assert_array_equal(y[-2:], 0.0)  # padding tokens: empty attention, y = o_proj(0)
    unused = np.setdiff1d(np.arange(12), np.asarray(block_table))
    assert np.isnan(f64(kv_after[unused])).all()  # nothing written outside the requests' pages
    w = np_weights(module)
    starts = np.concatenate([[0], np.cumsum(new_lens)])
    for b in range(2):
        rows = None if dense else np.asarray(topk)[:, starts[b]:starts[b + 1]]
        want = np_layer(w, f64(xs[b]), new_lens[b], rows, dense)
        got = y[starts[b]:starts[b + 1]]
        # The layer rounds x W, q, K, V, attention out and y to bf16: a few bf16 ulps of the output scale.
        err = np.abs(got - want).max()
        assert err <= 4 * BF16_EPS * np.abs(want).max(), (b, err, np.abs(want).max())
        rel = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert rel <= 2 * BF16_EPS, (b, rel)
        if not dense:
            scores, bound = np_index_scores(w, f64(xs[b]), new_lens[b])
            qpos = np.arange(seq_lens[b] - new_lens[b], seq_lens[b])
            check_selection_is_topk(scores, bound, rows, qpos)
    if not dense:  # request 0 really is sparse: some rows skip visible blocks
        assert (np.asarray(topk)[:, :new_lens[0]] >= 0).sum(-1).max() == CFG.topk < seq_lens[0] // PAGE_SIZE + 1
        assert (np.asarray(topk)[:, -2:] == -1).all()


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
def test_prefill_then_decode_equals_one_prefill(dense):
    module = layer(dense)
    rng = np.random.default_rng(2)
    prompt = [530, 255]  # request 1 crosses into a new block (page) in the speculative step
    total = [p + 1 + 4 for p in prompt]  # one plain decode step, then one step of 1 + 3 speculative tokens
    xs = [bf16(rng.standard_normal((n, CFG.hidden_size))) for n in total]
    block_table = block_tables(rng, total, num_pages=9, max_blocks=6)

    kv, ic = poisoned_caches(9, dense)
    y_full, _, _, topk_full = run_prefill(module, jnp.asarray(np.concatenate(xs)), total, total, block_table, kv, ic)
    starts = np.concatenate([[0], np.cumsum(total)])

    kv, ic = poisoned_caches(9, dense)
    _, kv, ic, _ = run_prefill(module, jnp.asarray(np.concatenate([x[:p] for x, p in zip(xs, prompt)])),
                               prompt, prompt, block_table, kv, ic)
    step = jitted(module)
    got, done = [], list(prompt)
    for q_len in (1, 4):
        x = jnp.asarray(np.concatenate([x[d:d + q_len] for x, d in zip(xs, done)]))
        done = [d + q_len for d in done]
        batch = PagedBatch.decode(jnp.asarray(done, jnp.int32), block_table, decode_query_len=q_len)
        y, kv, ic, topk = step(x, kv, ic, batch)
        got.append((f64(y).reshape(2, q_len, -1), None if dense else np.asarray(topk).reshape(-1, 2, q_len, 3)))
    y_full = f64(y_full)
    for b in range(2):
        rows = slice(starts[b] + prompt[b], starts[b + 1])
        want = y_full[rows]
        dec = np.concatenate([g[0][b] for g in got])
        assert np.isfinite(dec).all()
        err = np.abs(dec - want).max()
        assert err <= 2 * BF16_EPS * np.abs(want).max(), (b, err)
        if not dense:
            dec_topk = np.concatenate([g[1][:, b] for g in got], axis=1)
            np.testing.assert_array_equal(dec_topk, np.asarray(topk_full)[:, rows])


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
def test_decode_rows_must_match_the_batch(dense):
    """Decode has no padding rows: x of any other length than B * decode_query_len is refused (the dense layer
    used to take the extra rows as the last request's tokens and overwrite its new K / V)."""
    module = layer(dense)
    kv, ic = poisoned_caches(4, dense)
    batch = PagedBatch.decode(jnp.asarray([130, 5], jnp.int32), jnp.asarray([[0, 1], [2, 3]], jnp.int32))
    with pytest.raises(ValueError, match=r"B \* decode_query_len"):
        module(jnp.zeros((4, CFG.hidden_size), jnp.bfloat16), kv, ic, batch)


def test_prefill_in_query_windows_is_bit_identical():
    """MSAAttention(query_chunk_size=...): the prefill's attention in windows of tokens changes nothing."""
    module = layer(False)
    rng = np.random.default_rng(3)
    seq_lens, new_lens = [650, 300], [230, 300]
    block_table = block_tables(rng, seq_lens, num_pages=12, max_blocks=7)
    kv, ic = poisoned_caches(12, False)
    kv = jnp.where(jnp.isnan(kv), 0.5, kv)  # a prefix in the cache for request 0
    ic = jnp.where(jnp.isnan(ic), -0.25, ic)
    x = jnp.asarray(bf16(rng.standard_normal((sum(new_lens), CFG.hidden_size))))
    whole = run_prefill(module, x, seq_lens, new_lens, block_table, kv, ic)
    module.query_chunk_size = 96
    windows = run_prefill(module, x, seq_lens, new_lens, block_table, kv, ic)
    assert_bitwise_equal(windows, whole)
    with pytest.raises(ValueError, match="query_chunk_size"):  # refused when the layer is built
        MSAAttention(CFG, rngs=nnx.Rngs(0), query_chunk_size=0)


def test_decode_num_splits_reaches_sparse_decode(monkeypatch):
    """MSAAttention(decode_num_splits=n) hands n to jax_msa.sparse_decode (its split-K factor; None: the rule)."""
    seen = []
    real = jax_msa.sparse_decode

    def spy(*args, **kwargs):
        seen.append(kwargs.get("num_splits", "absent"))
        return real(*args, **kwargs)

    monkeypatch.setattr(jax_msa, "sparse_decode", spy)
    kv, ic = poisoned_caches(4, False)
    batch = PagedBatch.decode(jnp.asarray([130, 5], jnp.int32), jnp.asarray([[0, 1], [2, 3]], jnp.int32))
    x = jnp.zeros((2, CFG.hidden_size), jnp.bfloat16)
    for n in (None, 3):
        MSAAttention(CFG, rngs=nnx.Rngs(0), decode_num_splits=n)(x, kv, ic, batch)
    assert seen == [None, 3], seen
    with pytest.raises(ValueError, match="num_splits"):  # refused when the layer is built, not at its first step
        MSAAttention(CFG, rngs=nnx.Rngs(0), decode_num_splits=0)


def test_weight_loading_round_trip(tmp_path):
    """HF-named tensors written to safetensors load onto the module, transposed where HF stores [out, in]."""
    rng = np.random.default_rng(3)
    c = CFG
    hf = {
        "q_proj": (c.num_q_heads * c.head_dim, c.hidden_size), "k_proj": (c.num_kv_heads * c.head_dim, c.hidden_size),
        "v_proj": (c.num_kv_heads * c.head_dim, c.hidden_size), "o_proj": (c.hidden_size, c.num_q_heads * c.head_dim),
        "q_norm": (c.head_dim,), "k_norm": (c.head_dim,),
        "index_q_proj": (c.num_index_heads * c.index_head_dim, c.hidden_size),
        "index_k_proj": (c.index_head_dim, c.hidden_size), "index_q_norm": (c.index_head_dim,),
        "index_k_norm": (c.index_head_dim,),
    }
    tensors = {f"model.layers.5.self_attn.{n}.weight": bf16(rng.standard_normal(s) * 0.05) for n, s in hf.items()}
    tensors["model.layers.4.self_attn.q_proj.weight"] = bf16(np.zeros(hf["q_proj"]))  # another layer: ignored
    path = str(tmp_path / "m3_layer.safetensors")
    save_file({k: jnp.asarray(v) for k, v in tensors.items()}, path)

    module = MSAAttention(c, rngs=nnx.Rngs(7))
    load_attention_weights(module, path, layer=5)
    for name, hf_shape in hf.items():
        got = np.asarray(getattr(module, name).kernel[...] if len(hf_shape) == 2 else getattr(module, name).weight[...])
        want = tensors[f"model.layers.5.self_attn.{name}.weight"]
        np.testing.assert_array_equal(got, want.T if len(hf_shape) == 2 else want)
    back = attention_state_dict(module, 5)
    assert set(back) == {k for k in tensors if ".5." in k}
    for k, v in back.items():
        np.testing.assert_array_equal(np.asarray(v), tensors[k])

    dense = MSAAttention(c, dense=True, rngs=nnx.Rngs(8))
    load_attention_weights(dense, path, layer=5)  # a dense layer reads no index tensors
    np.testing.assert_array_equal(np.asarray(dense.o_proj.kernel[...]),
                                  tensors["model.layers.5.self_attn.o_proj.weight"].T)
    with pytest.raises(KeyError, match="model.layers.4.self_attn.k_proj.weight"):
        load_attention_weights(module, path, layer=4)
    bad = dict(tensors)
    bad["model.layers.5.self_attn.k_norm.weight"] = bf16(np.ones(c.head_dim + 1))
    save_file({k: jnp.asarray(v) for k, v in bad.items()}, path)
    with pytest.raises(ValueError, match="k_norm.weight"):
        load_attention_weights(module, path, layer=5)


def test_config_from_hf_dict():
    hf = {"hidden_size": 6144, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
          "rotary_dim": 64, "rope_theta": 5e6, "rms_norm_eps": 1e-5, "sparse_block_size": 128, "index_topk": 16,
          "index_n_heads": 4, "index_head_dim": 128, "num_init_blocks": 0, "first_k_dense_replace": 3,
          "vocab_size": 200064}
    cfg = M3AttentionConfig.from_hf_dict(hf)
    assert (cfg.hidden_size, cfg.num_q_heads, cfg.num_kv_heads, cfg.group_size) == (6144, 64, 4, 16)
    assert (cfg.rotary_dim, cfg.rope_theta, cfg.rms_norm_eps, cfg.topk) == (64, 5e6, 1e-5, 16)
    assert [cfg.is_dense_layer(i) for i in (0, 2, 3, 59)] == [True, True, False, False]
    assert set(HF_CONFIG_KEYS) <= {f.name for f in dataclasses.fields(M3AttentionConfig)}
    small = M3AttentionConfig.from_hf_dict(hf, hidden_size=256, num_q_heads=16, num_kv_heads=1, num_index_heads=1)
    assert (small.hidden_size, small.group_size) == (256, 16)
    with pytest.raises(ValueError, match="one head per KV head"):
        M3AttentionConfig.from_hf_dict({**hf, "index_n_heads": 2})
    with pytest.raises(ValueError, match="block_size"):
        M3AttentionConfig.from_hf_dict({**hf, "sparse_block_size": 64})
