"""Rank numbering, segments, the data split and the errors naming what is at fault."""

import json
import os
import subprocess
import sys

import pytest
import torch

from launcher import DATA, groups_for_rank, hand_plan, python_env, ranks_of
from motley_torch.components.data import global_batch_tokens, rank_micro_batches
from motley_torch.model_source import load_model
from motley_torch.plan import Plan, group_entries_for_gpu
from motley_torch.spec import ModelSpec, PlanError

SPEC = dict(name="t", layers=4, hidden=32, heads=4, seq_len=8, vocab=64)


def asym():
    # replica 0: 3 micro-batches over two stages, the first with dp 2; replica 1: one stage, 1 micro-batch
    return hand_plan(SPEC, 8, 2, [
        dict(micro_batches=3, stages=[dict(layers=[0, 1], tp=2, dp=2, gpus=[("a", 0), ("a", 1), ("a", 2), ("a", 3)]),
                                      dict(layers=[1, 4], tp=2, dp=1, gpus=[("b", 0), ("b", 1)])]),
        dict(micro_batches=1, stages=[dict(layers=[0, 4], tp=2, dp=1, gpus=[("c", 0), ("c", 1)])]),
    ])


def test_rank_numbering_matches_the_coordinator():
    doc = asym()
    plan = Plan(doc)
    want = ranks_of(doc)
    assert plan.world_size == 8
    for r, w in zip(plan.ranks, want):
        assert (r.rank, r.node, r.gpu, r.local_rank, r.replica, r.stage, r.tp_rank, r.stage_dp_rank) == (
            w["rank"], w["node"], w["gpu"], w["local_rank"], w["replica"], w["stage"], w["tp_rank"], w["stage_dp_rank"])
    assert plan.rank_of[("b", 1)] == 5


def test_segments_and_their_gradient_rings():
    plan = Plan(asym())
    assert plan.segments() == [(0, 1), (1, 4)]
    assert plan.segment_holders((0, 1), 0) == [0, 2, 6]
    assert plan.segment_holders((1, 4), 1) == [5, 7]
    dp = [(g.layers, g.ranks) for g in plan.comm_groups if g.kind == "dp"]
    assert dp == [((0, 1), [0, 2, 6]), ((0, 1), [1, 3, 7]), ((1, 4), [4, 6]), ((1, 4), [5, 7])]


def test_hop_pairs_between_stages_of_different_dp():
    plan = Plan(asym())
    assert plan.hop_pairs(0, 0) == [(0, 0, (0, 1)), (1, 0, (1, 2))]


def test_data_slices_cover_the_global_batch_once():
    doc = asym()
    plan = Plan(doc)
    tokens = global_batch_tokens(5, 3, 8, 8, 64)
    assert tokens.shape == (8, 9)
    assert torch.equal(tokens, global_batch_tokens(5, 3, 8, 8, 64))
    assert not torch.equal(tokens, global_batch_tokens(5, 4, 8, 8, 64))
    # replica 0 rows 0..5 (3 micro-batches of 2; stage 0 dp 2 takes one row each), replica 1 rows 6..7
    assert plan.rank_samples(0) == [(0, 1), (2, 3), (4, 5)]
    assert plan.rank_samples(2) == [(1, 2), (3, 4), (5, 6)]
    assert plan.rank_samples(4) == [(0, 2), (2, 4), (4, 6)]
    assert plan.rank_samples(6) == [(6, 8)]
    for stage_ranks in ([0, 2, 6], [4, 6]):  # first stages / last stages, TP rank 0
        rows = sorted(r for rank in stage_ranks for a, b in plan.rank_samples(rank) for r in range(a, b))
        assert rows == list(range(8))
    mb = rank_micro_batches(plan, 2, tokens)
    assert torch.equal(mb[1][0], tokens[3:4, :-1]) and torch.equal(mb[1][1], tokens[3:4, 1:])


def test_groups_file_matches_the_agents():
    doc = asym()
    doc["comm_groups"][4]["node_env"] = {"a": {"NCCL_IB_GID_INDEX": "3"}}
    mine = group_entries_for_gpu(doc, "a", 0)
    agent, common = groups_for_rank(doc, "a", 0)
    assert mine == agent
    assert [e["index"] for e in mine] == [0, 4, 5]


def test_errors_name_the_field():
    doc = asym()
    doc["replicas"][1]["samples"] = 3
    with pytest.raises(PlanError, match=r"replicas\[1\]\.samples"):
        Plan(doc)
    doc = asym()
    del doc["model_spec"]
    with pytest.raises(PlanError, match="model_spec"):
        Plan(doc)
    assert Plan(doc, ModelSpec.from_dict(SPEC)).model.ffn_hidden == 128
    doc = asym()
    doc["replicas"][0]["stages"][1]["layers"] = [2, 4]
    with pytest.raises(PlanError, match=r"stages\[1\]\.layers"):
        Plan(doc)
    with pytest.raises(PlanError, match="kv_heads"):
        ModelSpec.from_dict(dict(SPEC, kv_heads=3))
    assert load_model(str(DATA / "tiny6-gqa.yaml")).kv_heads == 2


def test_a_rank_with_a_bad_environment_exits_naming_the_variable(tmp_path):
    env = {k: v for k, v in python_env().items() if not k.startswith("MOTLEY_")}
    out = subprocess.run([sys.executable, "-m", "motley_torch.train", "--steps", "1"], env=env, capture_output=True,
                         text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2 and "MOTLEY_PLAN: not set" in out.stderr, out.stderr


@pytest.mark.parametrize("bad,var", [
    (dict(WORLD_SIZE="4"), "WORLD_SIZE"),
    (dict(RANK="9"), "RANK"),
    (dict(MOTLEY_STAGE="0"), "MOTLEY_STAGE"),
    (dict(MOTLEY_NODE="z"), "MOTLEY_NODE"),
    (dict(MASTER_PORT="x"), "MASTER_PORT"),
    (dict(MOTLEY_NCCL_GROUPS="/nonexistent"), "MOTLEY_NCCL_GROUPS"),
    (dict(groups="[]"), "MOTLEY_NCCL_GROUPS"),
    (dict(groups='[{"kind": "pp"}, {"kind": "tp"}, {"kind": "dp"}]'), "MOTLEY_NCCL_GROUPS"),
    (dict(plan="{}"), "MOTLEY_PLAN"),
])
def test_init_names_the_variable_at_fault(tmp_path, monkeypatch, bad, var):
    from motley_torch.distributed.groups import RankEnvError, init

    doc = asym()
    plan = tmp_path / "plan.json"
    plan.write_text(bad.pop("plan", json.dumps(doc)))
    groups = tmp_path / "groups.json"
    entries, _ = groups_for_rank(doc, "b", 1)  # rank 5: replica 0, stage 1
    groups.write_text(bad.pop("groups", json.dumps(entries)))
    for k in list(os.environ):
        if k.startswith("MOTLEY_"):
            monkeypatch.delenv(k)
    env = dict(MOTLEY_PLAN=str(plan), RANK="5", WORLD_SIZE="8", MASTER_ADDR="127.0.0.1", MASTER_PORT="1",
               MOTLEY_NCCL_GROUPS=str(groups), MOTLEY_NODE="b", MOTLEY_STAGE="1", MOTLEY_REPLICA="0")
    env.update(bad)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(RankEnvError) as e:
        init()
    assert str(e.value).startswith(var), str(e.value)


def test_nccl_config_carries_the_net_name_and_the_per_communicator_fields():
    from motley_torch.distributed.groups import _refused, nccl_options

    opts, fields, warn = nccl_options("IB", {"NCCL_IB_TC": "106", "NCCL_NET": "IB"}, "motley-dp-7")
    assert warn is None
    assert fields == {"net_name": "IB", "traffic_class": 106, "comm_name": "motley-dp-7"}
    assert opts.config.net_name == "IB" and opts.config.traffic_class == 106
    _, fields, _ = nccl_options(None, {}, "motley-tp-0")
    assert fields == {"comm_name": "motley-tp-0"}
    assert _refused("NCCL_IB_DISABLE", "1") and not _refused("NCCL_IB_DISABLE", "0")
    assert not _refused("NCCL_NET", "Socket")


def test_hop_pairs_when_dp_goes_from_two_to_three():
    doc = hand_plan(SPEC, 12, 6, [dict(micro_batches=2, stages=[
        dict(layers=[0, 2], tp=1, dp=2, gpus=[("a", 0), ("a", 1)]),
        dict(layers=[2, 4], tp=1, dp=3, gpus=[("b", 0), ("b", 1), ("b", 2)])])])
    plan = Plan(doc)
    assert plan.hop_pairs(0, 0) == [(0, 0, (0, 2)), (0, 1, (2, 3)), (1, 1, (3, 4)), (1, 2, (4, 6))]
    from motley_torch.distributed.groups import hop_peers

    assert hop_peers(plan, 0, 0) == [(0, 2), (0, 3), (1, 3), (1, 4)]
    assert plan.rank_samples(3) == [(2, 4), (8, 10)]


def test_launcher_writes_groups_files_as_the_agent_does():
    """The example of contract/src/groups.rs (agent/src/groups.rs before it), through the
    launcher's copy of the agent's rule and the library's."""
    plan = {"comm_groups": [
        {"kind": "tp", "gpus": [{"node": "a", "index": 0}, {"node": "a", "index": 1}], "transport": "nvlink",
         "env": {"NCCL_P2P_LEVEL": "NVL"}, "nccl_net": None, "replica": 0, "stage": 0, "layers": [0, 2]},
        {"kind": "dp", "gpus": [{"node": "a", "index": 0}, {"node": "b", "index": 0}], "transport": "ib",
         "env": {"NCCL_NET": "IB", "NCCL_IB_HCA": "=mlx5_0:1", "NCCL_P2P_LEVEL": "NVL"},
         "node_env": {"a": {"NCCL_IB_GID_INDEX": "3"}}, "nccl_net": "IB", "replica": None, "stage": None,
         "layers": [0, 2]},
        {"kind": "dp", "gpus": [{"node": "a", "index": 1}, {"node": "b", "index": 1}], "transport": "socket",
         "env": {"NCCL_NET": "Socket"}, "nccl_net": "Socket", "replica": None, "stage": None, "layers": [0, 2]},
    ]}
    groups, common = groups_for_rank(plan, "a", 0)
    assert [g["kind"] for g in groups] == ["tp", "dp"] and [g["index"] for g in groups] == [0, 1]
    assert groups[1]["env"]["NCCL_IB_GID_INDEX"] == "3"
    assert common == {"NCCL_P2P_LEVEL": "NVL"}
    groups, common = groups_for_rank(plan, "b", 0)
    assert len(groups) == 1 and "NCCL_IB_GID_INDEX" not in groups[0]["env"]
    assert common["NCCL_NET"] == "IB"
    assert group_entries_for_gpu(plan, "a", 0) == groups_for_rank(plan, "a", 0)[0]
    old, _ = groups_for_rank(plan, "a", 0, extended=False)
    assert set(old[0]) == {"kind", "replica", "stage", "nccl_net", "env"}


def test_a_catalog_name_resolves_through_motley_model_show():
    from launcher import motley_bin

    exe = motley_bin()
    assert exe, "run-tests sets MOTLEY_BIN"
    spec = load_model("llama-7b", motley_bin=exe)
    assert (spec.layers, spec.hidden, spec.heads, spec.kv_heads, spec.ffn_hidden, spec.gated_mlp) == (32, 4096, 32, 32, 11008, True)
    with pytest.raises(PlanError, match="gpt-9000"):
        load_model("gpt-9000", motley_bin=exe)
