"""The suite's rank server (rank_fork.py): a rank forked from the process that imported torch
once behaves as the same rank started with `python -m motley_torch.train`: the same output, the
same exit code for the same error, its own working directory and environment, and the signal
that ended it; a rank whose interpreter would start otherwise is not forked."""

from __future__ import annotations

import json
import signal
import subprocess
import time

from launcher import DATA, PYTHON, python_env, rank_fork_server

ARGS = ["--single-process", "--model", str(DATA / "tiny-llama.yaml"), "--global-batch", "2", "--seq-len", "16",
        "--seed", "3"]


def forked(args, env, cwd, tmp_path, name):
    server = rank_fork_server()
    assert server is not None, "MOTLEY_TEST_FORK=0: this test is about the server"
    out, err = tmp_path / f"{name}.out", tmp_path / f"{name}.log"
    with open(out, "w") as o, open(err, "w") as e:
        p = server.spawn("motley_torch.train", args, env, cwd, o, e)
    return p, out, err


def same_lines(stdout: str) -> list:
    """What a run prints that is the same on every run: each line's fields but its speed and the
    process's peak memory (a forked process's resident set starts as the server's pages)."""
    docs = [json.loads(line) for line in stdout.splitlines()]
    for d in docs:
        for k in ("tokens_per_s", "step_s", "mfu"):
            d.pop(k, None)
        d.get("memory", {}).pop("peak_mb", None)
    return docs


def test_a_forked_rank_prints_and_fails_as_python_m_does(tmp_path):
    env = python_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MOTLEY_PEAK_TFLOPS="1")
    assert rank_fork_server().starts_like(env)
    for name, args, code in (("steps", ARGS + ["--steps", "3", "--save-params", "params"], 0),
                             ("bad", ARGS + ["--steps", "-1"], 2)):
        (tmp_path / name).mkdir()
        want = subprocess.run([PYTHON, "-m", "motley_torch.train", *args], cwd=tmp_path / name, env=env,
                              capture_output=True, text=True, timeout=300)
        (tmp_path / f"{name}-forked").mkdir()
        p, out, err = forked(args, env, tmp_path / f"{name}-forked", tmp_path, name)
        assert p.wait(timeout=300) == want.returncode == code, (err.read_text(), want.stderr)
        got = out.read_text()
        assert same_lines(got) == same_lines(want.stdout), got
        assert len([d for d in same_lines(got) if "loss" in d]) == (3 if code == 0 else 0), got
        if code:
            assert err.read_text().splitlines()[-1] == want.stderr.splitlines()[-1]
        else:  # relative paths are the rank's working directory's
            assert (tmp_path / f"{name}-forked" / "params" / "params.safetensors").is_file()
            assert (tmp_path / name / "params" / "params.safetensors").is_file()


def test_a_forked_rank_ends_with_its_signal_and_odd_interpreters_are_not_forked(tmp_path):
    env = python_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    p, out, _ = forked(ARGS + ["--steps", "100000"], env, tmp_path, tmp_path, "long")
    until = time.monotonic() + 120
    while not out.read_text().strip():
        assert p.poll() is None and time.monotonic() < until
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    assert p.wait(timeout=30) == -signal.SIGKILL
    server = rank_fork_server()
    assert not server.starts_like(dict(env, PYTHONPATH=str(tmp_path)))
    assert not server.starts_like(dict(env, OMP_NUM_THREADS="2"))
