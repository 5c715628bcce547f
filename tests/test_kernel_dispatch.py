"""The CUDA handlers' dispatch table (cc/cuda/kernel_path.h), exercised on any machine by handing it the compute
capability to decide for, and the architectures compiled into the CUDA module (its SASS)."""

import pytest

import jax_msa
from fatbin import KIND_SASS, fatbin_entries
from jax_msa import _ffi

pytestmark = pytest.mark.skipif(not jax_msa.cuda_available(), reason="needs a build with the CUDA handlers")

# The tcgen05 kernels are selectable only where this build holds code for that exact capability: sm_100a for 10.0
# (in the default list), sm_103a for 10.3.
SM100_10_0 = "sm100" if "100a" in jax_msa.cuda_archs() else "warp_mma"
SM100_10_3 = "sm100" if "103a" in jax_msa.cuda_archs() else "warp_mma"
# The wgmma prefill is selectable on 9.0 where the build holds sm_90a (in the default list).
SM90 = "sm90" if "90a" in jax_msa.cuda_archs() else "warp_mma"

CASES = [
    # (major, minor, JAX_MSA_ENABLE_SM100_KERNELS=1?) -> kernels
    ((7, 5, False), "unsupported"),  # Turing: no cp.async / bf16 mma.sync
    ((7, 0, False), "unsupported"),
    ((8, 0, False), "warp_mma"),  # A100
    ((8, 6, False), "warp_mma"),  # RTX 30xx, A10
    ((8, 9, False), "warp_mma"),  # L40, RTX 40xx
    ((9, 0, False), SM90),  # H100 / H200: the wgmma prefill + the warp-MMA kernels, both verified
    ((10, 0, False), "warp_mma"),  # B200 without the opt-in
    ((10, 0, True), SM100_10_0),  # B200 with the opt-in: the tcgen05 kernels (unverified)
    ((10, 3, True), SM100_10_3),  # B300: needs 103a in the build
    ((11, 0, False), "warp_mma"),
    ((12, 0, False), "warp_mma"),  # RTX 50xx
    ((12, 1, True), "warp_mma"),  # the opt-in is for sm_100 / sm_103 only
]


@pytest.mark.parametrize("capability, want", CASES, ids=lambda c: ".".join(map(str, c[:2])) if isinstance(c, tuple) else c)
def test_dispatch_table(capability, want):
    major, minor, sm100 = capability
    assert _ffi.kernel_path(major, minor, sm100_enabled=sm100) == want


def test_sm90_kernels_can_be_disabled():
    """JAX_MSA_DISABLE_SM90_KERNELS=1 (sm90_enabled=False) leaves an H100 / H200 on the warp-MMA kernels."""
    assert _ffi.kernel_path(9, 0, sm90_enabled=False) == "warp_mma"
    assert _ffi.kernel_path(9, 0, sm90_enabled=True) == SM90
    assert _ffi.kernel_path(8, 0, sm90_enabled=True) == "warp_mma"  # the sm_90a code runs on 9.0 only


def test_every_translation_unit_holds_sass_for_every_compiled_arch():
    import jax_msa._jax_msa_cuda as cuda_module
    want = {int(a.rstrip("af")) for a in jax_msa.cuda_archs()}
    containers = fatbin_entries(cuda_module.__file__)
    assert want and containers
    for entries in containers:
        assert {sm for kind, sm in entries if kind == KIND_SASS} == want, entries


def test_build_options_are_reported():
    """The CUDA module says which build switches it was compiled with (gpu_run.sh's `info` prints them), so modules
    carried to the GPU machine can be told apart: the default build, the prefill experiments and the decode timeline."""
    options = _ffi.cuda_build_options()
    assert set(options) == {"sm90_prefill_pingpong", "sm90_prefill_bulk_store", "decode_timeline"}, options
    assert all(isinstance(v, bool) for v in options.values()), options


def test_the_extension_modules_build_the_python_operand_lists():
    """Each loaded extension module reports the version of the custom calls' operand lists that _ffi builds; a stale
    module (an older build: no attribute, i.e. version 1, the scales in one [3] buffer) is refused at import."""
    from jax_msa import _jax_msa_cpu

    modules = [_jax_msa_cpu] + ([_ffi._cuda_module] if _ffi.cuda_available() else [])
    assert all(m.FFI_SIGNATURES == _ffi.FFI_SIGNATURES for m in modules)

    class Stale:
        XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR = _jax_msa_cpu.XLA_FFI_API_MAJOR, _jax_msa_cpu.XLA_FFI_API_MINOR

    with pytest.raises(ImportError, match="operand lists version 1"):
        _ffi._check_abi(Stale, "_jax_msa_cpu")
