"""bench/mixed_cluster.py (docs/emulation.md, "The side-by-side benchmark"): its reading of a
cluster file (every node emulated, at most two islands, the shares within the machine, the
Ethernet rate the link between islands is shaped to), its summary (speedups, prediction error,
the losses compared), and the whole bench once, small, through the real coordinator and agents
in network namespaces (needs root and iproute2; fails saying so without them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from launcher import REPO, motley_bin

sys.path.insert(0, str(REPO / "bench"))
import keep_going_mixed as kgm  # noqa: E402
import mixed_cluster as mc  # noqa: E402
from netns import Net, requirements  # noqa: E402


def write(tmp_path: Path, doc: dict) -> Path:
    p = tmp_path / "cluster.yaml"
    p.write_text(yaml.safe_dump(doc))
    return p


def node(name: str, gpu: str, share, domain=None, count=None, gbps=0.1) -> dict:
    n = {"name": name, "gpu": gpu, "gpus": 1, "nics": [{"name": "eth0", "kind": "ethernet", "gbps": gbps}]}
    if share is not None:
        n["emulate"] = {"cpu": share}
    if domain:
        n["rdma_domain"] = domain
    if count:
        n["count"] = count
    return n


def test_the_shipped_lab_is_three_speeds_on_two_islands_joined_at_the_declared_ethernet_rate():
    c = mc.read_cluster(REPO / "bench" / "mixed" / "lab.yaml")
    assert len({e["emulate"]["cpu"] for e in c["entries"].values()}) == 3
    assert sorted(len(v) for v in c["islands"].values()) == [2, 2]
    assert c["across_mbit"] == pytest.approx(100.0)
    assert c["shares"] <= 1.6, "within a 2-core machine's 80%"
    # count: 2 expands, and the short names map back to the file's.
    assert sorted(c["names"].values()) == ["a100", "h100", "v100-0", "v100-1"]
    assert all(e["nics"] == [{"name": "eth0", "kind": "ethernet", "gbps": 0.1}] for e in c["entries"].values())
    # Two V100s may split a micro-batch of 2 (one sequence each); one H100 or A100 cannot.
    assert mc.sequences_per_gpu(c, 2) == {"A100-80G": [2], "H100": [2], "V100-32G": [2, 1]}
    assert mc.sequences_per_gpu(c, 4)["V100-32G"] == [4, 2]
    one = mc.read_cluster(REPO / "bench" / "mixed" / "two-speed.yaml")
    assert sorted(len(v) for v in one["islands"].values()) == [0, 4], "one island, the other empty"


@pytest.mark.parametrize("doc, field", [
    ({"nodes": [node("a", "A100-80G", None)]}, "nodes[0].emulate.cpu"),
    ({"nodes": [node("a", "A100-80G", 0.2), {"name": "b", "gpu": "T4", "gpus": 1, "emulate": {"cpu": 0.1}}]},
     "nodes[1].nics"),
    ({"nodes": [node("a", "A100-80G", 0.1, "x"), node("b", "A100-80G", 0.1, "y"), node("c", "A100-80G", 0.1, "z")]},
     "rdma_domain"),
    ({"nodes": [node("a", "A100-80G", 0.9, count=2 * (os.cpu_count() or 1))]}, "emulate.cpu values"),
    ({"name": "x"}, "no `nodes` list"),
])
def test_a_cluster_the_bench_cannot_run_is_refused_naming_the_field(tmp_path: Path, doc: dict, field: str):
    with pytest.raises(mc.BenchError, match="--cluster") as e:
        mc.read_cluster(write(tmp_path, doc))
    assert field in str(e.value)


def row(system, predicted, measured, losses):
    return {"system": system, "predicted_s": predicted, "measured_s": measured, "tokens_per_s": 1000 / measured,
            "losses": losses}


def test_the_summary_compares_motley_with_the_best_baseline_measured_and_predicted():
    rows = [row("motley", 1.0, 1.1, [4.0, 3.9]), row("megatron", 2.0, 2.2, [4.0, 3.9 + 5e-5]),
            row("whale", 1.5, 1.4, [4.0, 3.9]), row("fast-only", 3.0, 2.7, [4.0, 3.9])]
    s = mc.summary(rows)
    assert s["speedup_vs_best_baseline_measured"] == pytest.approx(1.4 / 1.1, abs=1e-3)
    assert s["speedup_vs_best_baseline_predicted"] == pytest.approx(1.5, abs=1e-3)
    assert s["best_baseline_measured"] == "whale"
    assert s["max_prediction_error"] == pytest.approx(0.1, abs=1e-4)
    assert s["order_measured"] == ["motley", "whale", "megatron", "fast-only"]
    assert s["order_predicted"] == ["motley", "whale", "megatron", "fast-only"]
    assert s["loss_max_diff"] == pytest.approx(5e-5)


def test_the_node_lost_by_default_is_the_last_replica_apart_from_rank_0s():
    """bench/keep_going_mixed.py loses the node of the last replica that lives on one node
    other than rank 0's (rank 0 keeps leading and printing), and says so when none does."""
    def rep(*nodes):
        return {"samples": 2, "stages": [{"gpu": "A100-80G", "layers": [0, 2], "gpus": [{"node": n, "index": 0}]}
                                         for n in nodes]}
    assert kgm.default_victim({"replicas": [rep("n0"), rep("n1"), rep("n2")]}) == "n2"
    # The last replica spans two nodes, the one before shares rank 0's node: the second.
    assert kgm.default_victim({"replicas": [rep("n0"), rep("n1"), rep("n0"), rep("n2", "n3")]}) == "n1"
    with pytest.raises(mc.BenchError, match="--lose"):
        kgm.default_victim({"replicas": [rep("n0"), rep("n0")]})


def test_the_survivors_plan_is_the_members_with_the_memberships_split():
    """bench/keep_going_mixed.py prices the survivors as they run: the lost replica left out,
    each member's micro-batches (and samples) those of `membership_changed`'s split, the rings
    left for the pricer to derive."""
    def rep(mb):
        return {"samples": 2 * mb, "micro_batches": mb, "stages": [{"gpu": "A100-80G", "layers": [0, 2], "gpus": []}]}
    doc = {"micro_batch": 2, "global_batch": 16, "replicas": [rep(3), rep(3), rep(2)], "comm_groups": [{"ranks": [0]}]}
    out = kgm.survivors(doc, {"0": 5, "2": 3})
    assert [(r["micro_batches"], r["samples"]) for r in out["replicas"]] == [(5, 10), (3, 6)]
    assert "comm_groups" not in out
    assert [r["micro_batches"] for r in doc["replicas"]] == [3, 3, 2], "the plan itself is left as it was"


def test_links_are_measured_with_each_end_inside_its_nodes_cpu_share(tmp_path: Path):
    """An emulated node's ranks run the network stack and gloo's ring inside their share, so the
    bench measures each pair with both ends each held to its node's share: by a two-rank gloo
    all-reduce (the default) or a TCP transfer. The cgroups have the agent's quota and ran the
    measurements (periods counted), and nodes of equal shares are measured once."""
    why = requirements()
    if why:
        pytest.fail(why)
    c = mc.read_cluster(write(tmp_path, {"name": "t", "nodes": [node("fast", "A100-80G", 0.5, gbps=1),
                                                                 node("slow", "V100-32G", 0.25, gbps=1, count=2)]}))
    net = Net(c["islands"])
    shares = mc.LinkShares({n: float(e["emulate"]["cpu"]) for n, e in c["entries"].items()})
    try:
        for n, share in (("n0", 0.5), ("n1", 0.25), ("n2", 0.25)):
            d = shares.dirs[n]
            if shares.v2:
                quota, period = map(int, (d / "cpu.max").read_text().split())
            else:
                quota, period = int((d / "cpu.cfs_quota_us").read_text()), int((d / "cpu.cfs_period_us").read_text())
            assert (quota, period) == (5000, round(5000 / share)), (n, quota, period)

        def periods():
            return {n: int(dict(line.split() for line in (shares.dirs[n] / "cpu.stat").read_text().splitlines())
                            ["nr_periods"]) for n in ("n0", "n1")}

        gloo = mc.measured_links(net, c, shares)
        assert gloo["by"] == "gloo" and gloo["confined"] and len(gloo["pairs"]) == 3
        assert all(p["gb_per_s"] > 0 for p in gloo["pairs"]), gloo
        after_gloo = periods()
        assert all(v > 0 for v in after_gloo.values()), after_gloo

        calls = []
        real = net.transfer

        def counted(a, b, **kw):
            calls.append((a, b, kw["procs"]))
            return real(a, b, **kw)

        net.transfer = counted
        tcp = mc.measured_links(net, c, shares, by="tcp")
        assert tcp["by"] == "tcp" and all(p["gb_per_s"] > 0 for p in tcp["pairs"])
        # fast-slow once (the two slow nodes' shares are equal), slow-slow once: three transfers each.
        assert len(calls) == 6, calls
        assert all(procs[0].endswith("/cgroup.procs") and procs[1].endswith("/cgroup.procs") for _, _, procs in calls)
        assert all(v > after_gloo[n] for n, v in periods().items()), "the transfers ran in the shares too"
    finally:
        shares.close()
        net.close()
    assert not any(d.exists() for d in shares.dirs.values()), "the cgroups are removed"


def test_the_whole_bench_runs_motley_and_a_baseline_and_prints_the_contracts_lines(tmp_path: Path):
    """Two nodes of two speeds in one island, a tiny model, a few steps: the JSON lines of the
    contract, the losses of both plans the same, the prediction a number for each."""
    why = requirements()
    if why:
        pytest.fail(why)
    b = motley_bin()
    assert b is not None
    # Shares of 0.8 and 0.4: two speeds, as the shipped lab's, at twice the CPU (a process's
    # start-up and first pass cost many times over at a small share: docs/emulation.md).
    cluster = write(tmp_path, {"name": "two", "nodes": [node("fast", "A100-80G", 0.8, gbps=1),
                                                        node("slow", "V100-32G", 0.4, gbps=1)]})
    model = tmp_path / "model.yaml"
    model.write_text(yaml.safe_dump({"name": "bench-tiny", "layers": 2, "hidden": 64, "heads": 4, "seq_len": 32,
                                     "vocab": 128}))
    out = subprocess.run([sys.executable, str(REPO / "bench" / "mixed_cluster.py"), "--cluster", str(cluster),
                          "--model", str(model), "--global-batch", "4", "--micro-batch", "1", "--steps", "4",
                          "--warmup", "1", "--only", "motley,fast-only", "--keep", str(tmp_path / "runs"), "--timings",
                          "--profiles", "beside", "-o", "json"],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, MOTLEY_BIN=b))
    assert out.returncode == 0, out.stderr[-4000:]
    lines = [json.loads(x) for x in out.stdout.splitlines()]
    systems = [x["system"] for x in lines[:-1]]
    assert systems == ["motley", "fast-only"]
    for x in lines[:-1]:
        assert x["predicted_s"] > 0 and x["measured_s"] > 0 and x["tokens_per_s"] > 0
        # --timings: each replica's predicted terms beside its ranks' measured phases.
        assert x["terms"], x
        for t in x["terms"]:
            assert t["predicted"]["sync_s"] >= 0 and t["predicted"]["optimizer_s"] > 0, t
            assert t["ranks"], t
            m = t["measured_slowest_rank"]
            assert m["step_ms"] > 0 and m["optimizer_ms"] > 0 and m["grad_sync_ms"] >= 0, t
            assert m["pipeline_ms"] <= m["step_ms"], t
    s = lines[-1]
    for k in ("speedup_vs_best_baseline_measured", "speedup_vs_best_baseline_predicted", "max_prediction_error"):
        assert isinstance(s[k], float), (k, s)
    assert s["loss_max_diff"] <= mc.LOSS_TOLERANCE
    assert s["links_confined"] is True and s["links_by"] == "gloo", "by gloo, inside the nodes' shares, by default"
    # Profiles beside each run: the second system's plan priced from profiles retaken before it.
    assert s["profiles"] == "beside"
    motley_row, fast_row = lines[0], lines[1]
    assert motley_row["predicted_s"] == motley_row["predicted_at_plan_s"], "the first run is priced from the first profiles"
    retaken = yaml.safe_load((tmp_path / "runs" / "profiles-fast-only.yaml").read_text())
    assert sorted(p["gpu"] for p in retaken["profiles"]) == ["A100-80G", "V100-32G"]
    planned = json.loads((tmp_path / "runs" / "plan-fast-only.json").read_text())
    assert fast_row["predicted_at_plan_s"] == round(planned["iteration_time_s"], 4)
    runs = tmp_path / "runs"
    again = subprocess.run([b, "plan", "--cluster", str(runs / "cluster.yaml"), "--model", str(model),
                            "--price", str(runs / "plan-fast-only.json"), "--profiles", str(runs / "profiles-fast-only.yaml"),
                            "--bandwidth", str(runs / "bandwidth.yaml"), "-o", "json"], capture_output=True, text=True, timeout=60)
    assert again.returncode == 0, again.stderr
    assert fast_row["predicted_s"] == round(json.loads(again.stdout)["iteration_time_s"], 4), "priced from the retaken profiles"
    assert fast_row["steal_s"] >= 0
    # Both nodes' agents profiled their own type (the bench keeps the profiles file).
    prof = yaml.safe_load((tmp_path / "runs" / "profiles.yaml").read_text())
    assert sorted(p["gpu"] for p in prof["profiles"]) == ["A100-80G", "V100-32G"]
