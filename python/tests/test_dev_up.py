"""The real system: `motley dev up` starts a coordinator (SQLite) and one motley-agent per
node of a two-node cluster file, submits examples/jobs/train-tiny.yaml (the reference trainer
on every rank, this venv's Python), and the job succeeds; the losses global rank 0 printed, in
dev up's stream and in its rank log, equal the single-process run within fp32 rounding (tolerance.py).
Then the same job planned from measured profiles only: the agents (given this Python,
MOTLEY_PYTHON) run the real `python -m motley_torch.profile` when the coordinator asks, the
coordinator stores the profiles and plans with them, and the job trains as before."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from launcher import DATA, REPO, motley_bin, reference_losses
from tolerance import assert_steps_close, layers_of

CLUSTER = DATA / "dev-2x1.yaml"
MODEL = DATA / "tiny-dev.yaml"
JOB = REPO / "examples" / "jobs" / "train-tiny.yaml"
STEPS = 8
SEED = 3
TIMEOUT = 180.0


def step_losses(text: str) -> list:
    """The {"step": i, "loss": x} lines of a rank's output, as (step, loss)."""
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            if "loss" in d:
                out.append((d["step"], d["loss"]))
    return out


def dev_up(cluster: Path, job: Path, work: Path, extra_env: dict = None) -> subprocess.CompletedProcess:
    """Run `motley dev up`; on a timeout Ctrl-C it (it cancels the job and stops its
    coordinator, agents and ranks, which run in process groups of their own), then kill it."""
    b = motley_bin()
    assert b is not None, "no motley binary: set MOTLEY_BIN (python/run-tests does) or build target/release/motley"
    for sib in ("motley-coordinator", "motley-agent"):
        assert os.access(Path(b).with_name(sib), os.X_OK), f"{sib} is not next to {b}: `motley dev up` needs it"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOTLEY_", "NCCL_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra_env or {})
    cmd = [b, "dev", "up", str(cluster), str(job), "--dir", str(work)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        out, err = p.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGINT)
        try:
            out, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
        raise AssertionError(f"{' '.join(cmd)} did not finish within {TIMEOUT} s\n--- stdout\n{out[-6000:]}\n"
                             f"--- stderr\n{err[-4000:]}")
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def rank_logs(res: subprocess.CompletedProcess, work: Path):
    """Every rank log under dev up's work directory, and a report of dev up's output and those
    logs for an assertion's message."""
    logs = sorted(work.glob("agents/*/jobs/*/*/rank-*.log"))
    report = f"--- stdout\n{res.stdout[-8000:]}\n--- stderr\n{res.stderr[-4000:]}\n" + "".join(
        f"--- {p.relative_to(work)}\n{p.read_text()[-3000:]}\n" for p in logs)
    return logs, report


def test_train_tiny_through_dev_up(tmp_path: Path):
    spec = yaml.safe_load(JOB.read_text())
    # The example stays runnable as documented: the trainer on every rank, the test's model.
    assert spec["run"].startswith("python -m motley_torch.train "), spec["run"]
    model = yaml.safe_load(MODEL.read_text())
    assert spec["model"] == model, "examples/jobs/train-tiny.yaml's model is tests/data/tiny-dev.yaml"
    # Ranks run `run` with sh -c in their own directories: this venv's Python by its absolute
    # path, motley_torch from this tree whether or not it is installed.
    spec["run"] = f"{shlex.quote(sys.executable)} -m motley_torch.train --steps {STEPS} --seed {SEED}"
    spec["envs"] = dict(spec.get("envs") or {}, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "python"))
    job = tmp_path / "train-tiny.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    work = tmp_path / "dev"

    res = dev_up(CLUSTER, job, work)
    logs, report = rank_logs(res, work)
    assert res.returncode == 0, f"motley dev up exited {res.returncode}\n{report}"
    assert re.search(r"^motley dev: \[.*\]", res.stdout, re.M), f"no job events streamed\n{report}"

    # Ranks ran under both agents (two pipeline stages, one per node); rank 0's log is one.
    nodes = {p.relative_to(work).parts[1] for p in logs}
    assert len(logs) >= 2 and len(nodes) >= 2, (
        f"expected ranks on both nodes of {CLUSTER.name} (the planner's choice may have changed: "
        f"adjust the cluster so the job spans both agents)\n{report}")
    rank0 = [p for p in logs if p.name == "rank-0.log"]
    assert len(rank0) == 1, f"{[str(p) for p in logs]}"
    from_log = step_losses(rank0[0].read_text())
    # dev up prints each rank log line as "NODE rank-R: LINE".
    streamed = [m.group(1) for m in re.finditer(r"^\S+ rank-0: (\{.*\})$", res.stdout, re.M)]
    from_stream = step_losses("\n".join(streamed))
    assert from_log == from_stream, f"the streamed losses are not rank 0's log\n{report}"
    assert [s for s, _ in from_log] == list(range(STEPS)), f"rank 0 printed steps {from_log}\n{report}"
    for p in logs:
        if p is not rank0[0]:
            assert step_losses(p.read_text()) == [], f"{p.relative_to(work)} printed losses"

    # The plan's global batch and seq len, from the plan the agents handed the ranks.
    plan = json.loads((rank0[0].parent / "plan.json").read_text())
    gb, seq = plan["global_batch"], plan["seq_len"]
    assert (gb, seq) == (spec["global_batch"], model["seq_len"])
    want = reference_losses(str(MODEL), gb, seq, STEPS, SEED)
    got = [x for _, x in from_log]
    assert_steps_close(got, want, layers_of(MODEL), "losses through dev up against the single process's")
    assert want[-1] < want[0], "the loss falls"


def test_profiles_measured_by_agents_through_dev_up(tmp_path: Path):
    import sqlite3

    import torch

    spec = yaml.safe_load(JOB.read_text())
    spec["run"] = f"{shlex.quote(sys.executable)} -m motley_torch.train --steps {STEPS} --seed {SEED}"
    spec["envs"] = dict(spec.get("envs") or {}, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "python"))
    # Micro-batch 2: 2 sequences per GPU, or 1 where a stage's GPUs split it: two profiles.
    spec["plan_options"] = dict(spec.get("plan_options") or {}, micro_batch=2)
    spec["profiling"] = {"mode": "only"}
    job = tmp_path / "train-tiny-profiled.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    work = tmp_path / "dev"
    res = dev_up(CLUSTER, job, work, {"MOTLEY_PYTHON": sys.executable, "PYTHONPATH": str(REPO / "python")})
    logs, report = rank_logs(res, work)
    assert res.returncode == 0, f"motley dev up exited {res.returncode}\n{report}"
    assert re.search(r"measuring P100 tp 1 micro-batch \d", res.stdout), f"no profile run in the events\n{report}"

    # What the coordinator stored: the real profiler's entries (eq. 5 blocks, this torch).
    dbs = list(work.rglob("coordinator.db"))
    assert len(dbs) == 1, f"{dbs}"
    with sqlite3.connect(str(dbs[0])) as db:
        rows = db.execute("SELECT gpu, tp, micro_batch, seq_len, dtype, torch, entry FROM layer_profiles "
                          "ORDER BY micro_batch").fetchall()
    assert [(r[0], r[1], r[2], r[3], r[4]) for r in rows] == [("P100", 1, 1, 16, "fp32"), ("P100", 1, 2, 16, "fp32")], rows
    for r in rows:
        assert r[5] == torch.__version__
        entry = json.loads(r[6])
        assert [b["layers"] for b in entry["blocks"]] == [1, 2, 4, 8] and entry["fwd_ms"] > 0, entry

    # Planned with them (whatever plan they made), the job trains as the single process does.
    rank0 = [p for p in logs if p.name == "rank-0.log"]
    assert len(rank0) == 1, f"{[str(p) for p in logs]}"
    got = [x for _, x in step_losses(rank0[0].read_text())]
    want = reference_losses(str(MODEL), spec["global_batch"], 16, STEPS, SEED)
    assert len(got) == STEPS, report
    assert_steps_close(got, want, layers_of(MODEL), "losses through dev up against the single process's")


def test_checkpoints_reach_the_bitmap_through_dev_up(tmp_path: Path):
    """The reference trainer checkpoints every 10 steps (the job file's `checkpoint: {every:
    10}`) into the MOTLEY_CKPT_DIR its agent gives it; the agents report the files their ranks' manifest pieces list; the coordinator's
    bitmap (read back from its database by a fresh coordinator, `motley ckpt list|show`) holds
    complete steps, every unit and rank file on the node that wrote it."""
    steps = 40
    spec = yaml.safe_load(JOB.read_text())
    spec["run"] = f"{shlex.quote(sys.executable)} -m motley_torch.train --steps {steps} --seed {SEED}"
    # The job file's checkpoint.every reaches the ranks as MOTLEY_CKPT_EVERY; the agents keep the
    # newest `keep` complete steps on disk (all four here).
    spec["checkpoint"] = {"every": 10, "keep": 4}
    spec["envs"] = dict(spec.get("envs") or {}, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "python"))
    job = tmp_path / "train-tiny-ckpt.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    work = tmp_path / "dev"
    res = dev_up(CLUSTER, job, work)
    assert res.returncode == 0, f"motley dev up exited {res.returncode}\n{res.stdout[-6000:]}\n{res.stderr[-3000:]}"
    written = sorted(p.parent.name for p in work.glob("agents/*/jobs/*/*/ckpt/step-*/manifest.rank.*.json"))
    assert "step-00000010" in written, written

    # A coordinator on the same data: the bitmap is durable.
    b = motley_bin()
    coord = subprocess.Popen([str(Path(b).with_name("motley-coordinator")), "--data-dir", str(work / "coordinator"),
                              "--insecure", "--listen", "127.0.0.1:0", "--grpc-listen", "127.0.0.1:0"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        url = "http://" + coord.stdout.readline().strip().rsplit("http://", 1)[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("MOTLEY_")}
        run = lambda *a: subprocess.run([b, "ckpt", *a, "--coordinator", url], capture_output=True, text=True,
                                        timeout=60, env=env, cwd=tmp_path)
        out = run("list", "1", "-o", "json")
        assert out.returncode == 0, out.stderr
        listed = json.loads(out.stdout)
        step10 = next(s for s in listed if s["step"] == 10)
        # tiny-dev: 4 layers; embed, 4 layers and head, model and optimizer parts, and a rank
        # file per rank of the plan.
        plan = json.loads(next(work.glob("agents/*/jobs/1/1/plan.json")).read_text())
        ranks = sum(len(st["gpus"]) for r in plan["replicas"] for st in r["stages"])
        assert step10["complete"] is True, step10
        assert step10["files"] == 2 * (1 + 4 + 1) + ranks, step10
        out = run("show", "1", "--step", "10")
        assert out.returncode == 0, out.stderr
        assert "step 10 (complete)" in out.stdout and "layer.3 optimizer tp 0/1" in out.stdout and "disk" in out.stdout, out.stdout
        out = run("show", "1", "--step", "11")
        assert out.returncode == 2 and "step 11" in out.stderr, out.stderr
    finally:
        coord.kill()
        coord.wait()
