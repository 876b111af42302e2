"""Elastic recovery through the real system (docs/recovery.md): a coordinator (SQLite) and three
motley-agents as processes on loopback, the reference trainer on every rank (CPU, gloo). The
job checkpoints every few steps into the agents' memory tier; the agents move complete steps to
disk and upload them to a file:// cloud. One node is killed (its agent and its ranks, as a spot
node vanishes): the job goes `recovering`, is planned again on the two nodes left, the restore
plan reads what the survivors hold and fetches the dead node's layers from the cloud, the
agents verify every file and the ranks start under the next generation from the restored step.
The job succeeds, and the losses after the restore equal an uninterrupted single-process run's
within fp32 rounding (tolerance.py) from that step on."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from launcher import DATA, REPO, free_port, kill_group, motley_bin, reference_losses
from tolerance import assert_steps_close, layers_of

MODEL = DATA / "tiny-dev.yaml"
# Long enough that the first generation is still running when a node goes (it had reached steps
# 10-39 in runs on 2-core machines: the loss waits for a step whole in the cloud, or a join, or
# five steps), short enough that the generation after the restore is not most of the test.
STEPS = 120
EVERY = 20
SEED = 5
GLOBAL_BATCH = 8


def bins() -> dict:
    b = motley_bin()
    assert b is not None, "no motley binary: set MOTLEY_BIN (python/run-tests does) or build target/ci/motley"
    out = {"motley": b}
    for sib in ("motley-coordinator", "motley-agent"):
        p = Path(b).with_name(sib)
        assert os.access(p, os.X_OK), f"{sib} is not next to {b}"
        out[sib] = str(p)
    return out


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOTLEY_", "NCCL_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RUST_LOG="info")
    env.update(extra)
    return env


class Cluster:
    """A coordinator and one agent per node, each in its own process group."""

    def __init__(self, tmp: Path, nodes: list, heartbeat_ms: int = 250, nic_mb_s: float = 0.0):
        self.tmp, self.b, self.procs, self.agents = tmp, bins(), [], {}
        self.heartbeat_ms, self.nic_mb_s = heartbeat_ms, nic_mb_s
        # Fixed ports: a restarted coordinator is where the agents look for it.
        self.ports = (free_port(), free_port())
        self.start_coordinator()
        for name, entry in nodes:
            self.start_agent(name, entry)

    def start_coordinator(self):
        log = open(self.tmp / "coordinator.log", "a")
        self.coord = subprocess.Popen(
            [self.b["motley-coordinator"], "--data-dir", str(self.tmp / "coordinator"), "--insecure", "--listen",
             f"127.0.0.1:{self.ports[0]}", "--grpc-listen", f"127.0.0.1:{self.ports[1]}", "--heartbeat-ms", str(self.heartbeat_ms)],
            stdout=subprocess.PIPE, stderr=log, text=True, env=clean_env(), start_new_session=True)
        self.procs.append(self.coord)
        # "motley-coordinator listening on URL", then "motley-coordinator agents on URL".
        self.rest = self.coord.stdout.readline().strip().rsplit(" ", 1)[-1]
        self.grpc = self.coord.stdout.readline().strip().rsplit(" ", 1)[-1]

    def kill_coordinator(self):
        self.coord.kill()
        self.coord.wait()

    def start_agent(self, name: str, entry: dict):
        inv = self.tmp / f"{name}.yaml"
        inv.write_text(yaml.safe_dump(entry))
        log = open(self.tmp / f"agent-{name}.log", "w")
        p = subprocess.Popen(
            [self.b["motley-agent"], "--coordinator", self.grpc, "--node", name, "--inventory", str(inv), "--work-dir",
             str(self.tmp / "agents" / name), "--shm-dir", str(self.tmp / "shm" / name), "--allow-root-ranks",
             "--logs-listen", "127.0.0.1:0", "--data-listen", "127.0.0.1:0", "--ckpt-nic-mb-s", str(self.nic_mb_s)],
            stdout=log, stderr=subprocess.STDOUT, env=clean_env(), start_new_session=True)
        self.procs.append(p)
        self.agents[name] = p

    def get(self, path: str):
        for attempt in range(50):
            try:
                with urllib.request.urlopen(self.rest + path, timeout=10) as r:
                    return json.loads(r.read())
            except urllib.error.URLError:
                if attempt == 49:
                    raise
                time.sleep(0.2)  # a coordinator restarting

    def submit(self, spec: dict) -> int:
        req = urllib.request.Request(self.rest + "/api/v1/jobs", data=yaml.safe_dump(spec).encode(), method="POST",
                                     headers={"Content-Type": "application/yaml"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())["id"]

    def events(self, job: int) -> list:
        return self.get(f"/api/v1/jobs/{job}/events")

    def wait(self, what, timeout: float, every: float = 0.2):
        end = time.time() + timeout
        while time.time() < end:
            v = what()
            if v:
                return v
            time.sleep(every)
        raise AssertionError(f"timed out after {timeout} s\n{self.logs()}")

    def node(self, *args: str) -> subprocess.CompletedProcess:
        """`motley node ARGS` against this coordinator; a non-zero exit fails the test."""
        return subprocess.run([self.b["motley"], "node", *args, "--coordinator", self.rest], capture_output=True, text=True,
                              env=clean_env(), timeout=30, check=True)

    def kill_node(self, name: str):
        """SIGKILL the node's agent and every rank it started (as a vanished spot node)."""
        self.agents[name].kill()
        self.agents[name].wait()
        kill_ranks(name, self.tmp)

    def logs(self) -> str:
        out = []
        for f in sorted(self.tmp.glob("*.log")):
            out.append(f"--- {f.name}\n{f.read_text()[-3000:]}")
        return "\n".join(out)

    def close(self):
        for p in self.procs:
            kill_group(p)
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    env = Path(f"/proc/{pid}/environ").read_bytes()
                except OSError:
                    continue
                if str(self.tmp).encode() in env and b"MOTLEY_JOB=" in env:
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except OSError:
                        pass


def kill_ranks(node: str, within: Path):
    """SIGKILL every process an agent of the cluster under `within` started as a rank of `node`
    (its wrapper and the rank): another cluster's node of the same name, a test or bench
    running beside this one, is not touched (its ranks' environment names its own directory)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            raw = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        env = raw.split(b"\0")
        if f"MOTLEY_NODE={node}".encode() in env and str(within).encode() in raw:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass


def node_entry() -> dict:
    return {"gpu": "P100", "gpus": 1, "nics": [{"name": "eth0", "kind": "ethernet", "gbps": 25}]}


def rank0_losses(work: Path, job: int, generation: int) -> list:
    """The (step, loss) lines global rank 0 of a launch printed, from its log on its node."""
    for log in work.glob(f"agents/*/jobs/{job}/{generation}/rank-0.log"):
        out = []
        for line in log.read_text().splitlines():
            if line.startswith("{"):
                d = json.loads(line)
                if "loss" in d:
                    out.append((d["step"], d["loss"]))
        return out
    return []


def tiny_job(tmp: Path, steps: int = STEPS) -> dict:
    return {
        "name": "recover-tiny",
        "model": yaml.safe_load(MODEL.read_text()),
        "global_batch": GLOBAL_BATCH,
        # CPU ranks: the GPUs' compute priced alone (no launch floor), so the plan spans the nodes.
        "plan_options": {"host_layer_ms": 0},
        "run": f"{shlex.quote(sys.executable)} -m motley_torch.train --steps {steps} --seed {SEED}",
        "envs": {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "python")},
        "checkpoint": {"every": EVERY, "keep": 2, "cloud": f"file://{tmp / 'cloud'}"},
        "max_preemptions": 1,
    }


def plan_nodes(plan: dict) -> set:
    """The nodes a plan document places ranks on."""
    return {g["node"] for r in plan["replicas"] for s in r["stages"] for g in s["gpus"]}


def run_job(c: Cluster, job: dict) -> tuple:
    """Once every agent is live, submit `job`, wait until it runs: its id and plan."""
    c.wait(lambda: sum(n["live"] for n in c.get("/api/v1/nodes")) == len(c.agents), 30)
    jid = c.submit(job)
    c.wait(lambda: c.get(f"/api/v1/jobs/{jid}")["state"] == "running", 60)
    return jid, c.get(f"/api/v1/jobs/{jid}/plan")["plan"]


def sleeping_job(tmp: Path) -> dict:
    """tiny_job whose ranks never look at a notice (nor train): `sleep`."""
    job = tiny_job(tmp)
    job["run"] = "sleep 600"
    return job


def run_until_a_step_is_in_the_cloud(c: Cluster, job: dict) -> tuple:
    """Submit `job`, wait until some complete step is whole in the cloud, and name the node of
    the plan's last stage (its layers and head exist nowhere else but the cloud)."""
    jid, plan = run_job(c, job)

    def cloud_step():
        steps = c.get(f"/api/v1/jobs/{jid}/checkpoints")
        grid = [c.get(f"/api/v1/jobs/{jid}/checkpoints/grid?step={s['step']}") for s in steps if s["complete"]]
        return any(all("cloud" in sum(r["held"].values(), []) for r in g["rows"]) for g in grid)
    c.wait(cloud_step, 120)
    state = c.get(f"/api/v1/jobs/{jid}")["state"]
    assert state == "running", f"the job ended ({state}) before a node could be lost; raise STEPS"
    last = plan["replicas"][0]["stages"][-1]["gpus"][0]["node"]
    return jid, last


def test_a_lost_node_recovers_from_peers_and_the_cloud_with_the_same_losses(tmp_path: Path):
    c = Cluster(tmp_path, [(f"n{i}", node_entry()) for i in range(3)])
    try:
        spec = yaml.safe_load(MODEL.read_text())
        jid, victim = run_until_a_step_is_in_the_cloud(c, tiny_job(tmp_path))
        c.kill_node(victim)
        c.wait(lambda: c.get(f"/api/v1/jobs/{jid}")["state"] in ("succeeded", "failed", "cancelled"), 240, every=0.5)
        final = c.get(f"/api/v1/jobs/{jid}")
        events = c.events(jid)
        kinds = [e["kind"] for e in events]
        assert final["state"] == "succeeded", f"{final}\n{kinds}\n{c.logs()}"
        assert final["generation"] == 2, final
        assert "recovering" in kinds, kinds
        planned = json.loads(next(e["message"] for e in events if e["kind"] == "recovery_planned"))
        done = json.loads(next(e["message"] for e in events if e["kind"] == "recovery_done"))
        step = planned["step"]
        assert step >= EVERY and step % EVERY == 0, planned
        assert planned["lower_bound_s"] >= 0 and planned["bytes"]["cloud"] > 0, planned
        assert done["step"] == step and done["transfer_s"] >= 0 and done["total_s"] >= done["transfer_s"], done
        assert done["bytes"]["cloud"] > 0, f"the dead node's units came from the cloud: {done}"
        assert done["bytes"]["local"] + done["bytes"]["peer"] > 0, f"the survivors' units came from them: {done}"
        new_plan = c.get(f"/api/v1/jobs/{jid}/plan")["plan"]
        assert victim not in plan_nodes(new_plan)
        # The losses after the restore are the uninterrupted run's.
        after = rank0_losses(tmp_path, jid, 2)
        assert after and after[0][0] == step, (step, after[:3])
        reference = reference_losses(str(MODEL), GLOBAL_BATCH, spec["seq_len"], STEPS, SEED)
        assert_steps_close([x for _, x in after], [reference[s] for s, _ in after], layers_of(MODEL),
                           "losses after the restore against the uninterrupted run's", steps=[s for s, _ in after])
        assert after[-1][0] == STEPS - 1
    finally:
        c.close()


def test_a_coordinator_failover_mid_restore_resumes_and_skips_what_verifies(tmp_path: Path):
    """The restore is slowed (1 MB/s per node) so the coordinator can be killed while the agents
    fetch; a new coordinator on the same database finds the job recovering, plans it again, and
    the agents keep the files they had already placed (recovery_done counts them as skipped)."""
    c = Cluster(tmp_path, [(f"n{i}", node_entry()) for i in range(3)], nic_mb_s=1.0)
    try:
        jid, victim = run_until_a_step_is_in_the_cloud(c, tiny_job(tmp_path))
        c.kill_node(victim)
        c.wait(lambda: any(e["kind"] == "recovery_planned" for e in c.events(jid)), 60)
        c.kill_coordinator()
        time.sleep(0.5)
        c.start_coordinator()
        c.wait(lambda: c.get(f"/api/v1/jobs/{jid}")["state"] in ("succeeded", "failed", "cancelled"), 240, every=0.5)
        final, events = c.get(f"/api/v1/jobs/{jid}"), c.events(jid)
        kinds = [e["kind"] for e in events]
        assert final["state"] == "succeeded", f"{final}\n{kinds}\n{c.logs()}"
        assert final["generation"] == 2, final
        assert kinds.count("recovering") == 1, kinds
        assert kinds.count("recovery_planned") >= 2, f"the new leader planned the restore again: {kinds}"
        done = json.loads(next(e["message"] for e in events if e["kind"] == "recovery_done"))
        assert done["skipped"] > 0, f"files restored before the failover are kept: {done}"
    finally:
        c.close()


def test_a_node_that_joins_restarts_nothing_when_the_plan_would_not_use_it(tmp_path: Path):
    """Two nodes run the job; a third registers. At the next checkpoint the coordinator asks the
    planner whether the job would get more GPUs now; for this tiny model on slow Ethernet it
    would not (two pipeline stages are best), so the job is not restarted: it runs on in its
    first generation."""
    c = Cluster(tmp_path, [(f"n{i}", node_entry()) for i in range(2)])
    try:
        job = tiny_job(tmp_path, steps=100_000)
        job["max_preemptions"] = 0
        jid, first = run_job(c, job)
        assert plan_nodes(first) == {"n0", "n1"}
        c.start_agent("n2", node_entry())
        said = "no scale-up: with 3 live nodes the planner gives it 2 GPUs, it has 2"
        c.wait(lambda: said in (tmp_path / "coordinator.log").read_text(), 120, every=0.5)
        # Two more checkpoints: the answer stands, nothing restarts.
        seen = max(s["step"] for s in c.get(f"/api/v1/jobs/{jid}/checkpoints") if s["complete"])
        c.wait(lambda: max(s["step"] for s in c.get(f"/api/v1/jobs/{jid}/checkpoints") if s["complete"]) >= seen + 2 * EVERY, 120)
        job_now, kinds = c.get(f"/api/v1/jobs/{jid}"), [e["kind"] for e in c.events(jid)]
        assert job_now["state"] == "running" and job_now["generation"] == 1, f"{job_now}\n{kinds}\n{c.logs()}"
        assert "recovering" not in kinds, kinds
        assert (tmp_path / "coordinator.log").read_text().count(said) == 1, "asked once per node that joined"
    finally:
        c.close()


def test_a_second_node_lost_during_the_restore_is_planned_around(tmp_path: Path):
    """Four nodes; the job runs on some of them. One is killed; while the agents restore (paced
    at 1 MB/s) a node of the new plan is killed too: the recovery plans again without it
    (`recovery_retry`), spends no second budget, and the job succeeds on what is left."""
    c = Cluster(tmp_path, [(f"n{i}", node_entry()) for i in range(4)], nic_mb_s=1.0)
    try:
        jid, victim = run_until_a_step_is_in_the_cloud(c, tiny_job(tmp_path))
        c.kill_node(victim)
        planned = c.wait(lambda: [json.loads(e["message"]) for e in c.events(jid) if e["kind"] == "recovery_planned"], 60)
        second = next(n for n in planned[0]["nodes"] if n != victim)
        c.kill_node(second)
        c.wait(lambda: c.get(f"/api/v1/jobs/{jid}")["state"] in ("succeeded", "failed", "cancelled"), 240, every=0.5)
        final, events = c.get(f"/api/v1/jobs/{jid}"), c.events(jid)
        kinds = [e["kind"] for e in events]
        assert final["state"] == "succeeded", f"{final}\n{kinds}\n{c.logs()}"
        assert kinds.count("recovering") == 1 and "recovery_retry" in kinds, kinds
        plan = c.get(f"/api/v1/jobs/{jid}/plan")["plan"]
        used = plan_nodes(plan)
        assert not used & {victim, second}, (used, victim, second)
    finally:
        c.close()


def test_a_preemption_notice_saves_now_and_recovers_from_that_step(tmp_path: Path):
    """The job checkpoints only every 100000 steps, so no regular step exists. Its last stage's
    node is drained with a 60 s deadline (a spot node's preemption notice): the agents tell the
    ranks, the ranks agree on a step and save it, and once it is complete the job recovers off
    the node from that step (the draining node's copies serve the restore) with the
    uninterrupted run's losses."""
    c = Cluster(tmp_path, [(f"n{i}", node_entry()) for i in range(3)])
    try:
        spec = yaml.safe_load(MODEL.read_text())
        job = tiny_job(tmp_path)
        job["checkpoint"]["every"] = 100_000
        jid, plan = run_job(c, job)
        victim = plan["replicas"][0]["stages"][-1]["gpus"][0]["node"]
        c.wait(lambda: len(rank0_losses(tmp_path, jid, 1)) >= 5, 120)
        out = c.node("drain", victim, "--deadline", "60s", "-o", "json")
        assert json.loads(out.stdout)["state"] == "draining"
        c.wait(lambda: c.get(f"/api/v1/jobs/{jid}")["state"] in ("succeeded", "failed", "cancelled"), 240, every=0.5)
        final, events = c.get(f"/api/v1/jobs/{jid}"), c.events(jid)
        kinds = [e["kind"] for e in events]
        assert final["state"] == "succeeded", f"{final}\n{kinds}\n{c.logs()}"
        assert final["generation"] == 2, final
        notice = json.loads(next(e["message"] for e in events if e["kind"] == "preemption_notice"))
        assert notice["node"] == victim and notice["newest_step"] == -1 and notice["deadline_s"] == 60, notice
        recovering = next(e["message"] for e in events if e["kind"] == "recovering")
        assert "saved on notice" in recovering, recovering
        planned = json.loads(next(e["message"] for e in events if e["kind"] == "recovery_planned"))
        step = planned["step"]
        assert step >= 5, f"the step saved on notice, not a fresh start: {planned}"
        new_plan = c.get(f"/api/v1/jobs/{jid}/plan")["plan"]
        assert victim not in plan_nodes(new_plan)
        after = rank0_losses(tmp_path, jid, 2)
        assert after and after[0][0] == step, (step, after[:3])
        reference = reference_losses(str(MODEL), GLOBAL_BATCH, spec["seq_len"], STEPS, SEED)
        assert_steps_close([x for _, x in after], [reference[s] for s, _ in after], layers_of(MODEL),
                           "losses after the restore against the uninterrupted run's", steps=[s for s, _ in after])
    finally:
        c.close()


def test_a_node_that_joins_takes_the_job_up_at_its_next_checkpoint(tmp_path: Path):
    """One node runs the job (the planner has nothing else); a second registers. The planner
    would give the job two GPUs now, so at its next complete checkpoint the job moves to
    `recovering` (a scale-up, spending no budget), is restored onto both nodes from that step
    and succeeds with the uninterrupted run's losses."""
    c = Cluster(tmp_path, [("n0", node_entry())])
    try:
        spec = yaml.safe_load(MODEL.read_text())
        job = tiny_job(tmp_path)
        job["max_preemptions"] = 0
        jid, first = run_job(c, job)
        assert plan_nodes(first) == {"n0"}
        c.start_agent("n1", node_entry())
        c.wait(lambda: c.get(f"/api/v1/jobs/{jid}")["state"] in ("succeeded", "failed", "cancelled"), 240, every=0.5)
        final, events = c.get(f"/api/v1/jobs/{jid}"), c.events(jid)
        kinds = [e["kind"] for e in events]
        assert final["state"] == "succeeded" and final["generation"] == 2, f"{final}\n{kinds}\n{c.logs()}"
        recovering = next(e["message"] for e in events if e["kind"] == "recovering")
        assert "scaling up from step" in recovering, recovering
        planned = json.loads(next(e["message"] for e in events if e["kind"] == "recovery_planned"))
        step = planned["step"]
        assert step >= EVERY and step % EVERY == 0, planned
        assert planned["bytes"]["peer"] + planned["bytes"]["local"] > 0, planned
        plan = c.get(f"/api/v1/jobs/{jid}/plan")["plan"]
        assert plan_nodes(plan) == {"n0", "n1"}, plan
        after = rank0_losses(tmp_path, jid, 2)
        assert after and after[0][0] == step, (step, after[:3])
        reference = reference_losses(str(MODEL), GLOBAL_BATCH, spec["seq_len"], STEPS, SEED)
        assert_steps_close([x for _, x in after], [reference[s] for s, _ in after], layers_of(MODEL),
                           "losses after the restore against the uninterrupted run's", steps=[s for s, _ in after])
    finally:
        c.close()


def test_a_notice_the_ranks_ignore_recovers_at_the_deadline_and_an_undrain_withdraws_it(tmp_path: Path):
    """Ranks that never look at MOTLEY_CKPT_NOTICE (a plain `sleep`): a notice withdrawn by an
    undrain leaves the job running where it is; a second notice with a 3 s deadline moves the
    job off the node at the deadline, from what it has (here nothing: it starts over)."""
    c = Cluster(tmp_path, [(f"n{i}", node_entry()) for i in range(3)])
    try:
        jid, plan = run_job(c, sleeping_job(tmp_path))
        victim = plan["replicas"][0]["stages"][-1]["gpus"][0]["node"]
        c.node("drain", victim, "--deadline", "30s")
        notice = c.wait(lambda: [e for e in c.events(jid) if e["kind"] == "preemption_notice"], 10)
        # The agent put the notice where the ranks look.
        noticed = tmp_path / "agents" / victim / "jobs" / str(jid) / "1" / "notice.json"
        c.wait(noticed.exists, 10)
        assert json.loads(noticed.read_text())["deadline_unix_ms"] >= notice[0]["at_ms"] + 29_000
        c.node("undrain", victim)
        c.wait(lambda: "the drain was withdrawn" in (tmp_path / "coordinator.log").read_text(), 10)
        job_now = c.get(f"/api/v1/jobs/{jid}")
        assert job_now["state"] == "running" and job_now["generation"] == 1, job_now
        c.node("drain", victim, "--deadline", "3s")
        c.wait(lambda: any(e["kind"] == "recovering" for e in c.events(jid)), 30)
        events = c.events(jid)
        second = [e for e in events if e["kind"] == "preemption_notice"][1]
        recovering = next(e for e in events if e["kind"] == "recovering")
        assert "no step saved by the deadline" in recovering["message"], recovering
        assert recovering["at_ms"] - second["at_ms"] >= 3000, (second, recovering)
        c.wait(lambda: c.get(f"/api/v1/jobs/{jid}")["generation"] == 2, 60)
        planned = next(e["message"] for e in c.events(jid) if e["kind"] == "recovery_planned")
        assert "starts over from step 0" in planned, planned
    finally:
        c.close()


def test_a_new_leader_finishes_a_notice_an_old_one_gave(tmp_path: Path):
    """The coordinator that gave a notice (8 s deadline; ranks that ignore it) is killed and
    started again on the same database: the new leader takes the notice over from its durable
    event and moves the job off the draining node at the original deadline. (Without that the
    job would run on there: the node is draining, not lost.)"""
    c = Cluster(tmp_path, [(f"n{i}", node_entry()) for i in range(3)])
    try:
        jid, plan = run_job(c, sleeping_job(tmp_path))
        victim = plan["replicas"][0]["stages"][-1]["gpus"][0]["node"]
        c.node("drain", victim, "--deadline", "8s")
        notice = c.wait(lambda: [e for e in c.events(jid) if e["kind"] == "preemption_notice"], 10)[0]
        c.kill_coordinator()
        c.start_coordinator()
        c.wait(lambda: any(e["kind"] == "recovering" for e in c.events(jid)), 60, every=0.5)
        recovering = next(e for e in c.events(jid) if e["kind"] == "recovering")
        assert "no step saved by the deadline" in recovering["message"], recovering
        assert recovering["at_ms"] >= notice["at_ms"] + 8000, (notice, recovering)
        assert "preemption notice taken over" in (tmp_path / "coordinator.log").read_text()
        c.wait(lambda: c.get(f"/api/v1/jobs/{jid}")["generation"] == 2, 60)
        plan = c.get(f"/api/v1/jobs/{jid}/plan")["plan"]
        assert victim not in plan_nodes(plan)
    finally:
        c.close()


def test_a_second_notice_only_brings_the_deadline_forward(tmp_path: Path):
    """Two nodes of one launch get notices (60 s, then 3 s; ranks that ignore them): the
    ranks are asked once (every node holds the first notice's number), and the job moves off
    both nodes at the earlier deadline."""
    c = Cluster(tmp_path, [(f"n{i}", node_entry()) for i in range(3)])
    try:
        jid, plan = run_job(c, sleeping_job(tmp_path))
        used = sorted(plan_nodes(plan))
        assert len(used) >= 2, plan
        first, second = used[0], used[1]
        c.node("drain", first, "--deadline", "60s")
        c.node("drain", second, "--deadline", "3s")
        c.wait(lambda: any(e["kind"] == "recovering" for e in c.events(jid)), 30)
        events = c.events(jid)
        notices = [e for e in events if e["kind"] == "preemption_notice"]
        recovering = next(e for e in events if e["kind"] == "recovering")
        assert len(notices) == 2 and json.loads(notices[1]["message"])["nodes"] == [], notices
        assert "no step saved by the deadline" in recovering["message"], recovering
        assert recovering["at_ms"] - notices[1]["at_ms"] < 30_000, "the earlier deadline, not the first notice's"
        numbers = {json.loads(p.read_text())["notice"] for p in tmp_path.glob(f"agents/*/jobs/{jid}/1/notice.json")}
        assert len(numbers) == 1, numbers
        c.wait(lambda: c.get(f"/api/v1/jobs/{jid}")["generation"] == 2, 60)
        after = c.get(f"/api/v1/jobs/{jid}/plan")["plan"]
        assert not {first, second} & plan_nodes(after)
    finally:
        c.close()


def test_withdrawing_one_of_two_notices_keeps_the_other(tmp_path: Path):
    """Notices for two nodes of one launch (8 s, then 4 s; ranks that ignore them); the second
    node is undrained at once: the first notice still stands, and the job moves off its node at
    its deadline, not at the withdrawn one's."""
    c = Cluster(tmp_path, [(f"n{i}", node_entry()) for i in range(3)])
    try:
        jid, plan = run_job(c, sleeping_job(tmp_path))
        used = sorted(plan_nodes(plan))
        assert len(used) >= 2, plan
        first, second = used[0], used[1]
        c.node("drain", first, "--deadline", "8s")
        c.node("drain", second, "--deadline", "4s")
        c.node("undrain", second)
        c.wait(lambda: any(e["kind"] == "recovering" for e in c.events(jid)), 30)
        events = c.events(jid)
        given = next(e for e in events if e["kind"] == "preemption_notice")
        recovering = next(e for e in events if e["kind"] == "recovering")
        assert f"node {first} is draining" in recovering["message"], recovering
        assert recovering["at_ms"] - given["at_ms"] >= 8000, (given, recovering)
        assert f"node {first}'s notice still stands" in (tmp_path / "coordinator.log").read_text()
        c.wait(lambda: c.get(f"/api/v1/jobs/{jid}")["generation"] == 2, 60)
        after = c.get(f"/api/v1/jobs/{jid}/plan")["plan"]
        assert first not in plan_nodes(after)
    finally:
        c.close()
