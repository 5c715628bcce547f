#!/usr/bin/env bash
# The one script run on the GPU machine (an H200: python3 3.12 with jax 0.11.2 + CUDA plugin, nanobind,
# scikit-build-core, cmake, ninja, pytest; no network).
#
#   bash .ci/gpu_run.sh [stage ...]   stages: build info test test_decode test_prefill test_off test_pipelined
#                                     test_warp_mma test_natural_order sanitize bench profile compare
#                                     (default: build info test bench; one device call runs at most 10 minutes:
#                                     on an H100, test_decode's 210 tests took 136 s (forty-seventh session),
#                                     test_prefill's 50 205 s and test_warp_mma's 50 198 s (forty-fifth), so
#                                     test (~340 s) fits one call, test + test_warp_mma only just; run as three
#                                     processes at once they took longer, ~585 s (forty-ninth session), so that
#                                     does not help; on the H200, thirty-second session, test_decode's then 151
#                                     took over 7.3 minutes and test_prefill 7.8, before the tests' references
#                                     were jitted (thirty-eighth session)),
#                                     test_off + test_pipelined ~4, sanitize ~3: one process a test)
#
#   build     dist/*.whl present: install that wheel into /tmp/site; otherwise build in-tree with
#             .ci/build_inplace.sh (JAX_MSA_CUDA=ON, JOBS=16). CUTLASS headers come from the nvidia-cutlass wheel
#             in .whl/, installed into /tmp/site.
#   info      nvidia-smi, JAX devices, what jax_msa was built with, HGMMA / HMMA counts in the CUDA module's SASS
#   test      pytest -m gpu, XLA command buffers as configured (default: on)
#   test_decode   the same, decode + KV-write + command-buffer tests and the examples on the GPU only
#                 (test_gpu_{decode,write_kv,command_buffers}, test_examples)
#   test_prefill  the same, prefill tests only (test_gpu_prefill); test_decode + test_prefill = test
#   test_off  pytest -m gpu with command buffers disabled: small cases and command-buffer tests (FULL=1: all)
#   test_pipelined  the bf16 prefill tests with the opt-in pipelined kernel (JAX_MSA_PREFILL_PIPELINED=1)
#   test_warp_mma   the prefill tests on the warp-MMA kernel (JAX_MSA_DISABLE_SM90_KERNELS=1; H200 default: wgmma;
#                   6 min or more on an H100: 45 of 50 in 330 s, thirty-third session)
#   test_natural_order  the prefill tests with the sm90 partials in the natural column order
#                   (JAX_MSA_PARTIAL_FRAGMENT_ORDER=0; ~3 min)
#   sanitize  compute-sanitizer memcheck over pytest -m "gpu and sanitize" (small cases, one process a test;
#             SANITIZE_SELECT=EXPR: only those matching pytest -k EXPR), XLA command buffers off; a process killed by
#             a signal (no memcheck report) runs once more with XLA compiling on one thread
#   bench     every examples/bench/bench_*.py, with --quick unless FULL=1
#   profile   kernel-only decode timings under Nsight Compute (examples/bench/ncu_decode.py)
#   compare   the same timings for this tree's modules and for a baseline's (prebuilt_base/_jax_msa_*.so, e.g. the
#             previous commit's build, run with this tree's Python; or a whole package prebuilt_base/jax_msa/, its
#             Python with its modules, where FFI_SIGNATURES differs), one after the other on this machine: decode kernel time (ncu_decode.py,
#             COMPARE_DECODE_CASES; "none": skip) and prefill (bench_prefill.py, COMPARE_PREFILL_ARGS; "none": skip).
#             Timings are only comparable within one call on one machine, so a change is always measured against its
#             baseline here.
#
# Fastest path (no device time spent compiling): build here with
#   JAX_MSA_CUDA=ON BUILD_DIR=build/cuda .ci/build_inplace.sh && mkdir -p prebuilt && cp build/cuda/_jax_msa_*.so prebuilt/
# and carry prebuilt/ (git-ignored) with the device call; `build` then only copies the modules into jax_msa/.
#
# Which jax_msa is used follows from the tree: a wheel in dist/ means the installed one in /tmp/site, otherwise the
# in-tree package (PYTHONPATH=$PWD). With OUT set, each stage's log (and junit XML, benchmark output) goes there.
# A failing stage does not stop the next ones; the exit code is non-zero when any stage failed.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO="$PWD"
PY="${PYTHON:-python3}"
SITE=/tmp/site
SCRATCH=/tmp/jax_msa_gpu_run
LOG_DIR="${OUT:-${SCRATCH}/logs}"
mkdir -p "${SITE}" "${SCRATCH}" "${LOG_DIR}"
[[ -d /usr/local/cuda/bin ]] && export PATH="${PATH}:/usr/local/cuda/bin"

shopt -s nullglob
WHEELS=(dist/*.whl)
CUTLASS_WHEELS=(.whl/nvidia_cutlass-*.whl)
shopt -u nullglob
if (( ${#WHEELS[@]} )); then
  MODE=wheel
  PACKAGE_PARENT="${SITE}"
  export PYTHONPATH="${SITE}${PYTHONPATH:+:${PYTHONPATH}}"
else
  MODE=in-tree
  PACKAGE_PARENT="${REPO}"
  export PYTHONPATH="${REPO}:${SITE}${PYTHONPATH:+:${PYTHONPATH}}"
fi

# ---- stages ----------------------------------------------------------------------------------------------

stage_build() {
  shopt -s nullglob
  local prebuilt=(prebuilt/_jax_msa_*.so)
  shopt -u nullglob
  if [[ "${MODE}" == in-tree ]] && (( ${#prebuilt[@]} )); then
    # Modules built on the development machine (nvcc 13.0, static cudart) and carried in prebuilt/: seen to run
    # on the H200 image, and no device time is spent compiling.
    echo "build: using prebuilt ${prebuilt[*]}"
    cp -f "${prebuilt[@]}" jax_msa/
    return 0
  fi
  if [[ ! -d "${SITE}/cutlass_library" ]]; then
    (( ${#CUTLASS_WHEELS[@]} )) || { echo "build: no .whl/nvidia_cutlass-*.whl to take the CUTLASS headers from"; return 1; }
    "${PY}" -m pip install -q --no-index --no-deps --no-compile --target "${SITE}" "${CUTLASS_WHEELS[@]}"
  fi
  if [[ "${MODE}" == wheel ]]; then
    echo "build: installing ${WHEELS[*]} into ${SITE}"
    "${PY}" -m pip install -q --no-deps --no-index --upgrade --target "${SITE}" "${WHEELS[@]}"
  else
    # This machine is an H200: sm_90a only unless asked (the default list is for installs).
    local archs="${JAX_MSA_CUDA_ARCHS:-90a-real}"
    echo "build: in-tree, JAX_MSA_CUDA=ON JAX_MSA_CUDA_ARCHS=${archs}"
    JOBS=16 JAX_MSA_CUDA=ON JAX_MSA_CUDA_ARCHS="${archs}" PYTHON="${PY}" .ci/build_inplace.sh
  fi
}

stage_info() {
  nvidia-smi || true
  "${PY}" - <<'EOF'
import jax
import jax_msa
from jax_msa import _ffi

print("jax", jax.__version__, "| devices", jax.devices())
print("jax_msa", jax_msa.__file__)
print("cuda_available", jax_msa.cuda_available(), "| cuda_archs", jax_msa.cuda_archs(),
      "| cuda_targets", sorted(_ffi.cuda_targets()), "| build options", _ffi.cuda_build_options())
EOF
  local so
  so="$("${PY}" -c 'import jax_msa._jax_msa_cuda as m; print(m.__file__)')" || { echo "info: no CUDA module"; return 1; }
  echo "CUDA module: ${so}"
  if ! command -v cuobjdump >/dev/null 2>&1; then
    echo "info: cuobjdump not found; no SASS statistics"
    return 0
  fi
  cuobjdump --list-elf "${so}"
  # Per kernel: SASS instruction count and its Hopper warpgroup MMAs (HGMMA) and warp-level MMAs (HMMA).
  cuobjdump --dump-sass "${so}" | awk '
    /Function : / { name = $NF; order[++n] = name; next }
    name != "" && /\/\*[0-9a-f]+\*\// { insts[name]++ }
    name != "" && /HGMMA/ { hgmma[name]++ }
    name != "" && /HMMA/ && !/HGMMA/ { hmma[name]++ }
    END {
      printf "%8s %8s %8s  %s\n", "insts", "HGMMA", "HMMA", "kernel"
      for (i = 1; i <= n; i++) { k = order[i]; printf "%8d %8d %8d  %s\n", insts[k], hgmma[k], hmma[k], k }
    }'
}

# pytest against the jax_msa chosen above, from a scratch directory; .ci/pytest_ci_checks.py checks which jax_msa
# is imported and fails a run in which no test passed (exit code 5). Started through ${LAUNCHER[@]} when a stage sets it;
# PYTEST_TARGET (default: the tests folder) narrows it to one test file or node id.
LAUNCHER=()
run_pytest() {
  local junit="$1"; shift
  (cd "${SCRATCH}" && PYTHONPATH="${REPO}/.ci:${PYTHONPATH}" JAX_MSA_EXPECTED_DIR="${PACKAGE_PARENT}" \
    ${LAUNCHER[@]+"${LAUNCHER[@]}"} "${PY}" -m pytest "${PYTEST_TARGET:-${REPO}/tests}" -q -p pytest_ci_checks \
    -p no:cacheprovider --junitxml="${junit}" "$@")
  local rc=$?
  (( rc == 5 )) && echo "pytest: no test ran for $* (none collected, or all skipped)"
  return "${rc}"
}

stage_test() {
  echo "--- pytest -m gpu, XLA command buffers as configured (XLA_FLAGS='${XLA_FLAGS:-}')"
  run_pytest "${LOG_DIR}/junit_gpu.xml" -m gpu
}

# `test` in two halves that each fit one device call (the whole suite takes ~9 minutes on the H200, estimated from a
# cut run, 2026-12-03).
stage_test_decode() {
  echo "--- pytest -m gpu: decode, KV write, command buffers, the examples (XLA_FLAGS='${XLA_FLAGS:-}')"
  run_pytest "${LOG_DIR}/junit_gpu_decode.xml" -m gpu \
    -k "test_gpu_decode or test_gpu_write_kv or test_gpu_command_buffers or test_examples"
}

stage_test_prefill() {
  echo "--- pytest -m gpu: prefill (XLA_FLAGS='${XLA_FLAGS:-}')"
  run_pytest "${LOG_DIR}/junit_gpu_prefill.xml" -m gpu -k "test_gpu_prefill"
}

# The GPU tests with XLA command buffers disabled: the small cases and the command-buffer tests (FULL=1: all).
stage_test_off() {
  local -a select=(-k "small or sanitizer or command_buffers or corners or deterministic")
  [[ "${FULL:-0}" == 1 ]] && select=()
  echo "--- pytest -m gpu, XLA command buffers disabled ${select[*]:+(subset: ${select[1]})}"
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" \
    run_pytest "${LOG_DIR}/junit_gpu_no_cmdbuf.xml" -m gpu "${select[@]}"
}

# The bf16 prefill tests with the opt-in pipelined prefill kernel (JAX_MSA_PREFILL_PIPELINED=1).
stage_test_pipelined() {
  echo "--- prefill tests, JAX_MSA_PREFILL_PIPELINED=1"
  JAX_MSA_PREFILL_PIPELINED=1 run_pytest "${LOG_DIR}/junit_gpu_prefill_pipelined.xml" -m gpu \
    -k "test_gpu_prefill and (BF16 or corners or total_q)"
}

# The prefill tests on the warp-MMA kernel (JAX_MSA_DISABLE_SM90_KERNELS=1): on an H200 the default run gives the
# calls with bf16 queries and G = 8 or 16 to the wgmma kernel.
stage_test_warp_mma() {
  echo "--- prefill tests, JAX_MSA_DISABLE_SM90_KERNELS=1"
  JAX_MSA_DISABLE_SM90_KERNELS=1 run_pytest "${LOG_DIR}/junit_gpu_prefill_warp_mma.xml" -m gpu \
    -k "test_gpu_prefill"
}

# The prefill tests with the sm90 kernel's partials in the natural column order (JAX_MSA_PARTIAL_FRAGMENT_ORDER=0; the
# default is the fragment order, which `test` runs).
stage_test_natural_order() {
  echo "--- prefill tests, JAX_MSA_PARTIAL_FRAGMENT_ORDER=0"
  JAX_MSA_PARTIAL_FRAGMENT_ORDER=0 run_pytest "${LOG_DIR}/junit_gpu_prefill_natural_order.xml" -m gpu \
    -k "test_gpu_prefill and not fragment_order"
}

stage_sanitize() {
  command -v compute-sanitizer >/dev/null 2>&1 || { echo "sanitize: compute-sanitizer not found"; return 1; }
  # The platform allocator gives every buffer its own allocation, so out-of-bounds accesses are not hidden inside
  # XLA's memory pool; no autotuning keeps the run short; XLA command buffers (CUDA graphs) are off (the command-buffer
  # path is covered by `test`). Each selected test runs in its own sanitized process: with several in one process the
  # process segfaulted, without a memcheck report, at a varying point (2026-12-03 with command buffers on; in the
  # first stage-reuse case in the fifteenth session; after all 6 prefill cases in the sixteenth; in the sixth case in
  # the seventeenth), while each of the 6 prefill cases alone passed with "ERROR SUMMARY: 0 errors" (seventeenth).
  local -a LAUNCHER=(compute-sanitizer --tool memcheck --error-exitcode 1 --report-api-errors no)
  local -a ids
  local collected collect_rc=0
  collected="$(cd "${SCRATCH}" && "${PY}" -m pytest "${REPO}/tests" -q --collect-only -p no:cacheprovider \
      -m "gpu and sanitize" ${SANITIZE_SELECT:+-k "${SANITIZE_SELECT}"} 2>&1)" || collect_rc=$?
  # 5: nothing selected (reported below); anything else non-zero, e.g. a test module that fails to import: fail here
  # rather than sanitize the tests of the other modules and call the stage clean
  if (( collect_rc != 0 && collect_rc != 5 )); then
    echo "${collected}"
    echo "sanitize: test collection failed (pytest exit ${collect_rc})"
    return 1
  fi
  mapfile -t ids < <(grep -E '^tests/[^ ]+::' <<< "${collected}")
  if (( ${#ids[@]} == 0 )); then
    echo "sanitize: no test selected (-m 'gpu and sanitize'${SANITIZE_SELECT:+ -k '${SANITIZE_SELECT}'})"
    return 1
  fi
  # A sanitized process killed by a signal (the host-side segmentation fault above, no memcheck report: the prefill's
  # small bf16 case twice in the thirty-second session, H200) runs once more with XLA compiling on one thread, which
  # ran clean where that crash had come before (twenty-fifth session); a second crash is reported as such, not as
  # memcheck errors.
  local id rc=0 i=0 failed=() id_rc
  sanitize_one() {  # node id, junit file, extra XLA flags
    XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=platform \
    XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0 --xla_gpu_enable_command_buffer= ${3}" \
    PYTEST_TARGET="${REPO}/${1}" run_pytest "${2}" -m "gpu and sanitize"
  }
  for id in "${ids[@]}"; do
    i=$((i + 1))
    echo "--- memcheck ${i}/${#ids[@]}: ${id}"
    sanitize_one "${id}" "${LOG_DIR}/junit_sanitize_${i}.xml" "" && id_rc=0 || id_rc=$?  # (stages run under set -e)
    if (( id_rc > 128 )); then
      echo "sanitize: the sanitized process died of signal $((id_rc - 128)) without a report; again with" \
        "--xla_gpu_force_compilation_parallelism=1"
      sanitize_one "${id}" "${LOG_DIR}/junit_sanitize_${i}.xml" "--xla_gpu_force_compilation_parallelism=1" \
        && id_rc=0 || id_rc=$?
    fi
    if (( id_rc > 128 )); then
      rc=1; failed+=("${id} (crashed twice: signal $((id_rc - 128)), no memcheck report)")
    elif (( id_rc != 0 )); then
      rc=1; failed+=("${id}")
    fi
  done
  (( rc == 0 )) && echo "sanitize: ${#ids[@]} of ${#ids[@]} tests clean" \
    || echo "sanitize: $(( ${#ids[@]} - ${#failed[@]} )) of ${#ids[@]} clean; failed: ${failed[*]}"
  return "${rc}"
}

stage_bench() {
  shopt -s nullglob
  local benches=(examples/bench/bench_*.py)
  shopt -u nullglob
  if (( ${#benches[@]} == 0 )); then
    echo "bench: no examples/bench/bench_*.py"
    return 0
  fi
  local args=(--quick) rc=0 b name
  [[ "${FULL:-0}" == 1 ]] && args=()
  for b in "${benches[@]}"; do
    name="$(basename "${b}" .py)"
    name="${name#bench_}"
    echo "--- ${b} ${args[*]}"
    if ! "${PY}" "${b}" ${args[@]+"${args[@]}"} 2>&1 | tee "${LOG_DIR}/bench_${name}.txt"; then
      echo "bench: ${b} failed"
      rc=1
    fi
  done
  return "${rc}"
}

stage_compare() {
  shopt -s nullglob
  local base=(prebuilt_base/_jax_msa_*.so)
  shopt -u nullglob
  local base_dir="${SCRATCH}/baseline"
  rm -rf "${base_dir}" && mkdir -p "${base_dir}"
  if [[ -f prebuilt_base/jax_msa/__init__.py ]]; then
    # a whole baseline package, its Python with its modules: needed when the custom calls' operand lists changed
    # in between (FFI_SIGNATURES), since this tree's Python refuses modules of another version at import
    cp -r prebuilt_base/jax_msa "${base_dir}/"
  elif (( ${#base[@]} )); then
    cp -r "${PACKAGE_PARENT}/jax_msa" "${base_dir}/" && cp -f "${base[@]}" "${base_dir}/jax_msa/"
  else
    echo "compare: no prebuilt_base/_jax_msa_*.so or prebuilt_base/jax_msa/ to compare against"; return 1
  fi
  local decode_cases="${COMPARE_DECODE_CASES:---case 64/4,1,32768,1,BF16 --case 64/4,32,32768,1,BF16 \
--case 64/4,256,32768,1,BF16 --case 64/4,32,32768,1,FP8 --case 64/4,256,32768,1,FP8 --case 64/4,32,32768,1,NVFP4 \
--case 64/4,256,32768,1,NVFP4}"
  local prefill_args="${COMPARE_PREFILL_ARGS:---tokens 32768 --heads 64/4 --fmt BF16 --fmt FP8 --fmt NVFP4 --repeats 5 --no-dense}"
  local which path rc=0
  for which in tree baseline; do
    path="${PYTHONPATH}"
    [[ "${which}" == baseline ]] && path="${base_dir}:${PYTHONPATH}"
    echo "--- ${which}" | tee -a "${LOG_DIR}/compare.txt"
    # shellcheck disable=SC2086  # the case lists are word lists on purpose
    (cd examples/bench && { [[ "${decode_cases}" == none ]] || PYTHONPATH="${path}" "${PY}" ncu_decode.py --calls 4 \
      ${decode_cases}; } && { [[ "${prefill_args}" == none ]] || PYTHONPATH="${path}" "${PY}" bench_prefill.py \
      ${prefill_args}; }) 2>&1 |
      tee -a "${LOG_DIR}/compare.txt"
    (( PIPESTATUS[0] == 0 )) || rc=1
  done
  return "${rc}"
}

stage_profile() {
  "${PY}" examples/bench/ncu_decode.py 2>&1 | tee "${LOG_DIR}/ncu_decode.txt"
}

# ---- driver ----------------------------------------------------------------------------------------------

STAGES=("$@")
(( ${#STAGES[@]} )) || STAGES=(build info test bench)
for s in "${STAGES[@]}"; do
  case "${s}" in
    build|info|test|test_decode|test_prefill|test_off|test_pipelined|test_warp_mma|test_natural_order|sanitize|bench|\
    profile|compare) ;;
    *) echo "unknown stage '${s}' (stages: build info test test_decode test_prefill test_off test_pipelined" \
            "test_warp_mma test_natural_order" \
            "sanitize bench profile compare)" >&2
       exit 2 ;;
  esac
done

echo "gpu_run: ${REPO} ($(git rev-parse --short HEAD 2>/dev/null || echo 'no git')), jax_msa ${MODE}," \
     "stages: ${STAGES[*]}, logs: ${LOG_DIR}"
T0=$(date +%s)
SUMMARY=()
FAILED=0
for s in "${STAGES[@]}"; do
  echo
  echo "=== ${s}"
  t=$(date +%s)
  ( set -e; "stage_${s}" ) 2>&1 | tee "${LOG_DIR}/${s}.log"
  rc=${PIPESTATUS[0]}
  took=$(( $(date +%s) - t ))
  (( rc == 0 )) && status=ok || { status="FAILED (rc ${rc})"; FAILED=1; }
  echo "=== ${s}: ${status}, ${took} s"
  SUMMARY+=("$(printf '%-9s %-16s %5d s' "${s}" "${status}" "${took}")")
done
echo
echo "=== summary"
printf '%s\n' "${SUMMARY[@]}"
printf '%-26s %5d s\n' "total" "$(( $(date +%s) - T0 ))"
exit "${FAILED}"
