"""A lost replica stops nobody else (docs/keep-going.md), the ranks' side: real rank processes
of a three-replica asymmetric plan (a two-stage pipeline beside two single-stage replicas) over
gloo. The test plays the agent: it kills a replica's processes with SIGKILL mid-run and writes
the membership the coordinator opens. The survivors abort the step in flight, meet in the new
epoch's store, re-split the same global batch and go on; every step's loss equals the single
process's over the same samples."""

from __future__ import annotations

import json
import math
import os
import signal
import time
from pathlib import Path

import pytest
import yaml

from launcher import (DATA, eval_losses, free_port, hand_plan, losses, reference_losses, single_process, start_ranks,
                      wait_ranks)
from tolerance import assert_close_rel, assert_steps_close, gradient_ops

STEPS = 8
# Saved every 4 steps: step 4 may meet the kill (its save is then given up), step 8, the last,
# is saved by the members alone in epoch 1 (no step commits without them before it). The step
# restored from it runs on to RESTORED_STEPS.
SAVE_EVERY, DEGRADED_SAVE, RESTORED_STEPS = 4, 8, 10
SEED = 5
MODEL = "tiny4.yaml"


def three_replicas() -> dict:
    spec = yaml.safe_load((DATA / MODEL).read_text())
    # Replica 0: two stages (ranks 0, 1); replicas 1 and 2: one GPU each (ranks 2, 3).
    return hand_plan(spec, 12, 2, [
        dict(micro_batches=3, stages=[dict(layers=[0, 2], tp=1, dp=1, gpus=[("a", 0)]),
                                      dict(layers=[2, 4], tp=1, dp=1, gpus=[("a", 1)])]),
        dict(micro_batches=2, stages=[dict(layers=[0, 4], tp=1, dp=1, gpus=[("b", 0)])]),
        dict(micro_batches=1, stages=[dict(layers=[0, 4], tp=1, dp=1, gpus=[("c", 0)])]),
    ])


def wait_for_line(path: Path, step: int, procs, timeout: float = 120.0):
    """Until the progress line of `step` is in `path` (ranks still running)."""
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        if path.exists() and any(json.loads(x).get("step") == step for x in path.read_text().splitlines()
                                 if x.startswith("{")):
            return
        dead = [r["rank"] for r, p, *_ in procs if p.poll() is not None]
        assert not dead, f"ranks {dead} ended before step {step}: {path.read_text() if path.exists() else ''}"
        time.sleep(0.05)
    raise AssertionError(f"no step {step} line in {path} within {timeout} s")


def progress(stdout: str):
    """The progress lines of a rank's output; of a log still being written, its whole lines only
    (the last piece may be a line half written)."""
    whole = stdout.split("\n")[:-1]
    return [d for d in (json.loads(x) for x in whole if x.startswith("{")) if "loss" in d]


def membership(epoch: int, replicas, lost, micro_batches, port: int, leader: int) -> str:
    return json.dumps({"epoch": epoch, "replicas": replicas, "lost": lost,
                       "micro_batches": {str(k): v for k, v in micro_batches.items()},
                       "store": {"host": "127.0.0.1", "port": port}, "leader": leader, "reason": "killed by the test"})


def write_membership(path: Path, text: str):
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@pytest.fixture(scope="module")
def reference_params(tmp_path_factory) -> Path:
    """The single process's parameters after STEPS steps (one run for the module)."""
    out = tmp_path_factory.mktemp("reference")
    single_process(str(DATA / MODEL), 12, 16, STEPS, SEED, out)
    return out / "params.safetensors"


@pytest.mark.parametrize("lost", ["pipeline-with-rank-0", "single-gpu-replica"])
def test_survivors_keep_training_through_a_lost_replica_with_the_single_process_losses(tmp_path, lost,
                                                                                      reference_params):
    plan = three_replicas()
    work = tmp_path / "run"
    member_file = work / "membership.json"
    want = reference_losses(str(DATA / MODEL), 12, 16, STEPS, SEED)
    ckpt = tmp_path / "ckpt"
    procs = start_ranks(plan, ["--steps", str(STEPS), "--seed", str(SEED), "--timeout", "60",
                               "--save-params", str(tmp_path / "params"), "--ckpt-dir", str(ckpt),
                               "--ckpt-every", str(SAVE_EVERY)], work,
                        extra_env={"MOTLEY_KEEP_GOING": "1", "MOTLEY_MEMBERSHIP": str(member_file)})
    try:
        wait_for_line(work / "rank0.out", 2, procs)
        if lost == "pipeline-with-rank-0":
            # The job's store goes with rank 0: the epoch's store moves to rank 2, the new leader.
            killed, doc = [0, 1], membership(1, [1, 2], [0], {1: 3, 2: 3}, free_port(), 2)
        else:
            killed, doc = [2], membership(1, [0, 2], [1], {0: 4, 2: 2}, int(procs[0][4]["MASTER_PORT"]), 0)
        for r, p, *_ in procs:
            if r["rank"] in killed:
                os.killpg(p.pid, signal.SIGKILL)
        time.sleep(0.3)  # the survivors' collectives fail first, as when a node vanishes
        write_membership(member_file, doc)
    finally:
        results = wait_ranks(procs, work, 180)
    by_rank = {r.rank: r for r in results}
    survivors = [r for r in results if r.rank not in killed]
    for r in survivors:
        assert r.returncode == 0, f"rank {r.rank} exit {r.returncode}\n{r.log[-4000:]}"
        assert "motley-membership epoch 1" in r.log, r.log[-3000:]
        assert "motley-keep-going on" in r.log
    leader = 2 if lost == "pipeline-with-rank-0" else 0
    check_lines(by_rank, survivors, leader, want)
    # --save-params at the end: the leader's replica writes the whole model and the leader merges
    # it, replica 0 lost or not; the parameters are the single process's.
    check_params(tmp_path / "params", reference_params)
    check_degraded_step(ckpt, killed, plan)


def check_lines(by_rank, survivors, leader: int, want):
    """Every step's line once, epoch 0's then 1's, with the single process's losses: rank 0's
    before the loss and the leader's after."""
    before = progress(by_rank[0].stdout)
    after = progress(by_rank[leader].stdout)
    if leader == 0:
        lines = after
    else:
        lines = before + after
        assert not [x for r in survivors if r.rank != leader for x in losses(r.stdout)], "only the leader prints"
    # A new leader prints the last committed step's line again, marked (its predecessor may have
    # gone before printing it): the same loss, and only when the leader changed. Where the old
    # leader went between a step's decision and the new leader's reading it, the new leader
    # commits that step itself ("committing step S as the others did") and prints its line
    # unmarked: the old leader may have printed it too, with the same loss.
    again = [x for x in lines if x.get("again")]
    rolled = leader != 0 and "as the others did" in by_rank[leader].log
    assert len(again) == (1 if leader != 0 and not rolled else 0), again
    first = {}
    for x in lines:
        assert first.setdefault(x["step"], x)["loss"] == x["loss"], (x, first[x["step"]])
    lines = [first[k] for k in sorted(first)]
    steps = [x["step"] for x in lines]
    assert steps == list(range(STEPS)), f"every step once, none lost or repeated: {steps}"
    assert {x["epoch"] for x in lines} == {0, 1} and [x["epoch"] for x in lines] == sorted(x["epoch"] for x in lines)
    assert_steps_close([x["loss"] for x in lines], want, 4, "losses through the loss against the single process's")


def check_params(params: Path, reference_params: Path):
    """The merged --save-params file holds the single process's parameters (compared normwise, as
    test_distributed compares a plan's: AdamW's steps on the rounding noise of a zero gradient
    differ in sign between any two runs)."""
    from safetensors.torch import load_file

    got, ref = load_file(str(params / "params.safetensors")), load_file(str(reference_params))
    assert sorted(got) == sorted(ref)
    assert not list(params.glob("params-stage*")), "the stage files are merged and removed"
    norm = max(t.abs().max().item() for t in ref.values())
    for k in sorted(got):
        assert_close_rel(got[k], ref[k], math.sqrt(STEPS) * gradient_ops(4), f"parameter {k} after {STEPS} steps",
                         scale=norm)


def test_a_survivor_that_missed_a_commit_rolls_it_forward_and_the_saves_stay_agreed(tmp_path, reference_params):
    """Replica 0 goes with rank 0, the store's host, after step 3 committed for ranks 0-2 and
    before rank 3 (held after its vote) read the decision. Rank 2 went on to save step 4, and
    its evaluation there failed; rank 3 commits step 3 as the others did. The two meet holding
    different saves (rank 2 step 4's, rank 3 none), so both give theirs up: had rank 2 kept it,
    its next save would agree on it in one all-reduce more than rank 3 runs, and the last
    agreement or --save-params' barrier would wait out the timeout. Rank 2 gives the rest of
    step 4's boundary up (the evaluation), as rank 3 never ran it. The losses, the parameters
    and the last save are the single process's, and the evaluation at the end is printed."""
    from test_train_data import dataset

    from motley_torch.components import checkpoint

    plan = three_replicas()
    work = tmp_path / "run"
    member_file, release = work / "membership.json", tmp_path / "release"
    want = reference_losses(str(DATA / MODEL), 12, 16, STEPS, SEED)
    ckpt = tmp_path / "ckpt"
    procs = start_ranks(plan, ["--steps", str(STEPS), "--seed", str(SEED), "--timeout", "60",
                               "--save-params", str(tmp_path / "params"), "--ckpt-dir", str(ckpt),
                               "--ckpt-every", str(SAVE_EVERY), "--eval-data", str(dataset(tmp_path / "eval.bin")),
                               "--eval-samples", "5", "--eval-every", str(SAVE_EVERY)], work,
                        extra_env={"MOTLEY_KEEP_GOING": "1", "MOTLEY_MEMBERSHIP": str(member_file)},
                        rank_env={3: {"MOTLEY_TEST_HOLD_AFTER_VOTE": f"3:{release}"}})
    try:
        # Rank 2's piece of step 4: it read step 3's decision and saved.
        piece = ckpt / checkpoint.step_dir_name(SAVE_EVERY) / checkpoint.piece_file_name(2)
        until = time.monotonic() + 120
        while not piece.exists():
            dead = [r["rank"] for r, p, *_ in procs if p.poll() is not None]
            assert not dead and time.monotonic() < until, f"no {piece}; ranks ended: {dead}"
            time.sleep(0.05)
        for r, p, *_ in procs:
            if r["rank"] in (0, 1):
                os.killpg(p.pid, signal.SIGKILL)
        time.sleep(0.3)
        write_membership(member_file, membership(1, [1, 2], [0], {1: 3, 2: 3}, free_port(), 2))
    finally:
        release.touch()
        results = wait_ranks(procs, work, 180)
    by_rank = {r.rank: r for r in results}
    survivors = [by_rank[2], by_rank[3]]
    for r in survivors:
        assert r.returncode == 0, f"rank {r.rank} exit {r.returncode}\n{r.log[-4000:]}"
    assert "committing step 3 as the others did" in by_rank[3].log, by_rank[3].log[-3000:]
    assert "redoing step 4" in by_rank[2].log, by_rank[2].log[-3000:]
    assert f"motley-checkpoint step {SAVE_EVERY} not saved: the members met holding different saves" in by_rank[2].log
    assert f"motley-eval before step {SAVE_EVERY} given up: a member was lost meanwhile" in by_rank[2].log
    assert [s for s, _ in eval_losses(by_rank[2].stdout)] == [STEPS], "the leader's evaluation at the end"
    check_lines(by_rank, survivors, 2, want)
    check_params(tmp_path / "params", reference_params)
    assert not (ckpt / checkpoint.step_dir_name(SAVE_EVERY) / checkpoint.MANIFEST).exists(), "the given-up save"
    m = checkpoint.verify_step(str(ckpt / checkpoint.step_dir_name(DEGRADED_SAVE)))
    assert m["lost_ranks"] == [0, 1] and [r["rank"] for r in m["ranks"]] == [0, 1, 2, 3], m["ranks"]


def check_degraded_step(ckpt: Path, killed, plan: dict):
    """The step saved while a replica was lost is whole: the leader's replica wrote every unit,
    the leader the lost ranks' rank files, the manifest names them lost; the Rust reader finds
    it complete; the whole plan restored from it goes on with the single process's losses."""
    import subprocess

    from launcher import check_ok, launch
    from test_checkpoint import ckpt_bin, step_files

    from motley_torch.components import checkpoint

    sdir = ckpt / checkpoint.step_dir_name(DEGRADED_SAVE)
    m = checkpoint.verify_step(str(sdir))
    assert m["lost_ranks"] == killed and [r["rank"] for r in m["ranks"]] == [0, 1, 2, 3], m["ranks"]
    assert not [r for r in killed if (sdir / checkpoint.piece_file_name(r)).exists()], "the lost ranks wrote nothing"
    for r in killed:
        h = checkpoint.read_header(str(sdir / checkpoint.rank_file_name(r)))
        assert h["rank"] == r and h["lost"]["epoch"] == 1 and h["lost"]["rng_of_rank"] not in killed, h
    out = subprocess.run([ckpt_bin(), "verify", str(sdir)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    res = launch(plan, ["--steps", str(RESTORED_STEPS), "--seed", str(SEED)], ckpt.parent / "restored",
                 extra_env={"MOTLEY_CKPT_RESTORE": json.dumps(step_files(sdir))})
    check_ok(res)
    lines = progress(res[0].stdout)
    assert [x["step"] for x in lines] == list(range(DEGRADED_SAVE, RESTORED_STEPS)), lines
    want = reference_losses(str(DATA / MODEL), 12, 16, RESTORED_STEPS, SEED)
    assert_steps_close([x["loss"] for x in lines], want[DEGRADED_SAVE:], 4,
                       "restored from the step saved while degraded, against the single process",
                       steps=range(DEGRADED_SAVE, RESTORED_STEPS))



def test_a_replica_lost_while_every_step_is_saved_stops_nobody_else(tmp_path):
    """A checkpoint after every step, written in the caller (--ckpt-sync): the kill lands in a
    step or in a save's agreement, whichever it meets; the survivors go on either way (a save
    whose agreement failed is given up on every member) with the single process's losses, and
    the last step saved is whole."""
    from motley_torch.components import checkpoint

    plan = three_replicas()
    work = tmp_path / "run"
    member_file = work / "membership.json"
    ckpt = tmp_path / "ckpt"
    want = reference_losses(str(DATA / MODEL), 12, 16, STEPS, SEED)
    procs = start_ranks(plan, ["--steps", str(STEPS), "--seed", str(SEED), "--timeout", "60", "--ckpt-dir", str(ckpt),
                               "--ckpt-every", "1", "--ckpt-sync"], work,
                        extra_env={"MOTLEY_KEEP_GOING": "1", "MOTLEY_MEMBERSHIP": str(member_file)})
    try:
        wait_for_line(work / "rank0.out", 2, procs)
        os.killpg({r["rank"]: p for r, p, *_ in procs}[2].pid, signal.SIGKILL)
        time.sleep(0.3)
        write_membership(member_file, membership(1, [0, 2], [1], {0: 4, 2: 2}, int(procs[0][4]["MASTER_PORT"]), 0))
    finally:
        results = wait_ranks(procs, work, 180)
    survivors = [r for r in results if r.rank != 2]
    for r in survivors:
        assert r.returncode == 0, f"rank {r.rank} exit {r.returncode}\n{r.log[-4000:]}"
    lines = progress({r.rank: r for r in results}[0].stdout)
    by_step = {}
    for x in lines:
        assert by_step.setdefault(x["step"], x["loss"]) == x["loss"], f"step {x['step']} printed twice, differently"
    assert sorted(by_step) == list(range(STEPS))
    assert_steps_close([by_step[s] for s in range(STEPS)], want, 4, "losses with a save after every step")
    m = checkpoint.verify_step(str(ckpt / checkpoint.step_dir_name(STEPS)))
    assert m["lost_ranks"] == [2] and [r["rank"] for r in m["ranks"]] == [0, 1, 2, 3], m["ranks"]


def test_two_losses_in_a_row_leave_the_last_replica_training_alone_with_the_same_losses(tmp_path):
    """Replica 1 first (epoch 1: the store stays with rank 0), then replica 0 with rank 0 and
    the store (epoch 2: rank 3 alone, hosting the store on another port); the last replica
    takes the whole global batch, and every step's loss is still the single process's."""
    plan = three_replicas()
    work = tmp_path / "run"
    member_file = work / "membership.json"
    want = reference_losses(str(DATA / MODEL), 12, 16, STEPS, SEED)
    procs = start_ranks(plan, ["--steps", str(STEPS), "--seed", str(SEED), "--timeout", "60"], work,
                        extra_env={"MOTLEY_KEEP_GOING": "1", "MOTLEY_MEMBERSHIP": str(member_file)})
    by = {r["rank"]: p for r, p, *_ in procs}
    try:
        wait_for_line(work / "rank0.out", 1, procs)
        os.killpg(by[2].pid, signal.SIGKILL)
        time.sleep(0.3)
        master = int(procs[0][4]["MASTER_PORT"])
        write_membership(member_file, membership(1, [0, 2], [1], {0: 4, 2: 2}, master, 0))
        until = time.monotonic() + 120
        while not any(x["epoch"] == 1 for x in progress((work / "rank0.out").read_text())):
            assert time.monotonic() < until and by[0].poll() is None, (work / "rank0.log").read_text()[-3000:]
            time.sleep(0.05)
        for r in (0, 1):
            os.killpg(by[r].pid, signal.SIGKILL)
        time.sleep(0.3)
        write_membership(member_file, membership(2, [2], [0, 1], {2: 6}, free_port(), 3))
    finally:
        results = wait_ranks(procs, work, 180)
    last = {r.rank: r for r in results}[3]
    assert last.returncode == 0, last.log[-4000:]
    assert "motley-membership epoch 1" in last.log and "motley-membership epoch 2" in last.log, last.log[-3000:]
    lines = progress({r.rank: r for r in results}[0].stdout) + progress(last.stdout)
    by_step = {}
    for x in lines:
        assert by_step.setdefault(x["step"], x["loss"]) == x["loss"], f"step {x['step']} printed twice, differently"
    assert sorted(by_step) == list(range(STEPS)), f"every step once: {sorted(by_step)}"
    assert [x["epoch"] for x in progress(last.stdout)][-1] == 2
    assert_steps_close([by_step[s] for s in range(STEPS)], want, 4, "losses through two losses")


# ---- through the real system: a coordinator (SQLite), three agents, the ranks -----------------

DEV_MODEL = DATA / "tiny-dev.yaml"
NIC = [{"name": "eth0", "kind": "ethernet", "gbps": 25}]
# n0 holds replica 0 (a two-stage pipeline with rank 0, the job's store); n1 and n2 one each.
NODES = [("n0", {"gpu": "P100", "gpus": 2, "nics": NIC}), ("n1", {"gpu": "P100", "gpus": 1, "nics": NIC}),
         ("n2", {"gpu": "P100", "gpus": 1, "nics": NIC})]


def three_node_job(steps: int, seed: int, **extra) -> dict:
    """A job pinned to a three-replica plan on NODES (bench/keep_going.py runs it too)."""
    import shlex
    import sys

    from launcher import REPO

    def stage(layers, node, gpu):
        return {"layers": layers, "gpu": "P100", "tp": 1, "dp": 1, "gpus": [{"node": node, "index": gpu}]}

    plan = {"global_batch": 12, "micro_batch": 2, "replicas": [
        {"samples": 6, "micro_batches": 3, "stages": [stage([0, 2], "n0", 0), stage([2, 4], "n0", 1)]},
        {"samples": 4, "micro_batches": 2, "stages": [stage([0, 4], "n1", 0)]},
        {"samples": 2, "micro_batches": 1, "stages": [stage([0, 4], "n2", 0)]}]}
    job = {"name": "keep-going", "model": yaml.safe_load(DEV_MODEL.read_text()), "global_batch": 12, "plan": plan,
           "run": f"{shlex.quote(sys.executable)} -m motley_torch.train --steps {steps} --seed {seed} --timeout 60",
           "envs": {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "python")}}
    job.update(extra)
    return job


def lines_of(log: Path) -> list:
    return progress(log.read_text()) if log.exists() else []


def test_a_lost_node_stops_only_its_replica_through_the_coordinator_and_agents(tmp_path):
    """Node n0 holds replica 0 (a two-stage pipeline with rank 0, the job's store) and is killed
    with its agent mid-run. The coordinator sees the lease lapse, opens epoch 1 (replicas 1 and
    2, the same global batch re-split), the job goes degraded and then succeeds under generation
    1; every step's loss is the single process's."""
    from test_recovery import Cluster

    spec = yaml.safe_load(DEV_MODEL.read_text())
    steps, seed = 120, 5
    c = Cluster(tmp_path, NODES)
    try:
        c.wait(lambda: sum(n["live"] for n in c.get("/api/v1/nodes")) == 3, 30)
        jid = c.submit(three_node_job(steps, seed))
        rank0 = tmp_path / "agents" / "n0" / "jobs" / str(jid) / "1" / "rank-0.log"
        c.wait(lambda: len(lines_of(rank0)) >= 20, 120, every=0.1)
        c.kill_node("n0")
        c.wait(lambda: c.get(f"/api/v1/jobs/{jid}")["state"] in ("succeeded", "failed", "cancelled"), 240, every=0.5)
        final = c.get(f"/api/v1/jobs/{jid}")
        events = c.events(jid)
        kinds = [e["kind"] for e in events]
        assert final["state"] == "succeeded", f"{final}\n{kinds}\n{c.logs()}"
        assert final["generation"] == 1 and final.get("reason") is None, final
        assert "recovering" not in kinds and "degraded" in kinds, kinds
        changed = [json.loads(e["message"]) for e in events if e["kind"] == "membership_changed"]
        assert len(changed) == 1, changed
        m = changed[0]
        assert (m["epoch"], m["replicas"], m["lost"], m["leader"]) == (1, [1, 2], [0], 2), m
        assert sum(m["micro_batches"].values()) == 6 and set(m["micro_batches"]) == {"1", "2"}, m
        assert "n0" in m["reason"], m
        after_log = tmp_path / "agents" / "n1" / "jobs" / str(jid) / "1" / "rank-2.log"
        before, after = lines_of(rank0), lines_of(after_log)
        assert after and after[-1]["epoch"] == 1 and {x["epoch"] for x in before} == {0}
        by_step = {}
        for x in before + after:
            assert by_step.setdefault(x["step"], x["loss"]) == x["loss"], f"step {x['step']} printed twice, differently"
        assert sorted(by_step) == list(range(steps)), "every step committed once, none lost"
        want = reference_losses(str(DEV_MODEL), 12, spec["seq_len"], steps, seed)
        assert_steps_close([by_step[s] for s in range(steps)], want, 4, "losses through the node loss")
    finally:
        c.close()


def test_a_coordinator_restarted_while_degraded_goes_on_from_its_recorded_membership(tmp_path):
    """n1 (replica 1) is lost; once the job is degraded the coordinator is killed and started
    again. The new leader reads the membership from its events, waits for the members' nodes
    only (n1 never comes back), and the job succeeds under generation 1 with one membership."""
    from test_recovery import Cluster

    spec = yaml.safe_load(DEV_MODEL.read_text())
    steps, seed = 160, 5
    c = Cluster(tmp_path, NODES)
    try:
        c.wait(lambda: sum(n["live"] for n in c.get("/api/v1/nodes")) == 3, 30)
        jid = c.submit(three_node_job(steps, seed))
        rank0 = tmp_path / "agents" / "n0" / "jobs" / str(jid) / "1" / "rank-0.log"
        c.wait(lambda: len(lines_of(rank0)) >= 20, 120, every=0.1)
        c.kill_node("n1")
        view = c.wait(lambda: (lambda j: j["state"] == "degraded" and j)(c.get(f"/api/v1/jobs/{jid}")), 60, every=0.1)
        # The job's view carries the membership in force (what `motley job list` shows as the share).
        m = view["membership"]
        assert (m["epoch"], m["replicas"], m["lost"]) == (1, [0, 2], [1]) and 0 < m["throughput_share"] <= 1, view
        c.kill_coordinator()
        c.start_coordinator()
        c.wait(lambda: c.get(f"/api/v1/jobs/{jid}")["state"] in ("succeeded", "failed", "cancelled"), 240, every=0.5)
        final = c.get(f"/api/v1/jobs/{jid}")
        kinds = [e["kind"] for e in c.events(jid)]
        assert final["state"] == "succeeded" and final["generation"] == 1, f"{final}\n{kinds}\n{c.logs()}"
        assert kinds.count("membership_changed") == 1 and "recovering" not in kinds, kinds
        lines = lines_of(rank0)
        assert sorted({x["step"] for x in lines}) == list(range(steps)) and lines[-1]["epoch"] == 1
        want = reference_losses(str(DEV_MODEL), 12, spec["seq_len"], steps, seed)
        assert_steps_close([x["loss"] for x in lines], want, 4, "losses through the loss and the restart")
    finally:
        c.close()


# A node of another GPU type (faster than the P100s), live while n2 stays away.
OTHER_TYPE = {"gpu": "V100-32G", "gpus": 1, "nics": NIC}


@pytest.mark.parametrize("back_as", ["n2", "n4"])
def test_a_lost_node_back_rejoins_its_replica_from_the_members_live_state(tmp_path, back_as):
    """n2 (replica 2) vanishes with its agent; the job goes on degraded. n2's agent comes back
    (or, `n4`, n2 stays away and a node of another GPU type is there: the spot node replaced by
    what the cloud had): the coordinator opens epoch 2 naming replica 2 `joining`, assigns its
    rank again (on n4, the plan amended for it, priced on its type and the batch split again)
    and starts it afresh in the same launch; the members move to epoch 2
    at a step boundary, the rank takes every layer's weights and AdamW state from them, and the
    job runs whole again (`rejoined`, `degraded -> running`) under generation 1, without a
    checkpoint (it has none), a restart or a restore; every step's loss, before, during and
    after, is the single process's."""
    from test_recovery import Cluster

    spec = yaml.safe_load(DEV_MODEL.read_text())
    steps, seed = 600, 5
    c = Cluster(tmp_path, NODES)
    try:
        c.wait(lambda: sum(n["live"] for n in c.get("/api/v1/nodes")) == 3, 30)
        jid = c.submit(three_node_job(steps, seed))
        rank0 = tmp_path / "agents" / "n0" / "jobs" / str(jid) / "1" / "rank-0.log"
        c.wait(lambda: len(lines_of(rank0)) >= 20, 120, every=0.1)
        c.kill_node("n2")
        c.wait(lambda: c.get(f"/api/v1/jobs/{jid}")["state"] == "degraded", 60, every=0.1)
        c.wait(lambda: [x["step"] for x in lines_of(rank0) if x["epoch"] == 1], 60, every=0.1)
        c.start_agent(back_as, dict(NODES)["n2"] if back_as == "n2" else OTHER_TYPE)
        c.wait(lambda: c.get(f"/api/v1/jobs/{jid}")["state"] in ("running", "succeeded", "failed", "cancelled"), 120,
               every=0.2)
        final = c.wait(lambda: (lambda j: j["state"] in ("succeeded", "failed", "cancelled") and j)(
            c.get(f"/api/v1/jobs/{jid}")), 240, every=0.5)
        events = c.events(jid)
        kinds = [e["kind"] for e in events]
        assert final["state"] == "succeeded" and final["generation"] == 1, f"{final}\n{kinds}\n{c.logs()}"
        assert final.get("reason") is None, final
        assert "recovering" not in kinds and "restore_planned" not in kinds, kinds
        changed = [json.loads(e["message"]) for e in events if e["kind"] == "membership_changed"]
        assert [(m["epoch"], m["replicas"], m["lost"], m.get("joining")) for m in changed] == [
            (1, [0, 1], [2], None), (2, [0, 1, 2], [], [2])], changed
        assert changed[1]["leader"] == 0, changed[1]
        if back_as == "n2":
            assert changed[1]["micro_batches"] == {"0": 3, "1": 2, "2": 1} and "n2" in changed[1]["reason"], changed[1]
        else:
            assert "n2 -> n4" in changed[1]["reason"] and "V100-32G" in changed[1]["reason"], changed[1]
            plan = c.get(f"/api/v1/jobs/{jid}/plan")["plan"]
            assert plan["replicas"][2]["stages"][0]["gpu"] == "V100-32G", plan["replicas"][2]
            assert plan["replicas"][2]["stages"][0]["gpus"] == [{"node": "n4", "index": 0}], plan["replicas"][2]
            split = {str(i): r["micro_batches"] for i, r in enumerate(plan["replicas"])}
            assert changed[1]["micro_batches"] == split and sum(split.values()) == 6, (changed[1], split)
        rejoined = [json.loads(e["message"]) for e in events if e["kind"] == "rejoined"]
        assert len(rejoined) == 1 and (rejoined[0]["epoch"], rejoined[0]["replica"], rejoined[0]["ranks"]) == (2, 2, [3])
        assert kinds.index("degraded") < kinds.index("membership_changed", kinds.index("degraded") + 1) < \
            kinds.index("running", kinds.index("degraded")) < kinds.index("rejoined"), kinds
        # The rank started afresh took its state from the members (its log; the one before the
        # loss kept beside it), and the job's last steps ran at full strength in epoch 2.
        n2 = tmp_path / "agents" / back_as / "jobs" / str(jid) / "1"
        took = next(json.loads(x.split(" ", 1)[1]) for x in (n2 / "rank-3.log").read_text().splitlines()
                    if x.startswith("motley-rejoined "))
        assert took["epoch"] == 2 and took["bytes"] > 0, took
        # The event carries what the rank copied, as its agent read it from the rank's file.
        assert (rejoined[0]["bytes"], rejoined[0]["copy_seconds"]) == (took["bytes"], took["copy_seconds"]), (rejoined, took)
        assert (n2 / "rank-3.log.before-2").exists() == (back_as == "n2"), "the log before the loss kept beside"
        lines = lines_of(rank0)
        assert [x["step"] for x in lines] == list(range(steps)), "every step once, rank 0 leading throughout"
        epochs = [x["epoch"] for x in lines]
        assert epochs == sorted(epochs) and set(epochs) == {0, 1, 2} and epochs[-1] == 2, sorted(set(epochs))
        want = reference_losses(str(DEV_MODEL), 12, spec["seq_len"], steps, seed)
        assert_steps_close([x["loss"] for x in lines], want, 4, "losses through the loss, the degraded steps and the rejoin")
    finally:
        c.close()


def test_a_notice_to_a_degraded_jobs_member_saves_now_and_recovers_from_that_step(tmp_path):
    """n2 (replica 2) vanishes: the job goes on degraded. n1, a member's node, is then drained
    with a deadline (a spot node's preemption notice): the members save at their next step (the
    job's `every` is far off), the step is whole without replica 2, and the job recovers whole
    from it. Its pinned plan waits for its nodes: n2 comes back, n1 is undrained, and generation
    2 runs on from the step saved on notice with the single process's losses."""
    from test_recovery import Cluster

    spec = yaml.safe_load(DEV_MODEL.read_text())
    steps, seed, every = 300, 7, 1000
    c = Cluster(tmp_path, NODES)
    try:
        c.wait(lambda: sum(n["live"] for n in c.get("/api/v1/nodes")) == 3, 30)
        jid = c.submit(three_node_job(steps, seed, checkpoint={"every": every, "keep": 2}, max_preemptions=2))
        rank0 = tmp_path / "agents" / "n0" / "jobs" / str(jid) / "1" / "rank-0.log"
        c.wait(lambda: len(lines_of(rank0)) >= 20, 120, every=0.1)
        c.kill_node("n2")
        c.wait(lambda: c.get(f"/api/v1/jobs/{jid}")["state"] == "degraded", 60, every=0.1)
        epoch1 = c.wait(lambda: [x["step"] for x in lines_of(rank0) if x["epoch"] == 1], 60, every=0.1)[0]
        c.node("drain", "n1", "--deadline", "60s", "-o", "json")
        c.wait(lambda: c.get(f"/api/v1/jobs/{jid}")["state"] == "recovering", 60, every=0.2)
        events = c.events(jid)
        notice = json.loads(next(e["message"] for e in events if e["kind"] == "preemption_notice"))
        assert notice["node"] == "n1" and notice["deadline_s"] == 60, notice
        recovering = next(e["message"] for e in events if e["kind"] == "recovering")
        assert "saved on notice" in recovering, recovering
        c.start_agent("n2", dict(NODES)["n2"])
        c.node("undrain", "n1")
        c.wait(lambda: c.get(f"/api/v1/jobs/{jid}")["state"] in ("succeeded", "failed", "cancelled"), 240, every=0.5)
        final, events = c.get(f"/api/v1/jobs/{jid}"), c.events(jid)
        kinds = [e["kind"] for e in events]
        assert final["state"] == "succeeded" and final["generation"] == 2, f"{final}\n{kinds}\n{c.logs()}"
        planned = json.loads(next(e["message"] for e in events if e["kind"] == "recovery_planned"))
        restored = planned["step"]
        assert epoch1 <= restored < every, (planned, epoch1)
        after = lines_of(tmp_path / "agents" / "n0" / "jobs" / str(jid) / "2" / "rank-0.log")
        assert [x["step"] for x in after] == list(range(restored, steps)), after[:3]
        want = reference_losses(str(DEV_MODEL), 12, spec["seq_len"], steps, seed)
        assert_steps_close([x["loss"] for x in after], want[restored:], 4,
                           "generation 2's losses from the step saved on notice while degraded", steps=range(restored, steps))
    finally:
        c.close()
