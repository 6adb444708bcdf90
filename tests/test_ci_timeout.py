"""CI cannot hang on one test: pytest-timeout is loaded with a per-test default from
pyproject.toml, and a stuck test fails alone (its worker goes on to the next test)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_test_runs_under_a_timeout(request):
    assert request.config.pluginmanager.hasplugin("timeout"), "pytest-timeout is not loaded"
    assert float(request.config.getini("timeout") or 0) > 0, "no default per-test timeout"
    assert request.config.getini("timeout_method") == "signal"  # fails the test, not the worker
    assert request.node.get_closest_marker("timeout") is None  # the default applies here


def test_a_stuck_test_fails_and_the_next_one_runs(tmp_path):
    """The project's settings (its timeout method; a 2 s limit instead of the default) on an
    xdist worker, as `make test` runs: the stuck test fails within seconds, with the plugin's
    message, and the test after it in the same worker still passes."""
    (tmp_path / "test_stuck.py").write_text(
        textwrap.dedent(
            """
            import time

            def test_stuck():
                time.sleep(120)

            def test_after():
                pass
            """
        )
    )
    start = time.monotonic()
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-c",
            str(ROOT / "pyproject.toml"),
            "--rootdir",
            str(tmp_path),
            "-p",
            "no:cacheprovider",
            "-o",
            "timeout=2",
            "-n",
            "1",
            str(tmp_path / "test_stuck.py"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert time.monotonic() - start < 60, "the stuck test was not stopped"
    assert run.returncode == 1, run.stdout[-3000:]
    assert "Failed: Timeout (>2.0s) from pytest-timeout" in run.stdout, run.stdout[-3000:]
    assert "1 failed, 1 passed" in run.stdout, run.stdout[-3000:]
