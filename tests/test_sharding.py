"""jax_msa.sharding: the serving layout (KV heads over `model`, requests and pages over `data`).

The multi-device cases (meshes 1x8, 2x4, 4x2 over 8 fake CPU devices) live in tests/_multidevice_cases.py
and run in a subprocess: XLA_FLAGS=--xla_force_host_platform_device_count=8 must be set before jax is
imported, and this process has already imported it with one device.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_msa
from jax_msa.sharding import ServingSpecs, sharded_sparse_decode
from problems import make_decode_problem

TESTS = pathlib.Path(__file__).resolve().parent


def _run_multidevice(selection: str):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    env["JAX_PLATFORMS"] = "cpu"
    # The child must import the same jax_msa as this process (the installed one in CI, not the source tree,
    # which has no compiled modules there): its folder first on the path, and a working directory outside the
    # repository, since `python -m` puts the working directory on sys.path.
    package_parent = pathlib.Path(jax_msa.__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join([str(package_parent), str(TESTS), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", selection,
           str(TESTS / "_multidevice_cases.py")]
    with tempfile.TemporaryDirectory() as cwd:
        return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("mesh", ["mesh1x8", "mesh2x4", "mesh4x2"])
def test_multidevice_cases(mesh):
    """decode (bf16, NVFP4), write_kv (bf16, NVFP4) and prefill on a (data, model) mesh: bit-identical to
    the unsharded op, no collective in the compiled HLO (on 2x4 also: the indivisible-shape error, and an
    Auto-axes mesh with inputs not yet laid out, and the plain ops' error for explicitly sharded inputs)."""
    result = _run_multidevice(mesh)
    report = result.stdout[-6000:] + result.stderr[-3000:]
    assert result.returncode == 0, report
    expected = 8 if mesh == "mesh2x4" else 5
    assert f"{expected} passed" in result.stdout, report


def test_single_device_mesh_matches_the_op():
    """In this process (one device): the wrapper on a 1x1 mesh is the op itself."""
    mesh = jax.make_mesh((1, 1), ("data", "model"))
    p = make_decode_problem(7400, seq_lens=[300, 5], num_q_heads=4, num_kv_heads=2, head_dim=64, topk=4)
    args = (p.q, p.kv_cache, p.topk, p.seq_lens, p.block_table)
    got = jax.jit(sharded_sparse_decode(mesh, return_lse=True, impl="kernel"))(*args)
    want = jax_msa.sparse_decode(p.q, p.kv_cache, p.topk, seq_lens=p.seq_lens, block_table=p.block_table,
                                 return_lse=True, impl="kernel")
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)))


def test_serving_specs():
    s = ServingSpecs("dp", "tp")
    P = jax.sharding.PartitionSpec
    assert (s.q, s.kv_cache, s.topk, s.per_request, s.block_table, s.lse) == (
        P("dp", "tp", None), P("dp", "tp", None, None), P("tp", "dp", None), P("dp"), P("dp", None), P("dp", "tp"))
    with pytest.raises(ValueError, match="no axis named 'tp'"):
        sharded_sparse_decode(jax.make_mesh((1, 1), ("data", "model")), model_axis="tp")


def test_tp_bench_script_on_four_fake_devices():
    # examples/bench/bench_tp.py --small: M3-style 16/4 heads sharded 1-, 2- and 4-way on fake CPU devices; the
    # script asserts no collective and prints whether each sharded output is bit-identical to the one-device one.
    script = TESTS.parent / "examples" / "bench" / "bench_tp.py"
    if not script.exists():
        pytest.skip("examples/ not in this checkout")
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
    env["JAX_PLATFORMS"] = "cpu"
    package_parent = pathlib.Path(jax_msa.__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join([str(package_parent), str(script.parent), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory() as cwd:
        r = subprocess.run([sys.executable, str(script), "--small", "--repeats", "1"], env=env, cwd=cwd,
                           capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| prefill") or line.startswith("| decode")]
    sharded = [line for line in rows if not line.split("|")[2].strip() == "1"]
    assert len(rows) == 6 and len(sharded) == 4, r.stdout
    assert all("| none |" in line and "bit-identical" in line for line in sharded), r.stdout
