"""Networks that change (docs/network.md), through the real system on real links: the nodes are
network namespaces on two bridged islands joined by one veth pair, the inter-island link,
shaped with htb (netns.py); a real coordinator and one real motley-agent per node, each agent
and its ranks inside its node's namespace, the reference trainer on every rank (CPU, gloo over
the namespace's eth0) (netcluster.py, which also holds the setting: where the planner's plan
depends on the inter-island link). The scenarios: a 10x drop that pays for a switch, a drop
shorter than `hold`, a flapping network within the cooldown, a drop a switch would not pay
for. Needs root and iproute2 (ip, tc); fails saying so without them. Every namespace, veth,
bridge, qdisc and process a test makes is removed when it ends, also when it fails. About 4
minutes on a 2-core machine."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import yaml

import netcluster as nc
from launcher import motley_bin, reference_losses
from netns import Net, requirements
from tolerance import assert_steps_close, layers_of

SEED = 5


@pytest.fixture
def islands(request):
    """A Net of the shared setting's islands, every link at RATE_MBIT; removed after the test,
    passed or failed, and checked gone."""
    why = requirements()
    if why:
        pytest.fail(why)
    net = Net(nc.ISLANDS, node_mbit=nc.RATE_MBIT, link_mbit=nc.RATE_MBIT)

    def gone():
        net.close()
        left = net.leftovers()
        assert not left, f"left behind: {left}"
    request.addfinalizer(gone)
    return net


def within(measured: float, mbit: float, rel: float = 0.2) -> bool:
    """`measured` MB/s is `mbit` Mbit/s within `rel` (the shaper gives a little under its rate)."""
    return abs(measured - mbit / 8) <= rel * mbit / 8


def test_the_inter_island_link_runs_at_its_shaped_rate_and_changes_while_the_rest_do_not(islands: Net):
    """A socket transfer between two namespaces reaches the shaped rate, inside an island and
    across; a `tc qdisc replace` on the inter-island link takes the rate across down 10x and
    leaves the islands' insides alone; unshaped, the link is far faster."""
    net = islands
    inside, across, back = net.transfer("n0", "n1", 4), net.transfer("n0", "n2", 4), net.transfer("n3", "n1", 4)
    assert within(inside, nc.RATE_MBIT) and within(across, nc.RATE_MBIT) and within(back, nc.RATE_MBIT), \
        (inside, across, back, net.qdiscs())
    net.shape_link(nc.DROP_MBIT)
    inside, across, back = net.transfer("n2", "n3", 4), net.transfer("n1", "n2", 1), net.transfer("n2", "n0", 1)
    assert within(inside, nc.RATE_MBIT), inside
    assert within(across, nc.DROP_MBIT) and within(back, nc.DROP_MBIT), (across, back, net.qdiscs())
    # The coordinator's address (the root namespace, on island A) is reachable from island B.
    assert net.transfer("n3", "root", 1) > 0
    net.shape_link(None)
    net.shape_nodes(None)
    assert net.transfer("n0", "n3", 16) > 4 * nc.RATE_MBIT / 8


def motley_json(*args: str) -> dict:
    b = motley_bin()
    assert b is not None, "no motley binary: set MOTLEY_BIN (python/run-tests does) or build target/ci/motley"
    out = subprocess.run([b, *args, "-o", "json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"motley {' '.join(args)}: {out.stderr}"
    return json.loads(out.stdout)


def crossings(plan: dict) -> int:
    """How many of a plan's communication groups span both islands."""
    isl = {n: k for k, v in nc.ISLANDS.items() for n in v}
    return sum(len({isl[g["node"]] for g in grp["gpus"]}) > 1 for grp in plan.get("comm_groups") or [])


def test_the_setting_makes_the_planner_cross_the_islands_and_leave_them_after_a_10x_drop(tmp_path: Path):
    """The setting the scenarios and the benchmark use, offline: on the declared links the plan
    spans both islands; priced on the measured links after the drop, `motley replan` says switch
    to a plan inside one island; on links measured as declared it says keep."""
    cluster, model = tmp_path / "islands.yaml", tmp_path / "model.yaml"
    cluster.write_text(yaml.safe_dump(nc.cluster_file()))
    model.write_text(yaml.safe_dump(nc.model()))
    plan = motley_json("plan", "--cluster", str(cluster), "--model", str(model), "--global-batch", str(nc.GLOBAL_BATCH))
    assert nc.plan_nodes(plan) == set(sum(nc.ISLANDS.values(), [])) and crossings(plan) >= 1, plan
    current = tmp_path / "current.json"
    current.write_text(json.dumps(plan))
    common = ["--current", str(current), "--cluster", str(cluster), "--model", str(model)]
    dropped, same = tmp_path / "dropped.yaml", tmp_path / "same.yaml"
    dropped.write_text(yaml.safe_dump(nc.bandwidth_file(nc.RATE_MBIT, nc.DROP_MBIT)))
    same.write_text(yaml.safe_dump(nc.bandwidth_file(nc.RATE_MBIT, nc.RATE_MBIT)))
    after = motley_json("replan", *common, "--bandwidth", str(dropped))
    assert after["worth_switching"], after["reason"]
    assert after["current_now_s"] > 2 * after["new_iteration_time_s"], after["reason"]
    new = after["new_plan"]
    assert crossings(new) == 0 and any(nc.plan_nodes(new) <= set(v) for v in nc.ISLANDS.values()), new
    kept = motley_json("replan", *common, "--bandwidth", str(same))
    assert not kept["worth_switching"], kept["reason"]


# ---- the scenarios: a job runs across the islands while the links change --------------------------

EVERY = 20
# The agents' probes may hold the wire 10% of the time (the default is 1%): a drop is measured
# within seconds, not tens of seconds.
PROBE = ["--probe-duty", "0.1"]
RATE_GB = nc.RATE_MBIT / 8000
DROP_GB = nc.DROP_MBIT / 8000


def island_of(node: str) -> str:
    return next(k for k, v in nc.ISLANDS.items() if node in v)


def across(link: dict) -> bool:
    return island_of(link["a"]) != island_of(link["b"])


def messages(c: nc.NetCluster, jid: int, kind: str) -> list:
    return [json.loads(e["message"]) for e in c.events(jid) if e["kind"] == kind]


def newest_complete(c: nc.NetCluster, jid: int) -> int:
    return max((s["step"] for s in c.get(f"/api/v1/jobs/{jid}/checkpoints") if s["complete"]), default=-1)


def start(tmp: Path, net: Net, train_steps: int, replan, steps=None, agent_args=PROBE):
    """The cluster on `net`, and a job on it running with a complete checkpoint and every link
    of its plan across the islands measured near RATE_MBIT."""
    c = nc.NetCluster(tmp, net, nc.entries(), gpu_types=nc.gpu_types(), agent_args=agent_args)
    try:
        c.wait_live()
        # No budget for lost nodes or failed ranks: a switch spends none.
        extra = {"replan": replan, "profiling": {"mode": "off"}, "max_preemptions": 0, "max_restarts": 0}
        if steps is not None:
            extra["steps"] = steps
        jid = c.submit(nc.train_job("net-change", nc.model(), nc.GLOBAL_BATCH, train_steps, SEED, EVERY, tmp / "cloud",
                                    **extra))
        c.wait(lambda: c.job(jid)["state"] == "running", 60, why="the job runs")
        plan = c.plan(jid)
        assert nc.plan_nodes(plan) == set(net.nodes), plan
        c.wait(lambda: newest_complete(c, jid) >= 0, 60, why="a complete checkpoint")

        def measured():
            links = [l for l in c.net_show()["links"] if across(l)]
            return len(links) >= 1 and all(abs(l["gb_per_s"] / RATE_GB - 1) < 0.3 for l in links) and links
        c.wait(measured, 60, why="the agents measured the links across the islands near their shaped rate")
        return c, jid
    except BaseException:
        c.close()
        raise


def test_a_10x_drop_between_the_islands_switches_the_job_to_one_island_at_its_next_checkpoint(islands: Net,
                                                                                               tmp_path: Path):
    """The inter-island link drops 10x while the job runs a pipeline across it: the agents'
    probes see it (`motley net show`), the coordinator reports the change once it held,
    re-plans on the measured links, decides to switch, and at the next complete checkpoint the
    job recovers (cause replan) onto a plan inside one island, finishes, and its losses are the
    single process's from the restored step on."""
    # The switch came at step 40 in runs on 2-core machines (the drop, hold, probes and the next
    # checkpoint): room for it five times over.
    steps = 200
    c, jid = start(tmp_path, islands, steps, {"threshold": 0.3, "hold": "4s", "cooldown": "10m"}, steps=steps)
    try:
        islands.shape_link(nc.DROP_MBIT)
        # After the qdisc is in place: a probe that ended while `tc` ran read the old rate.
        dropped_ms = time.time() * 1000
        changed = c.wait(lambda: messages(c, jid, "network_changed"), 60, why="network_changed")
        for m in changed:
            # Past the threshold (the contract); a probe's reading right after a drop may sit
            # above the shaped rate (docs/network.md, "Tests and the benchmark").
            # (A probe that straddled the drop reads an average of both rates: the slow rate
            # itself is checked on `net show`'s estimates below, not on the reading that tripped.)
            assert across(m["link"]) and m["now"] < 0.7 * m["was"], m
        # `motley net show` has the drop: the changed links' estimates are the slow rate, their
        # histories fast before the drop and slow after it. The estimate is the best of the
        # newest probes, and a change needs them only 30% slow: a probe that straddled the drop
        # (an average of both rates) may still be the best for a probe or two after the change.
        def link_of(view, m):
            return next(l for l in view["links"] if (l["a"], l["b"]) == (m["link"]["a"], m["link"]["b"]))

        def settled():
            view = c.net_show()
            return view if all(link_of(view, m)["gb_per_s"] < 0.5 * RATE_GB for m in changed) else None

        view = c.wait(settled, 30, why="net show's estimates of the changed links at the slow rate")
        (tmp_path / "net-show.json").write_text(json.dumps(view, indent=1))
        for m in changed:
            link = link_of(view, m)
            assert link["gb_per_s"] < 0.5 * RATE_GB and link["declared_gb_per_s"] > 2 * link["gb_per_s"], link
            hist = link["history"]
            assert any(h["at_unix_ms"] < dropped_ms and h["gb_per_s"] > 0.7 * RATE_GB for h in hist), hist
            assert all(h["gb_per_s"] < 0.5 * RATE_GB for h in hist if h["at_unix_ms"] > dropped_ms + 1000), hist
        # Links are measured one probe at a time: the first change re-planned on may be a link
        # the pipeline does not cross while the one it crosses still reads fast (a keep); the
        # switch comes once the crossed link's change is in.
        switched = c.wait(lambda: [m for m in messages(c, jid, "replan_considered") if m["decision"] == "switch"], 90,
                          why="replan_considered deciding switch")
        switch = switched[0]
        assert switch["gain_s"] > switch["cost_s"] and "pays for the switch" in switch["reason"], switch
        # Faster on the links as measured then (how much depends on which links the probes had
        # re-measured when the change came in: the crossed link's, or another's first).
        assert switch["plan_after"]["iteration_time_s"] < 0.8 * switch["plan_before"]["iteration_time_s"], switch
        final = c.wait_done(jid, 240)
        events = c.events(jid)
        kinds = [e["kind"] for e in events]
        assert final["state"] == "succeeded" and final["generation"] == 2, f"{final}\n{kinds}\n{c.logs()}"
        assert kinds.count("recovering") == 1, kinds
        recovering = next(e for e in events if e["kind"] == "recovering")
        assert "(re-plan)" in recovering["message"], recovering
        assert recovering["at_ms"] > max(e["at_ms"] for e in events if e["kind"] == "network_changed")
        planned = json.loads(next(e["message"] for e in events if e["kind"] == "recovery_planned"))
        step = planned["step"]
        assert step > switch["at_step"] and step % EVERY == 0, (planned, switch)
        considered = messages(c, jid, "replan_considered")
        assert [m["decision"] for m in considered].count("switch") == 1, considered
        new = c.plan(jid)
        assert any(nc.plan_nodes(new) <= set(v) for v in nc.ISLANDS.values()), new
        assert new["network"]["source"] == "measured", new["network"]
        reference = reference_losses(str(nc.MODEL_FILE), nc.GLOBAL_BATCH, nc.model()["seq_len"], steps, SEED)
        before, after = nc.rank0_losses(tmp_path, jid, 1), nc.rank0_losses(tmp_path, jid, 2)
        assert after and after[0][0] == step and after[-1][0] == steps - 1, (step, after[:2], after[-1:])
        both = before + after
        assert_steps_close([x for _, x in both], [reference[s] for s, _ in both], layers_of(nc.MODEL_FILE),
                           "losses across the switch against the uninterrupted run's", steps=[s for s, _ in both])
    finally:
        c.close()


def test_a_drop_shorter_than_hold_changes_nothing(islands: Net, tmp_path: Path):
    """The inter-island link drops 10x for 4 s, less than the job's hold (10 s): the probes see
    the drop (a sample in the link's history), yet no change is reported, nothing is
    re-planned and the job runs on in its first generation."""
    c, jid = start(tmp_path, islands, 100_000, {"threshold": 0.3, "hold": "10s", "cooldown": "10m"})
    try:
        t0 = time.time() * 1000
        islands.shape_link(nc.DROP_MBIT)
        time.sleep(4)
        islands.shape_link(nc.RATE_MBIT)
        t1 = time.time() * 1000
        time.sleep(14)
        links = [l for l in c.net_show()["links"] if across(l)]
        low = [s for l in links for s in l["history"] if t0 <= s["at_unix_ms"] <= t1 + 1000 and s["gb_per_s"] < 0.3 * RATE_GB]
        assert low, f"the probes never saw the brief drop: {links}"
        # Back: each estimate (the best of the newest samples; a probe beside the training's
        # traffic reads low) is near the shaped rate again.
        assert all(l["gb_per_s"] > 0.5 * RATE_GB for l in links), links
        kinds = [e["kind"] for e in c.events(jid)]
        assert "network_changed" not in kinds and "replan_considered" not in kinds, kinds
        job = c.job(jid)
        assert job["state"] == "running" and job["generation"] == 1, job
    finally:
        c.close()


def test_a_flapping_network_switches_at_most_once_per_cooldown(islands: Net, tmp_path: Path):
    """The network flaps between two states, each lasting longer than hold: the inter-island
    link slow (island A's inside fast), then island A's inside slow too (n1's link). The first
    moves the job onto island A; the second would pay for a move again, but it comes within the
    cooldown: it is considered and kept, and the job stays in its second generation."""
    c, jid = start(tmp_path, islands, 100_000, {"threshold": 0.3, "hold": "3s", "cooldown": "10m"})
    try:
        islands.shape_link(nc.DROP_MBIT)
        c.wait(lambda: c.job(jid)["generation"] == 2 and c.job(jid)["state"] == "running", 120,
               why="the first switch")
        new = c.plan(jid)
        assert nc.plan_nodes(new) <= set(nc.ISLANDS["A"]) or nc.plan_nodes(new) <= set(nc.ISLANDS["B"]), new
        inside = sorted(nc.plan_nodes(new))
        for flap in range(2):
            # The island the job moved to slows inside (one of its nodes' links), then recovers.
            islands.shape_node(inside[-1], nc.DROP_MBIT)
            c.wait(lambda: sum("cooldown" in m["reason"] for m in messages(c, jid, "replan_considered")) > flap, 60,
                   why=f"flap {flap}: a re-plan considered and kept for the cooldown")
            islands.shape_node(inside[-1], nc.RATE_MBIT)
            time.sleep(5)
        considered = messages(c, jid, "replan_considered")
        decisions = [m["decision"] for m in considered]
        assert decisions.count("switch") == 1, considered
        after = considered[decisions.index("switch") + 1:]
        assert len(after) >= 2 and all(m["decision"] == "keep" for m in after), considered
        # Each flap was weighed and would have paid, but came within the cooldown (a link that
        # reads back up after a flap may add a keep of its own: nothing faster).
        assert sum("cooldown" in m["reason"] and m["gain_s"] > m["cost_s"] for m in after) >= 2, after
        job = c.job(jid)
        assert job["state"] == "running" and job["generation"] == 2, job
        assert [e["kind"] for e in c.events(jid)].count("recovering") == 1
    finally:
        c.close()


def test_a_drop_a_switch_would_not_pay_for_is_kept(islands: Net, tmp_path: Path):
    """With a horizon of 1 s the saving of a plan inside one island cannot pay for a relaunch:
    the drop is reported and weighed, the decision is keep, and the job runs on unrecovered."""
    c, jid = start(tmp_path, islands, 100_000, {"threshold": 0.3, "hold": "3s", "horizon": "1s", "cooldown": "0s"})
    try:
        islands.shape_link(nc.DROP_MBIT)
        # The first re-plan may see only a link the pipeline does not cross (nothing much
        # faster); once the crossed link's change is in, a plan under half the running one's
        # time is found, and with 1 s of work left it does not pay.
        def weighed():
            return [m for m in messages(c, jid, "replan_considered")
                    if m["plan_after"] and m["plan_after"]["iteration_time_s"] < m["plan_before"]["iteration_time_s"] / 2]
        m = c.wait(weighed, 90, why="a re-plan that finds a much faster plan")[0]
        assert m["decision"] == "keep" and m["gain_s"] <= m["cost_s"] and "does not pay" in m["reason"], m
        assert messages(c, jid, "network_changed"), "the change was reported"
        newest = newest_complete(c, jid)
        c.wait(lambda: newest_complete(c, jid) >= newest + 2 * EVERY, 60, why="two more checkpoints")
        kinds = [e["kind"] for e in c.events(jid)]
        job = c.job(jid)
        assert job["state"] == "running" and job["generation"] == 1 and "recovering" not in kinds, (job, kinds)
        assert all(m["decision"] == "keep" for m in messages(c, jid, "replan_considered"))
    finally:
        c.close()
