"""XLA command buffers (CUDA graphs) and cache donation on the GPU: a jitted multi-layer decode loop
(`fori_loop` over steps; per layer write_kv then sparse_decode) with the KV caches donated.

- The optimized HLO aliases every cache input to its output and holds no copy of a cache.
- With command buffers enabled (XLA's default), the thunks that run the jax_msa custom calls are captured inside
  a kCommandBuffer thunk (jaxlib 0.11.2 forms command buffers from the thunk sequence, so the check reads XLA's
  thunk-sequence dump; the optimized HLO shows no command_buffer computation).
- The same loop run in a fresh process with command buffers disabled (`--xla_gpu_enable_command_buffer=`)
  gives bit-identical outputs and caches.

Run on the H200 with the other GPU tests (`.ci/gpu_run.sh test`).
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_msa
from bitwise import assert_bitwise_equal
from hlo_text import copies_of
from problems import PAGE, make_decode_problem

LAYERS, STEPS = 2, 4
SHAPES = dict(num_q_heads=16, num_kv_heads=1, head_dim=128, topk=16)
START_LENS = [1000, 130, 5]
DISABLE_FLAG = "--xla_gpu_enable_command_buffer="


def command_buffers_disabled() -> bool:
    return DISABLE_FLAG in os.environ.get("XLA_FLAGS", "").split()


@functools.cache
def _problem(seed=9100):
    return make_decode_problem(seed, seq_lens=[s + STEPS for s in START_LENS], hole_frac=0.0, dup_frac=0.0,
                            oob_frac=0.0, **SHAPES)


def loop_inputs(seed=9100):
    """Fresh arrays each call (the loop donates the caches)."""
    p = _problem(seed)
    rng = np.random.default_rng(seed + 1)
    batch, hkv, hq, d = len(START_LENS), SHAPES["num_kv_heads"], SHAPES["num_q_heads"], SHAPES["head_dim"]
    caches = tuple(jnp.array(p.kv_cache, copy=True) for _ in range(LAYERS))
    new_kv = jnp.asarray(rng.standard_normal((STEPS, LAYERS, 2, batch, hkv, d)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((STEPS, batch, hq, d)), jnp.bfloat16)
    pos = np.asarray(START_LENS)[None, :] + np.arange(STEPS)[:, None]  # [STEPS, B]
    bt = np.asarray(p.block_table)
    slots = jnp.asarray(bt[np.arange(batch)[None, :], pos // PAGE] * PAGE + pos % PAGE, jnp.int32)
    return caches, new_kv, slots, q, p.topk, jnp.asarray(START_LENS, jnp.int32), p.block_table


def decode_loop(caches, new_kv, slots, q, topk, start_lens, block_table):
    """STEPS decode steps of a LAYERS-layer stack; the output of a layer scales the next layer's query."""
    def body(i, carry):
        caches, outs = carry
        x, new = q[i], []
        for layer, cache in enumerate(caches):
            cache = jax_msa.write_kv(cache, new_kv[i, layer, 0], new_kv[i, layer, 1], slots[i], impl="kernel")
            out = jax_msa.sparse_decode(x, cache, jnp.roll(topk, i + layer, axis=-1), seq_lens=start_lens + i + 1,
                                        block_table=block_table, impl="kernel")
            x = (x.astype(jnp.float32) * (1.0 + out.astype(jnp.float32))).astype(jnp.bfloat16)
            new.append(cache)
        return tuple(new), outs.at[i].set(x)

    return jax.lax.fori_loop(0, STEPS, body, (caches, jnp.zeros(q.shape, jnp.bfloat16)))


def compiled_loop():
    return jax.jit(decode_loop, donate_argnums=0).lower(*loop_inputs()).compile()


# ---------------------------------------------------------------------------------------------------------
# Optimized-HLO analysis
# ---------------------------------------------------------------------------------------------------------

def computations(hlo: str) -> dict[str, list[str]]:
    """Computation name -> its instruction lines (the HLO text's top-level `name (...) -> ... {` blocks)."""
    comps, current = {}, None
    for line in hlo.splitlines():
        if current is None:
            m = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
            if m:
                current = m.group(1)
                comps[current] = []
        elif line.startswith("}"):
            current = None
        else:
            comps[current].append(line)
    return comps


_FUSED = re.compile(r"\bcalls=(\{[^}]*\}|%?[\w.\-]+)")


def instruction_targets(hlo: str) -> dict[str, set[str]]:
    """HLO instruction name -> the jax_msa custom-call targets it runs: itself, or inside the computations it
    fuses (`calls=`, e.g. a dynamic-slice fusion wrapping the custom call). Control flow (a while loop's body)
    does not count: its thunks are reported on their own."""
    comps = computations(hlo)
    own, callees = {}, {}
    for lines in comps.values():
        for line in lines:
            m = re.match(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=", line)
            if not m:
                continue
            name = m.group(1)
            own[name] = set(re.findall(r'custom_call_target="(jax_msa_\w+)"', line))
            callees[name] = {c.lstrip("%") for mm in _FUSED.finditer(line)
                             for c in mm.group(1).strip("{}").replace(" ", "").split(",") if c}

    @functools.cache
    def in_computation(comp: str) -> frozenset:
        found = set()
        for line in comps.get(comp, ()):
            m = re.match(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=", line)
            if m:
                found |= targets(m.group(1))
        return frozenset(found)

    def targets(name: str) -> set:
        found = set(own.get(name, ()))
        for c in callees.get(name, ()):
            found |= in_computation(c)
        return found

    return {name: targets(name) for name in own if targets(name)}


def thunks_in_command_buffers(thunk_sequence: str) -> dict[int, bool]:
    """Thunk id -> whether it is nested (by indentation) under a kCommandBuffer thunk in XLA's thunk-sequence
    dump (`NNN: kKind ...` lines; command buffers are formed from the thunk sequence, not in the HLO)."""
    placement, stack = {}, []  # stack of (indent, is_command_buffer)
    for line in thunk_sequence.splitlines():
        m = re.match(r"^(\s*)(\d+):\s+(k\w+)", line)
        if not m:
            continue
        indent = len(m.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        placement[int(m.group(2))] = any(cb for _, cb in stack)
        stack.append((indent, m.group(3) == "kCommandBuffer"))
    return placement


def thunk_annotations(metadata: str) -> dict[int, str]:
    """Thunk id -> its profile annotation (the HLO instruction it runs) from the thunk-metadata dump."""
    return {int(i): name for name, i in
            re.findall(r'profile_annotation:\s*"([^"]*)"\s*thunk_id:\s*(\d+)', metadata)}


def custom_call_placement(hlo: str, thunk_sequence: str, metadata: str) -> dict[str, list[bool]]:
    """jax_msa custom-call target -> for each thunk that runs it, whether that thunk is inside a command buffer."""
    targets = instruction_targets(hlo)
    inside = thunks_in_command_buffers(thunk_sequence)
    placement: dict[str, list[bool]] = {}
    for thunk, name in sorted(thunk_annotations(metadata).items()):
        for target in sorted(targets.get(name, ())):
            placement.setdefault(target, []).append(inside.get(thunk, False))
    return placement


def compile_with_dump(dump_dir: str):
    """The donated loop compiled with XLA's dumps (optimized HLO and thunk sequence) written to dump_dir."""
    compiled = jax.jit(decode_loop, donate_argnums=0).lower(*loop_inputs()).compile(
        compiler_options={"xla_dump_to": dump_dir})
    files = os.listdir(dump_dir)

    def read(suffix):
        found = sorted(f for f in files if "decode_loop" in f and f.endswith(suffix))
        return open(os.path.join(dump_dir, found[-1])).read() if found else None

    sequence = read("thunk_sequence_after_thunk_passes.txt") or read("thunk_sequence.txt")
    return compiled, sequence, read("thunk_metadata.txt")


def test_placement_parser_on_handmade_dumps():
    hlo = """HloModule m

%wrapped (p: f32[2]) -> f32[2] {
  %p = f32[2] parameter(0)
  ROOT %c = f32[2] custom-call(%p), custom_call_target="jax_msa_decode"
}

ENTRY %main (x: f32[2]) -> f32[2] {
  %x = f32[2] parameter(0)
  %k = f32[2] custom-call(%x), custom_call_target="jax_msa_write_kv"
  %dsf = f32[2] fusion(%k), kind=kCustom, calls=%wrapped
  %loop = f32[2] while(%dsf), condition=%wrapped, body=%wrapped
  ROOT %w = f32[2] custom-call(%loop), custom_call_target="jax_msa_write_kv"
}
"""
    sequence = """001: kCustomCall [source | next=002 (1)] kCustomCall
002: kWhile [prev=001 (1) | sink]
  body:
    000: kCommandBuffer [source | sink]
        003: kDynamicSliceFusion [source | sink] params=1, results=1
            004: kCustomCall [source | sink] kCustomCall
        005: kCustomCall [source | sink] kCustomCall
"""
    metadata = """thunk_metadata { thunk_info { profile_annotation: "k" thunk_id: 1 } thunk_kind: "kCustomCall" }
thunk_metadata { thunk_info { profile_annotation: "loop" thunk_id: 2 } thunk_kind: "kWhile" }
thunk_metadata { thunk_info { profile_annotation: "dsf" thunk_id: 3 } thunk_kind: "kDynamicSliceFusion" }
thunk_metadata { thunk_info { profile_annotation: "w" thunk_id: 5 } thunk_kind: "kCustomCall" }"""
    assert thunks_in_command_buffers(sequence) == {1: False, 2: False, 0: False, 3: True, 4: True, 5: True}
    assert custom_call_placement(hlo, sequence, metadata) == {"jax_msa_write_kv": [False, True],
                                                              "jax_msa_decode": [True]}


# ---------------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_donated_caches_are_aliased_and_never_copied():
    hlo = compiled_loop().as_text()
    caches = loop_inputs()[0]
    for i in range(LAYERS):  # parameter i (cache i) is output {i}
        assert re.search(rf"\{{{i}\}}:\s*\({i},\s*\{{\}}", hlo), (f"cache {i} is not aliased input -> output",
                                                                 re.findall(r"input_output_alias=.*", hlo))
    assert copies_of(hlo, caches[0]) == []


@pytest.mark.gpu
def test_custom_calls_land_in_command_buffers_as_configured(tmp_path):
    compiled, sequence, metadata = compile_with_dump(str(tmp_path))
    assert sequence and metadata, f"no thunk-sequence dump in {os.listdir(tmp_path)}"
    placement = custom_call_placement(compiled.as_text(), sequence, metadata)
    assert set(placement) == {"jax_msa_write_kv", "jax_msa_decode"}, placement
    assert all(len(v) == LAYERS for v in placement.values()), placement
    want = not command_buffers_disabled()
    assert all(p == want for v in placement.values() for p in v), (
        f"command buffers {'enabled' if want else 'disabled'}; jax_msa thunks inside one: {placement}\n{sequence}")
    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}: jax_msa thunks inside command buffers: {placement}")


def run_loop_to(path: str) -> None:
    """Runs the donated loop and saves its outputs (the subprocess half of the comparison below)."""
    caches, out = jax.jit(decode_loop, donate_argnums=0)(*loop_inputs())
    np.savez(path, out=np.asarray(out.view(jnp.uint16)),
             **{f"cache{i}": np.asarray(c.view(jnp.uint16)) for i, c in enumerate(caches)})


@pytest.mark.gpu
def test_loop_is_bit_identical_with_command_buffers_on_and_off(tmp_path):
    if command_buffers_disabled():
        pytest.skip("compares against a run with command buffers disabled; this process already is one")
    path = str(tmp_path / "no_cmd_buffers.npz")
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {DISABLE_FLAG}",
               XLA_PYTHON_CLIENT_PREALLOCATE="false")
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {tests_dir!r}); import test_gpu_command_buffers as t; t.run_loop_to({path!r})"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=600)
    other = np.load(path)
    caches, out = jax.jit(decode_loop, donate_argnums=0)(*loop_inputs())
    assert_bitwise_equal(out.view(jnp.uint16), other["out"])
    for i, c in enumerate(caches):
        assert_bitwise_equal(c.view(jnp.uint16), other[f"cache{i}"])
    assert np.abs(np.asarray(out, np.float32)).max() > 0
