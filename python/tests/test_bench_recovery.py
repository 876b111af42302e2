"""bench/recovery's guards: the ranks' interpreter is the project's venv and is checked before
anything starts, and a cell whose job cannot run ends at once with its ranks' last log lines
instead of waiting out its timeouts (a fresh machine's interpreter lacks crc32c: every rank
fails at once)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher import REPO, motley_bin

BENCH = REPO / "bench" / "recovery"


def load_bench():
    loader = importlib.machinery.SourceFileLoader("bench_recovery", str(BENCH))
    spec = importlib.util.spec_from_loader("bench_recovery", loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def fake_python(tmp: Path, passes_check: bool) -> Path:
    """An interpreter that fails every rank as one without crc32c does; `passes_check`: it
    answers the start-up check (`-c 'import crc32c'`) as if it had it."""
    p = tmp / "python"
    check = "exit 0" if passes_check else "echo \"ModuleNotFoundError: No module named 'crc32c'\" >&2; exit 1"
    p.write_text("#!/bin/sh\n"
                 f"if [ \"$1\" = -c ]; then {check}; fi\n"
                 "echo 'Traceback (most recent call last):' >&2\n"
                 "echo \"ModuleNotFoundError: No module named 'crc32c'\" >&2\n"
                 "exit 1\n")
    p.chmod(0o755)
    return p


def test_the_default_interpreter_is_the_projects_venv(monkeypatch, tmp_path):
    monkeypatch.delenv("MOTLEY_PYTHON", raising=False)
    monkeypatch.setenv("MOTLEY_VENV", str(tmp_path / "venv"))
    assert load_bench().PYTHON == str(tmp_path / "venv" / "bin" / "python")
    monkeypatch.setenv("MOTLEY_PYTHON", "/opt/py/bin/python3")
    assert load_bench().PYTHON == "/opt/py/bin/python3"


def test_an_interpreter_that_cannot_run_the_ranks_is_named_with_the_fix(tmp_path):
    b = load_bench()
    assert b.python_problem(sys.executable) is None, "the tests' venv has crc32c"
    missing = b.python_problem(str(tmp_path / "nope"))
    assert missing == f"{tmp_path / 'nope'} is missing"
    lacking = b.python_problem(str(fake_python(tmp_path, passes_check=False)))
    assert "cannot import crc32c" in lacking and "No module named 'crc32c'" in lacking, lacking
    fix = b.python_fix("/x/python", lacking)
    assert "python/run-tests" in fix and "MOTLEY_PYTHON" in fix and "pip install crc32c" in fix, fix


def test_a_failed_rank_ends_the_wait_at_once_with_its_log(tmp_path):
    b = load_bench()
    c = object.__new__(b.Cluster)
    c.tmp = tmp_path
    c.get = lambda path: {"state": "running"}
    launch = tmp_path / "agents" / "N1" / "jobs" / "1" / "1"
    launch.mkdir(parents=True)
    (launch / "rank-0.log").write_text("starting\n")  # still running: no exit file
    (launch / "rank-4.log").write_text("".join(f"line {i}\n" for i in range(30)) + "No module named 'crc32c'\n")
    assert c.job_failure(1) is None, "a rank without an exit code is running"
    (launch / "rank-4.exit").write_text("1\n")
    why = c.job_failure(1)
    assert why.startswith("rank 4 on N1 exited 1"), why
    assert "No module named 'crc32c'" in why and "line 21" in why and "line 20\n" not in why, "the last 10 lines"
    t0 = time.time()
    with pytest.raises(b.JobFailed, match="a step complete in the cloud: rank 4 on N1 exited 1"):
        c.wait(lambda: None, 600, why="a step complete in the cloud", failed=lambda: c.job_failure(1))
    assert time.time() - t0 < 1.0
    # A failed job ends it too, whatever the ranks left.
    c.get = lambda path: {"state": "failed", "reason": "rank 4 exited 1"}
    assert c.job_failure(1, ranks=False).startswith("the job failed (rank 4 exited 1)")


def bench_env(**extra) -> dict:
    b = motley_bin()
    assert b is not None, "no motley binary: set MOTLEY_BIN (python/run-tests does) or build target/ci/motley"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOTLEY_")}
    env.update(MOTLEY_BIN_DIR=str(Path(b).parent), **extra)
    return env


def test_the_bench_refuses_an_interpreter_without_crc32c_before_starting(tmp_path):
    r = subprocess.run([sys.executable, str(BENCH), "--scenarios", "B", "--models", "gpt3-2.7b"], capture_output=True, text=True,
                       env=bench_env(MOTLEY_PYTHON=str(fake_python(tmp_path, passes_check=False))), timeout=60)
    assert r.returncode == 1 and "cannot import crc32c" in r.stderr and "python/run-tests" in r.stderr, r.stderr
    assert "[recovery]" not in r.stderr, "nothing started"


def test_a_cell_whose_ranks_fail_ends_at_once_with_their_log(tmp_path):
    t0 = time.time()
    r = subprocess.run([sys.executable, str(BENCH), "--scenarios", "B", "--models", "gpt3-2.7b"], capture_output=True, text=True,
                       env=bench_env(MOTLEY_PYTHON=str(fake_python(tmp_path, passes_check=True))), timeout=300)
    took = time.time() - t0
    assert r.returncode == 1, r.stderr[-3000:]
    assert "scenario B gpt3-2.7b failed" in r.stderr and "No module named 'crc32c'" in r.stderr, r.stderr[-3000:]
    assert took < 120, f"{took:.0f} s: the cell waited for a step that never comes"
