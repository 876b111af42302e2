"""Networks that change (docs/network.md), through the real system on real links: the nodes are
network namespaces on two bridged islands joined by one veth pair, the inter-island link,
shaped with tbf (netns.py); a real coordinator and one real motley-agent per node, each agent
and its ranks inside its node's namespace, the reference trainer on every rank (CPU, gloo over
the namespace's eth0) (netcluster.py). Needs root and iproute2 (ip, tc); fails saying so
without them. Every namespace, veth, bridge and qdisc a test makes is removed when it ends,
also when it fails."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

import netcluster as nc
from launcher import motley_bin, single_process
from netns import Net, requirements

SEED = 5
TOL = 1e-4


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
    """`measured` MB/s is `mbit` Mbit/s within `rel` (tbf gives a little under its rate)."""
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


def test_a_job_across_the_islands_trains_as_one_process_would(islands: Net, tmp_path: Path):
    """The harness end to end: four agents in their namespaces register over the bridges, the
    job's plan spans both islands (ranks meet over eth0 and the inter-island link), and its
    losses are the single process's."""
    c = nc.NetCluster(tmp_path, islands, nc.entries(), gpu_types=nc.gpu_types())
    try:
        steps = 40
        c.wait_live()
        jid = c.submit(nc.train_job("net-across", nc.model(), nc.GLOBAL_BATCH, steps, SEED, 20, tmp_path / "cloud"))
        final = c.wait_done(jid, 180)
        kinds = [e["kind"] for e in c.events(jid)]
        assert final["state"] == "succeeded", f"{final}\n{kinds}\n{c.logs()}"
        plan = c.plan(jid)
        assert nc.plan_nodes(plan) == set(islands.nodes) and crossings(plan) >= 1, plan
        got = nc.rank0_losses(tmp_path, jid, 1)
        reference = single_process(str(nc.MODEL_FILE), nc.GLOBAL_BATCH, nc.model()["seq_len"], steps, SEED)
        assert [s for s, _ in got] == list(range(steps)), got[:3]
        for s, loss in got:
            assert abs(loss - reference[s]) <= TOL * max(1.0, abs(reference[s])), (s, loss, reference[s])
    finally:
        c.close()
