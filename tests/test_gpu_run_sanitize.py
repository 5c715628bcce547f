"""The `sanitize` stage of .ci/gpu_run.sh, on any machine, with a stand-in `compute-sanitizer` on PATH that records
the command it was given instead of running it. The stage must collect the tests marked `gpu and sanitize` and run each
in its own sanitized process (several in one process segfaulted the sanitized process on the H200, without a report),
report "N of N tests clean", name the tests that failed, and fail on a selection that matches nothing or a collection
that breaks, rather than sanitize what it could collect and call the stage clean. A sanitized process killed by a signal
runs once more with XLA compiling on one thread; a second crash is named as a crash.

The script runs from a copy of .ci/gpu_run.sh, tests/ and pyproject.toml: its in-tree mode puts the tree first on
PYTHONPATH, and the copy holds no jax_msa, so collection imports the jax_msa this session tests (CI's installed one)."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Drops the sanitizer's own options, appends the command (after the XLA_FLAGS it sees) to $STUB_LOG, fails when it
# names a test in $STUB_FAIL, and dies of SIGSEGV (as the real tool's process did, without a report) when it names the
# test in $STUB_CRASH: every time, or only the first time with STUB_CRASH_ONCE set (a marker file remembers it).
STUB = """#!/usr/bin/env bash
while [[ "$1" == --* ]]; do
  case "$1" in --tool|--error-exitcode|--report-api-errors) shift 2 ;; *) shift ;; esac
done
echo "XLA_FLAGS=[${XLA_FLAGS:-}] $*" >> "$STUB_LOG"
if [[ -n "${STUB_CRASH:-}" && "$*" == *"${STUB_CRASH}"* ]]; then
  if [[ -z "${STUB_CRASH_ONCE:-}" || ! -e "$STUB_LOG.crashed" ]]; then touch "$STUB_LOG.crashed"; kill -SEGV $$; fi
fi
[[ -n "${STUB_FAIL:-}" && "$*" == *"${STUB_FAIL}"* ]] && exit 1
exit 0
"""


def script_tree(tmp_path):
    """A tree with the stage's script, the tests it collects (and the examples they import) and the pytest
    configuration (markers, rootdir)."""
    tree = tmp_path / "tree"
    (tree / ".ci").mkdir(parents=True)
    shutil.copy2(os.path.join(REPO, ".ci", "gpu_run.sh"), tree / ".ci" / "gpu_run.sh")
    shutil.copy2(os.path.join(REPO, "pyproject.toml"), tree / "pyproject.toml")
    for folder in ("tests", "examples"):  # (some test modules import the benchmark scripts when collected)
        shutil.copytree(os.path.join(REPO, folder), tree / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return str(tree)


def run_sanitize_stage(tmp_path, **env_extra):
    tree = script_tree(tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stub = bin_dir / "compute-sanitizer"
    stub.write_text(STUB)
    stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "sanitized_commands.txt"
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHON=sys.executable,
               OUT=str(tmp_path / "out"), STUB_LOG=str(log), **env_extra)
    if "SANITIZE_SELECT" not in env_extra:
        env.pop("SANITIZE_SELECT", None)
    done = subprocess.run(["bash", os.path.join(tree, ".ci", "gpu_run.sh"), "sanitize"], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=600)
    commands = log.read_text().splitlines() if log.exists() else []
    return done.returncode, done.stdout + done.stderr, commands, tree


@pytest.fixture(scope="module")
def sanitize_ids(tmp_path_factory):
    """The node ids the stage should run, collected here the way pytest sees them (from a copied tree, as the stage)."""
    tree = script_tree(tmp_path_factory.mktemp("collect"))
    done = subprocess.run([sys.executable, "-m", "pytest", os.path.join(tree, "tests"), "-q", "--collect-only",
                           "-p", "no:cacheprovider", "-m", "gpu and sanitize"], cwd=tree, capture_output=True,
                          text=True, timeout=600)
    ids = [line for line in done.stdout.splitlines() if re.match(r"^tests/\S+::", line)]
    assert ids, done.stdout + done.stderr
    return ids


def test_each_test_in_its_own_sanitized_process(tmp_path, sanitize_ids):
    rc, out, commands, tree = run_sanitize_stage(tmp_path)
    assert rc == 0, out
    assert f"sanitize: {len(sanitize_ids)} of {len(sanitize_ids)} tests clean" in out, out
    # one sanitized pytest a test, each on exactly its node id
    assert len(commands) == len(sanitize_ids), commands
    targets = [re.search(r"-m pytest (\S+)", c).group(1) for c in commands]
    assert targets == [os.path.join(tree, i) for i in sanitize_ids], targets


def test_a_failing_test_is_named_and_fails_the_stage(tmp_path, sanitize_ids):
    failing = sanitize_ids[-1]
    rc, out, commands, _ = run_sanitize_stage(tmp_path, STUB_FAIL=failing.split("::", 1)[1])
    assert rc != 0, out
    n = len(sanitize_ids)
    assert f"sanitize: {n - 1} of {n} clean; failed: {failing}" in out, out
    assert len(commands) == n, commands  # the other tests still ran


def test_an_empty_selection_fails(tmp_path):
    rc, out, commands, _ = run_sanitize_stage(tmp_path, SANITIZE_SELECT="no_test_is_called_this")
    assert rc != 0 and "sanitize: no test selected" in out, out
    assert commands == []


def test_a_broken_collection_fails(tmp_path):
    # a plugin that cannot be imported breaks collection (pytest exit 1 or 4): nothing may be sanitized
    rc, out, commands, _ = run_sanitize_stage(tmp_path, PYTEST_ADDOPTS="-p no_such_pytest_plugin_here")
    assert rc != 0 and "sanitize: test collection failed" in out, out
    assert commands == []


def test_a_crash_runs_once_more_with_xla_compiling_on_one_thread(tmp_path, sanitize_ids):
    crashing = sanitize_ids[0]
    rc, out, commands, _ = run_sanitize_stage(tmp_path, STUB_CRASH=crashing.split("::", 1)[1], STUB_CRASH_ONCE="1")
    n = len(sanitize_ids)
    assert rc == 0, out
    assert "died of signal 11 without a report" in out, out
    assert f"sanitize: {n} of {n} tests clean" in out, out
    assert len(commands) == n + 1, commands  # the crashed test twice, the others once
    first, retry = commands[0], commands[1]
    assert crashing.split("::", 1)[1] in retry
    assert "force_compilation_parallelism" not in first and "--xla_gpu_force_compilation_parallelism=1" in retry, commands
    assert not any("force_compilation_parallelism" in c for c in commands[2:]), commands


def test_a_second_crash_is_named_as_a_crash(tmp_path, sanitize_ids):
    crashing = sanitize_ids[-1]
    rc, out, commands, _ = run_sanitize_stage(tmp_path, STUB_CRASH=crashing.split("::", 1)[1])
    n = len(sanitize_ids)
    assert rc != 0, out
    assert f"sanitize: {n - 1} of {n} clean; failed: {crashing} (crashed twice: signal 11, no memcheck report)" in out, out
    assert len(commands) == n + 1, commands
