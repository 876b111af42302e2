"""Plans from `motley plan`, run as CPU ranks with the agent's environment: per-step losses and
final parameters equal the single-process run within the rounding a different reduction
order explains (fp32, 20 steps; tolerance.py), and every rank's group
log is what the plan's comm_groups say for it, in plan order."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
import yaml

from launcher import DATA, check_ok, groups_for_rank, hand_plan, launch, losses, motley_bin, motley_plan, single_process
from tolerance import assert_close_rel, assert_steps_close, gradient_ops, layers_of

STEPS = 20
SEED = 7
LR = "3e-3"


@functools.lru_cache(maxsize=None)
def reference(model_file: str, global_batch: int, seq_len: int, out: str):
    ls = single_process(str(DATA / model_file), global_batch, seq_len, STEPS, SEED, Path(out), ["--lr", LR])
    return ls, Path(out) / "params.safetensors"


def shape(plan: dict):
    return [[(s["layers"], s["tp"], s["dp"]) for s in r["stages"]] for r in plan["replicas"]]


def run_and_compare(plan: dict, model_file: str, tmp_path: Path, tmp_path_factory, extended: bool = True):
    from safetensors.torch import load_file

    gb, seq = plan["global_batch"], plan["seq_len"]
    ref_dir = tmp_path_factory.getbasetemp() / f"ref-{model_file}-{gb}-{seq}"
    want, want_params = reference(model_file, gb, seq, str(ref_dir))
    args = ["--steps", str(STEPS), "--seed", str(SEED), "--lr", LR, "--save-params", str(tmp_path / "params")]
    if "model_spec" not in plan:
        args += ["--model", str(DATA / model_file)]
    results = launch(plan, args, tmp_path / "run", extended=extended)
    check_ok(results)
    got = losses(results[0].stdout)
    assert len(got) == STEPS, results[0].stdout
    layers = layers_of(DATA / model_file)
    # The plan sums the same terms in another order (micro-batches, replicas, TP partial sums).
    assert_steps_close(got, want, layers, "distributed losses against the single process's")
    assert want[-1] < want[0], "the loss falls"
    for r in results[1:]:
        assert losses(r.stdout) == [], f"rank {r.rank} printed losses"
    p, q = load_file(str(tmp_path / "params" / "params.safetensors")), load_file(str(want_params))
    assert sorted(p) == sorted(q)
    # Each update carries its gradient's relative rounding error (AdamW's normalisation keeps it
    # relative), and the steps' errors add as a random walk (tolerance.step_ops). The
    # parameters are compared normwise, against the model's largest (Higham, section 1.2), not
    # each against its own: the key bias's gradient is zero in exact arithmetic (softmax ignores
    # a shift common to all keys), so only rounding noise moves it, which AdamW's division by the
    # noise's own RMS turns into steps of either sign that differ between any two runs.
    norm = max(t.abs().max().item() for t in q.values())
    for k in sorted(p):
        assert_close_rel(p[k], q[k], math.sqrt(STEPS) * gradient_ops(layers), f"parameter {k} after {STEPS} steps",
                         scale=norm)
    check_group_logs(plan, results)
    check_views(plan, results)
    return results


def check_views(plan: dict, results):
    """The rank view init() returned (logged by the trainer): layers, TP group, the
    neighbouring stages and the gradient ring of every layer segment, derived independently."""
    from launcher import ranks_of

    ranks = ranks_of(plan)
    rank_of = {(r["node"], r["gpu"]): r["rank"] for r in ranks}
    stage_ranks = {}
    for r in ranks:
        stage_ranks.setdefault((r["replica"], r["stage"]), []).append(r["rank"])
    layers = (plan.get("model_spec") or {}).get("layers") or plan["replicas"][0]["stages"][-1]["layers"][1]
    cuts = sorted({0, layers} | {s["layers"][0] for r in plan["replicas"] for s in r["stages"]})
    for res in results:
        views = [json.loads(x.split(" ", 1)[1]) for x in res.log.splitlines() if x.startswith("motley-view ")]
        assert len(views) == 1, res.log[-2000:]
        v = views[0]
        me = ranks[res.rank]
        st = plan["replicas"][me["replica"]]["stages"][me["stage"]]
        mine = stage_ranks[(me["replica"], me["stage"])]
        tp = st["tp"]
        d = me["stage_dp_rank"]
        segs = []
        for l0, l1 in zip(cuts[:-1], cuts[1:]):
            if not st["layers"][0] <= l0 < st["layers"][1]:
                continue
            ring = []
            for r in plan["replicas"]:
                s = next(s for s in r["stages"] if s["layers"][0] <= l0 < s["layers"][1])
                ring += [rank_of[(g["node"], g["index"])] for g in s["gpus"][me["tp_rank"]::s["tp"]]]
            idx = [i for i, g in enumerate(plan["comm_groups"]) if g["kind"] == "dp" and g["layers"] == [l0, l1]
                   and [rank_of[(m["node"], m["index"])] for m in g["gpus"]] == ring]
            segs.append({"layers": [l0, l1], "ranks": ring, "group": idx[0] if len(ring) > 1 else None})
        assert v == dict(v, rank=res.rank, replica=me["replica"], stage=me["stage"], layers=st["layers"],
                         tp_rank=me["tp_rank"], tp_ranks=mine[d * tp:(d + 1) * tp], stage_dp_rank=d,
                         stage_dp_size=st["dp"], pp_prev_ranks=stage_ranks.get((me["replica"], me["stage"] - 1), []),
                         pp_next_ranks=stage_ranks.get((me["replica"], me["stage"] + 1), []), segments=segs,
                         backend="gloo"), f"rank {res.rank}"


def check_group_logs(plan: dict, results):
    """Each rank logged its groups in the plan's order, with the plan's members (global ranks),
    env (node_env merged) and net name; NCCL_IB_DISABLE was never set to anything but 0."""
    from launcher import ranks_of

    rank_of = {(r["node"], r["gpu"]): r["rank"] for r in ranks_of(plan)}
    node_of = {r["rank"]: (r["node"], r["gpu"]) for r in ranks_of(plan)}
    for res in results:
        node, gpu = node_of[res.rank]
        want = []
        entries, _ = groups_for_rank(plan, node, gpu)
        idx = [i for i, g in enumerate(plan["comm_groups"]) if any(m["node"] == node and m["index"] == gpu for m in g["gpus"])]
        for i, e in zip(idx, entries):
            g = plan["comm_groups"][i]
            env = {k: v for k, v in e["env"].items() if not (k == "NCCL_IB_DISABLE" and v != "0")}
            want.append(dict(index=i, kind=g["kind"], members=[rank_of[(m["node"], m["index"])] for m in g["gpus"]],
                             env=env, net_name=g.get("nccl_net")))
        got = [{k: line[k] for k in ("index", "kind", "members", "env", "net_name")} for line in res.groups_log]
        assert got == want, f"rank {res.rank}"
        assert all(line["rank"] == res.rank for line in res.groups_log)
        # the stderr copy says the same
        err = [json.loads(x.split(" ", 1)[1]) for x in res.log.splitlines() if x.startswith("motley-group ")]
        assert err == res.groups_log
        for line in res.groups_log:
            assert line["env"].get("NCCL_IB_DISABLE", "0") == "0"
        assert res.env.get("NCCL_IB_DISABLE", "0") == "0"
    # every group was logged by each of its members, nobody else
    for i, g in enumerate(plan["comm_groups"]):
        members = sorted(rank_of[(m["node"], m["index"])] for m in g["gpus"])
        assert sorted(r.rank for r in results if any(x["index"] == i for x in r.groups_log)) == members


needs_motley = pytest.mark.skipif(motley_bin() is None, reason="no motley binary (MOTLEY_BIN or target/release/motley)")
PIN = ("--tp", "2", "--micro-batch", "2", "--reserve-gib", "0")


@needs_motley
def test_a_uniform_two_replicas_two_stages_tp2(tmp_path, tmp_path_factory):
    """(a) 4 nodes of 2 small, slow GPUs: 2 replicas x 2 stages x tp 2 (8 ranks)."""
    plan = motley_plan("uniform-4x2.yaml", "tiny4.yaml", 8, *PIN, "--max-stages", "2")
    assert shape(plan) == [[([0, 2], 2, 1), ([2, 4], 2, 1)]] * 2, shape(plan)
    assert plan.get("model_spec", {}).get("layers", 4) == 4
    run_and_compare(plan, "tiny4.yaml", tmp_path, tmp_path_factory)


@needs_motley
def test_b_replicas_of_different_depths_and_uneven_shares(tmp_path, tmp_path_factory):
    """(b) one pair of large GPUs beside two nodes of small ones: a one-stage replica with 2 of
    the 8 samples and a two-stage replica with 6 (6 ranks, TP 2, a GQA + SwiGLU model)."""
    plan = motley_plan("mixed-3x2.yaml", "tiny6-gqa.yaml", 8, *PIN, "--max-stages", "2")
    assert shape(plan) == [[([0, 6], 2, 1)], [([0, 3], 2, 1), ([3, 6], 2, 1)]], shape(plan)
    assert [r["samples"] for r in plan["replicas"]] == [2, 6]
    run_and_compare(plan, "tiny6-gqa.yaml", tmp_path, tmp_path_factory)


@needs_motley
def test_b_dp_changes_across_a_hop_older_agent_and_plan(tmp_path, tmp_path_factory):
    """(b') a stage of two TP pairs (dp 2) feeding one pair (dp 1): each sender pair sends its
    half of the micro-batch. Run as an older agent and planner would: the groups file without
    index/gpus/layers, the plan without model_spec (the trainer gets --model). One ring of the
    plan is made to carry NCCL_IB_DISABLE=1, which a rank must never set."""
    # Written by hand with the planner's group rules (launcher.hand_plan): given these GPUs
    # with the large pair twice as fast, the planner (pricing the runtime's memory) puts the
    # large pair first, and this hop's direction is the point of the test.
    spec = yaml.safe_load((DATA / "tiny6-gqa.yaml").read_text())
    plan = hand_plan(spec, 8, 2, [dict(micro_batches=4, stages=[
        dict(layers=[0, 2], tp=2, dp=2, gpus=[("small-0", 0), ("small-0", 1), ("small-1", 0), ("small-1", 1)]),
        dict(layers=[2, 6], tp=2, dp=1, gpus=[("big", 0), ("big", 1)])])],
        node_kind={"big": "ib", "small-0": "ib", "small-1": "ib"}, with_model_spec=False)
    assert shape(plan) == [[([0, 2], 2, 2), ([2, 6], 2, 1)]], shape(plan)
    ring = next(g for g in plan["comm_groups"] if g["kind"] == "dp")
    ring["env"]["NCCL_IB_DISABLE"] = "1"
    results = run_and_compare(plan, "tiny6-gqa.yaml", tmp_path, tmp_path_factory, extended=False)
    warned = [x for r in results for x in r.groups_log if "warning" in x]
    assert len(warned) == len(ring["gpus"]) and all("NCCL_IB_DISABLE" in x["warning"] for x in warned)


@needs_motley
def test_c_holmes_ib_and_roce_islands_joined_by_ethernet(tmp_path, tmp_path_factory):
    """(c) Holmes' hybrid cluster in small: each replica's pipeline inside an island over its
    RDMA (the RoCE one with a node_env GID index), gradient rings between islands over sockets."""
    plan = motley_plan("holmes-hybrid-4x2.yaml", "tiny4.yaml", 8, *PIN, "--max-stages", "2")
    assert shape(plan) == [[([0, 2], 2, 1), ([2, 4], 2, 1)]] * 2, shape(plan)
    transports = {(g["kind"], g["transport"]) for g in plan["comm_groups"]}
    assert {("pp", "ib"), ("pp", "roce"), ("dp", "socket")} <= transports, transports
    assert any(g.get("node_env") for g in plan["comm_groups"])
    results = run_and_compare(plan, "tiny4.yaml", tmp_path, tmp_path_factory)
    roce1 = [r for r in results if r.env["MOTLEY_NODE"] == "roce-1"]
    pp = [x for r in roce1 for x in r.groups_log if x["kind"] == "pp"]
    assert pp and all(x["env"]["NCCL_IB_GID_INDEX"] == "5" and x["net_name"] == "IB" for x in pp)
    dp = [x for r in results for x in r.groups_log if x["kind"] == "dp"]
    assert dp and all(x["net_name"] == "Socket" and x["env"]["NCCL_NET"] == "Socket" for x in dp)


def test_hand_written_plan_with_dp_two_to_three(tmp_path, tmp_path_factory):
    """Hand-written in the documented form (the planner makes no such plan on a cluster this
    small): a stage of dp 2 feeding a stage of dp 3, tp 1, micro-batches of 6 rows; the middle
    receiver takes rows from both senders, every sender feeds two receivers."""
    spec = yaml.safe_load((DATA / "tiny4.yaml").read_text())
    plan = hand_plan(spec, 12, 6, [dict(micro_batches=2, stages=[
        dict(layers=[0, 1], tp=1, dp=2, gpus=[("a", 0), ("a", 1)]),
        dict(layers=[1, 4], tp=1, dp=3, gpus=[("b", 0), ("b", 1), ("b", 2)])])], node_kind={"a": "ib", "b": "ib"})
    run_and_compare(plan, "tiny4.yaml", tmp_path, tmp_path_factory)
