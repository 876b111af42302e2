"""A lost replica rejoins from its peers' live state (docs/keep-going.md, "Back to full
strength"), the ranks' side: real rank processes of the three-replica asymmetric plan over
gloo, the test playing the agent. A replica is killed and left out (epoch 1); later its ranks
are started afresh in the same launch under epoch 2, which names it `joining`. The members move
to epoch 2 at a step boundary without stopping, the joining ranks take every layer's weights and
AdamW state from the members' live state, and the job goes on at full strength: every step's
loss, before, during and after, is the single process's, and so are the final parameters."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from launcher import (DATA, PYTHON, RankResult, free_port, hand_plan, reference_losses, single_process, start_ranks,
                      wait_ranks)
from test_keep_going import MODEL, SEED, progress, three_replicas, wait_for_line, write_membership
from tolerance import assert_close_rel, assert_steps_close, gradient_ops

# Long enough that the joining ranks (an interpreter, torch, the model: seconds here) are ready
# well before the end: the members train on, degraded, until they are.
STEPS = 400
TP_STEPS = 150
FULL = {0: 3, 1: 2, 2: 1}


def membership(epoch: int, replicas, lost, micro_batches, port: int, leader: int, joining=()) -> str:
    doc = {"epoch": epoch, "replicas": replicas, "lost": lost,
           "micro_batches": {str(k): v for k, v in micro_batches.items()},
           "store": {"host": "127.0.0.1", "port": port}, "leader": leader, "reason": "played by the test"}
    if joining:
        doc["joining"] = list(joining)
    return json.dumps(doc)


def restart(procs, rank: int, args, work: Path):
    """Rank `rank` started again as the agent starts a joining rank: the launch's environment."""
    r, _, _, _, env = next(x for x in procs if x[0]["rank"] == rank)
    out = open(work / f"rank{rank}.rejoin.out", "w")
    err = open(work / f"rank{rank}.rejoin.log", "w")
    p = subprocess.Popen([PYTHON, "-m", "motley_torch.train", *args], env=env, stdout=out, stderr=err, cwd=work,
                         stdin=subprocess.DEVNULL, start_new_session=True)
    return (r, p, out, err, env)


def leader_lines(work: Path, ranks) -> list:
    """Every progress line the leaders printed, one per step (a new leader may print the last
    committed step's line again, marked `again`: it must agree)."""
    by_step = {}
    for n in ranks:
        for name in (f"rank{n}.out", f"rank{n}.rejoin.out"):
            path = work / name
            for x in progress(path.read_text()) if path.exists() else []:
                assert by_step.setdefault(x["step"], x)["loss"] == x["loss"], f"step {x['step']} printed twice, differently"
    return [by_step[s] for s in sorted(by_step)]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The single process's losses and final parameters for a number of steps (made once each)."""
    made = {}

    def get(steps: int):
        if steps not in made:
            out = tmp_path_factory.mktemp(f"reference-{steps}")
            single_process(str(DATA / MODEL), 12, 16, steps, SEED, out)
            made[steps] = reference_losses(str(DATA / MODEL), 12, 16, steps, SEED), out / "params.safetensors"
        return made[steps]

    return get


@pytest.fixture(scope="module")
def reference(references):
    return references(STEPS)


def tp_replicas() -> dict:
    """three_replicas()'s shares with every replica one stage of two tensor-parallel ranks
    (replicas share their TP degree: the gradient rings are per TP rank): replica 0 (ranks 0, 1)
    joins with its TP group made afresh on the epoch's store."""
    spec = yaml.safe_load((DATA / MODEL).read_text())
    return hand_plan(spec, 12, 2, [
        dict(micro_batches=k, stages=[dict(layers=[0, 4], tp=2, dp=1, gpus=[(node, 0), (node, 1)])])
        for k, node in ((3, "a"), (2, "b"), (1, "c"))])


# The replica with rank 0, two joining ranks and a leader that is not rank 0: as two pipeline
# stages (a hop of their own), and as one stage of two tensor-parallel ranks (their TP group
# made afresh on the epoch's store). A single-GPU replica rejoins in the next test, and through
# the coordinator in test_keep_going.py.
@pytest.mark.parametrize("lost", ["pipeline-with-rank-0", "tp-2-with-rank-0"])
def test_a_lost_replica_rejoins_from_the_members_live_state_with_the_single_process_losses(tmp_path, lost, references):
    # Six ranks on this machine's cores step 4-5 times slower than four; the joining ranks are
    # in within 30 steps either way.
    steps = TP_STEPS if lost.startswith("tp-") else STEPS
    want, reference_params = references(steps)
    plan = tp_replicas() if lost.startswith("tp-") else three_replicas()
    work = tmp_path / "run"
    member_file = work / "membership.json"
    # Saved every 25 steps, asynchronously: a save's agreement is the next save's first
    # collective, which the members settle among themselves before the joining ranks meet them.
    args = ["--steps", str(steps), "--seed", str(SEED), "--timeout", "60", "--save-params", str(tmp_path / "params"),
            "--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", "25"]
    procs = start_ranks(plan, args, work, extra_env={"MOTLEY_KEEP_GOING": "1", "MOTLEY_MEMBERSHIP": str(member_file)})
    master = int(procs[0][4]["MASTER_PORT"])
    if lost == "single-gpu-replica":
        replica, killed, leader, port = 1, [2], 0, master
        left = membership(1, [0, 2], [1], {0: 4, 2: 2}, port, leader)
    else:
        # The job's store goes with rank 0; the epoch's moves to rank 2, which stays the leader
        # when replica 0 comes back (a joining rank never leads: it has no state to lead with).
        replica, killed, leader, port = 0, [0, 1], 2, free_port()
        left = membership(1, [1, 2], [0], {1: 3, 2: 3}, port, leader)
    joiners = []
    try:
        wait_for_line(work / "rank0.out", 2, procs)
        for r, p, *_ in procs:
            if r["rank"] in killed:
                os.killpg(p.pid, signal.SIGKILL)
        time.sleep(0.3)
        write_membership(member_file, left)
        survivors = [x for x in procs if x[0]["rank"] not in killed]
        until = time.monotonic() + 120
        while not [x for x in leader_lines(work, [leader]) if x["epoch"] == 1]:
            assert time.monotonic() < until, (work / f"rank{leader}.log").read_text()[-3000:]
            time.sleep(0.05)
        write_membership(member_file, membership(2, [0, 1, 2], [], FULL, port, leader, joining=[replica]))
        joiners = [restart(procs, n, args, work) for n in killed]
    finally:
        results = wait_ranks(survivors + joiners, work, 240)
    for r, (_, p, *_) in zip(results[len(survivors):], joiners):
        r.returncode = p.returncode
        r.log = (work / f"rank{r.rank}.rejoin.log").read_text()
    for r in results:
        assert r.returncode == 0, f"rank {r.rank} exit {r.returncode}\n{r.log[-4000:]}"
    for r in results[len(survivors):]:
        line = next(x for x in r.log.splitlines() if x.startswith("motley-rejoined "))
        took = json.loads(line.split(" ", 1)[1])
        assert took["epoch"] == 2 and took["replica"] == replica and took["bytes"] > 0, took
    from motley_torch.components import checkpoint

    last = checkpoint.verify_step(str(tmp_path / "ckpt" / checkpoint.step_dir_name(steps)))
    world = len(procs)
    assert not last.get("lost_ranks") and [r["rank"] for r in last["ranks"]] == list(range(world)), last["ranks"]
    lines = leader_lines(work, [leader, 0])
    assert [x["step"] for x in lines] == list(range(steps)), "every step once, none lost or repeated"
    epochs = [x["epoch"] for x in lines]
    assert epochs == sorted(epochs) and set(epochs) == {0, 1, 2}, epochs
    assert epochs[-1] == 2, "the last steps run at full strength"
    assert_steps_close([x["loss"] for x in lines], want, 4, "losses through the loss, the degraded steps and the rejoin")
    # The whole model at the end, written by the leader's replica and merged: the single process's.
    from safetensors.torch import load_file

    got, ref = load_file(str(tmp_path / "params" / "params.safetensors")), load_file(str(reference_params))
    assert sorted(got) == sorted(ref)
    norm = max(t.abs().max().item() for t in ref.values())
    # The key projection's bias adds one constant to every score of a query's row, which the
    # softmax takes away: its gradient is zero but for rounding noise, on which AdamW's steps go
    # either way in any two runs (400 of them here): it is compared by the losses alone.
    for k in sorted(x for x in got if not x.endswith("k.bias")):
        assert_close_rel(got[k], ref[k], math.sqrt(steps) * gradient_ops(4), f"parameter {k} after {steps} steps",
                         scale=norm)



def test_a_replica_lost_again_once_rejoined_is_left_out_and_rejoins_later(tmp_path, reference):
    """Replica 1 is lost (epoch 1); its rank is started to rejoin (epoch 2) and killed again as
    soon as it has its state: the coordinator's next membership leaves it out (epoch 3), the
    members go on without it, and a second start rejoins it (epoch 4). Every step's loss is
    still the single process's, and the job ends at full strength."""
    want, _ = reference
    plan = three_replicas()
    work = tmp_path / "run"
    member_file = work / "membership.json"
    args = ["--steps", str(STEPS), "--seed", str(SEED), "--timeout", "60"]
    procs = start_ranks(plan, args, work, extra_env={"MOTLEY_KEEP_GOING": "1", "MOTLEY_MEMBERSHIP": str(member_file)})
    port = int(procs[0][4]["MASTER_PORT"])
    survivors = [x for x in procs if x[0]["rank"] != 2]
    late = []

    def epoch_line(n: int):
        until = time.monotonic() + 120
        while not [x for x in leader_lines(work, [0]) if x["epoch"] == n]:
            assert time.monotonic() < until, (work / "rank0.log").read_text()[-3000:]
            time.sleep(0.05)

    try:
        wait_for_line(work / "rank0.out", 2, procs)
        os.killpg(next(p for r, p, *_ in procs if r["rank"] == 2).pid, signal.SIGKILL)
        time.sleep(0.3)
        write_membership(member_file, membership(1, [0, 2], [1], {0: 4, 2: 2}, port, 0))
        epoch_line(1)
        write_membership(member_file, membership(2, [0, 1, 2], [], FULL, port, 0, joining=[1]))
        first = restart(procs, 2, args, work)
        log = work / "rank2.rejoin.log"
        until = time.monotonic() + 120
        while "motley-rejoined " not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < until and first[1].poll() is None, log.read_text() if log.exists() else ""
            time.sleep(0.02)
        os.killpg(first[1].pid, signal.SIGKILL)
        first[1].wait()
        first[2].close()
        first[3].close()
        time.sleep(0.3)
        write_membership(member_file, membership(3, [0, 2], [1], {0: 4, 2: 2}, port, 0))
        epoch_line(3)
        write_membership(member_file, membership(4, [0, 1, 2], [], FULL, port, 0, joining=[1]))
        late = [restart(procs, 2, args, work)]
    finally:
        results = wait_ranks(survivors + late, work, 240)
    for r in results:
        assert r.returncode == 0, f"rank {r.rank} exit {r.returncode}\n{r.log[-4000:]}"
    joined = (work / "rank2.rejoin.log").read_text()
    took = json.loads(next(x for x in joined.splitlines() if x.startswith("motley-rejoined ")).split(" ", 1)[1])
    assert took["epoch"] == 4, took
    lines = leader_lines(work, [0])
    assert [x["step"] for x in lines] == list(range(STEPS)), "every step once, none lost or repeated"
    epochs = [x["epoch"] for x in lines]
    assert epochs == sorted(epochs) and {0, 1, 3, 4} <= set(epochs) and epochs[-1] == 4, sorted(set(epochs))
    assert_steps_close([x["loss"] for x in lines], want, 4, "losses through a loss, a rejoin lost and a rejoin")


# ---- the membership document's `joining` (pure) ----------------------------------------------

def _plan():
    from motley_torch.plan import Plan

    return Plan(three_replicas(), None, "three replicas")


def test_a_joining_replica_is_a_member_that_never_leads_and_every_field_is_checked():
    from motley_torch.distributed.membership import (Membership, MembershipError, epoch_groups, joiner_tp_groups,
                                                      members)

    plan = _plan()
    doc = json.loads(membership(2, [0, 1, 2], [], FULL, 29500, 2, joining=[0]))
    m = Membership.parse(doc, plan, "m")
    assert m.joining == (0,) and members(plan, m) == [0, 1, 2, 3] and m.leader == 2
    # Its rings and its pipeline hop are the epoch's, among every member, joiners included.
    keys = {g.key: g.ranks for g in epoch_groups(plan, m, False)}
    assert keys["world"] == (0, 1, 2, 3) and keys["pp/0/0"] == (0, 1), keys
    assert keys["dp/0-2/tp0"] == (0, 2, 3) and keys["dp/2-4/tp0"] == (1, 2, 3), keys
    assert joiner_tp_groups(plan, 0) == [], "TP 1: no TP group to make"
    for bad, field in ((dict(doc, leader=0), "leader"), (dict(doc, joining=[0, 1, 2]), "joining"),
                       (dict(doc, joining=[5]), "joining"), (dict(doc, joining="0"), "joining")):
        with pytest.raises(MembershipError, match=f"m.{field}"):
            Membership.parse(bad, plan, "m")
    # Which newer membership ends an epoch's groups: one that leaves a member out, or names one
    # of its members joining again (its ranks were lost in between); not one that only adds.
    from motley_torch.distributed.keep_going import superseded

    def mm(epoch, replicas, lost, joining=(), leader=0):
        split = {0: 3, 1: 2, 2: 1} if len(replicas) == 3 else {r: 6 // len(replicas) for r in replicas}
        return Membership.parse(json.loads(membership(epoch, replicas, lost, split, 29500, leader, joining)), plan, "m")

    one, two_back = mm(1, [0, 2], [1]), mm(2, [0, 1, 2], [], joining=[1])
    assert not superseded(one, two_back), "a join only adds"
    assert superseded(two_back, mm(3, [0, 2], [1])), "a member lost"
    assert superseded(two_back, mm(5, [0, 1, 2], [], joining=[1])), "a member lost and back again in between"
    assert not superseded(one, mm(5, [0, 1, 2], [], joining=[1])), "a join of a replica that was not a member"
    # Any member replica's first rank may lead when none joins (the coordinator passes over one
    # that was joining the epoch before), but never a rank inside a replica.
    assert Membership.parse(dict(doc, joining=[], leader=0), plan, "m").leader == 0
    with pytest.raises(MembershipError, match="m.leader"):
        Membership.parse(dict(doc, joining=[], leader=1), plan, "m")
