"""pytest plugin of .ci/run and .ci/gpu_run.sh: the test session runs against the intended jax_msa, and runs tests.

Loaded with ``PYTHONPATH=<repo>/.ci python -m pytest -p pytest_ci_checks ...``:

- It imports jax_msa while pytest loads plugins, before any conftest or test module is collected, so pytest's
  later ``sys.path`` insertions (a conftest's rootdir, a test package's parent) cannot put the source tree's
  jax_msa in its place. The session stops with a usage error (exit code 4) unless that package lives in
  ``$JAX_MSA_EXPECTED_DIR/jax_msa`` (site-packages for an installed wheel, the repository for an in-tree build).
  After collection it checks that a fresh ``import jax_msa`` on the final ``sys.path`` still finds that package,
  so the same command run without this plugin tests the same code. The package's path and CUDA build facts are
  printed.
- A session that ends with no passed test (everything skipped, deselected or not collected) fails: exit code 5
  ("no tests collected"), so that CI never reports green without having run anything.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys

import pytest

import jax_msa  # imported first on purpose: see the module docstring

_PACKAGE_DIR = os.path.dirname(os.path.realpath(jax_msa.__file__))
_passed = 0


def _describe() -> str:
    return (f"jax_msa under test: {_PACKAGE_DIR} (cuda_available={jax_msa.cuda_available()}, "
            f"cuda_archs={jax_msa.cuda_archs()})")


def pytest_configure(config):
    expected = os.environ.get("JAX_MSA_EXPECTED_DIR")
    if not expected:
        raise pytest.UsageError("pytest_ci_checks: set JAX_MSA_EXPECTED_DIR to the directory that should hold the "
                                "jax_msa package under test")
    want = os.path.join(os.path.realpath(expected), "jax_msa")
    if _PACKAGE_DIR != want:
        raise pytest.UsageError(f"pytest_ci_checks: imported jax_msa from {_PACKAGE_DIR}, expected {want}")


def pytest_report_header(config):
    return _describe()


def pytest_sessionstart(session):
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and session.config.option.verbose < 0:  # -q hides the report header
        reporter.write_line(_describe())


def pytest_collection_finish(session):
    # The test modules are imported now, and pytest has made its sys.path insertions: a fresh `import jax_msa`
    # (what a run without this plugin does) must still find the package under test.
    spec = importlib.machinery.PathFinder.find_spec("jax_msa", sys.path)
    fresh = os.path.dirname(os.path.realpath(spec.origin)) if spec and spec.origin else None
    if sys.modules.get("jax_msa") is not jax_msa or fresh != _PACKAGE_DIR:
        pytest.exit(f"pytest_ci_checks: after collection, `import jax_msa` resolves to {fresh}, not to the package "
                    f"under test {_PACKAGE_DIR}: the source tree is on sys.path (run pytest, not python -m pytest, "
                    f"from the repository root; no conftest.py or __init__.py above tests/)",
                    returncode=pytest.ExitCode.USAGE_ERROR)


def pytest_runtest_logreport(report):
    global _passed
    if report.when == "call" and report.passed:
        _passed += 1


def pytest_sessionfinish(session, exitstatus):
    if exitstatus == pytest.ExitCode.OK and _passed == 0:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_line("pytest_ci_checks: FAILED: no test passed (all skipped or deselected)", red=True)
        session.exitstatus = pytest.ExitCode.NO_TESTS_COLLECTED
