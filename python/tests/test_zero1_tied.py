"""ZeRO-1 with a tied embedding/head (tiny-llama ties them) on CPU ranks (gloo): checkpoints of
one-stage replicas, where the head is the embedding, save and restore; the tied gradient of
multi-stage replicas is summed in fp32 under half weights; and --save-params / --save-hf with
half weights write the fp32 masters (python/README.md, "ZeRO-1"; docs/checkpoint.md, "ZeRO-1")."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file

from launcher import DATA, HERE, check_ok, hand_plan, launch, python_env
from test_zero1 import LAYERS, SPEC, single, steps, tp2, two_replicas
from tolerance import assert_steps_close

from motley_torch.models.hf import hf_name
from motley_torch.spec import ModelSpec

assert yaml.safe_load((DATA / "tiny-llama.yaml").read_text())["tie_embeddings"], "these tests need a tied model"


def one_stage(dp: int) -> dict:
    """dp replicas of one stage each (the head is the embedding): one ring of dp members."""
    micro = {2: [2, 2], 3: [2, 1, 1]}[dp]
    return hand_plan(SPEC, 8, 2, [dict(micro_batches=m, stages=[dict(layers=[0, LAYERS], tp=1, dp=1, gpus=[(f"n{i}", 0)])])
                                  for i, m in enumerate(micro)])


def headers(sdir: Path) -> dict:
    """Unit file name -> its `motley` header."""
    out = {}
    for p in sdir.iterdir():
        if p.name.endswith(".safetensors") and not p.name.startswith("rank."):
            with safe_open(str(p), framework="pt") as f:
                out[p.name] = json.loads(f.metadata()["motley"])
    return out


@pytest.mark.parametrize("dp", [2, 3])
def test_zero1_checkpoints_a_tied_one_stage_model_and_restores_it(tmp_path, dp):
    """On a one-stage replica the tied head is the embedding: the head's unit is written from
    the embedding's master, so its block is owned with the embedding's (it crashed with a
    KeyError when a different member owned it). Saved at step 3 and restored, the run goes on
    with the uninterrupted run's losses."""
    plan = one_stage(dp)
    ckpt = tmp_path / "ckpt"
    base = ["--steps", "6", "--seed", "4", "--zero1", "--bucket-mb", "0.01"]
    first = launch(plan, base + ["--ckpt-dir", str(ckpt), "--ckpt-every", "3", "--ckpt-sync"], tmp_path / "first")
    check_ok(first)
    got = steps(first[0].stdout)
    assert_steps_close([d["loss"] for d in got], [d["loss"] for d in single("--steps", "6")], LAYERS,
                       f"ZeRO-1, {dp} one-stage replicas: losses against the single process's")
    sdir = ckpt / "step-00000003"
    heads = headers(sdir)
    writer = {(h["block"], h["part"]): h["sharding"]["dp_rank"] for h in heads.values()}
    assert len(writer) == len(heads), "every unit written once"
    assert writer[("head", "model")] == writer[("embed", "model")], writer
    assert len(set(writer.values())) >= 2, f"the blocks are cut over the ring: {writer}"
    files = json.dumps(sorted(str(p) for p in sdir.iterdir() if p.name.endswith(".safetensors")))
    again = launch(plan, base + ["--ckpt-restore", files], tmp_path / "again")
    check_ok(again)
    resumed = steps(again[0].stdout)
    assert [d["step"] for d in resumed] == [3, 4, 5]
    # The same plan from the fp32 masters and moments: the same sums, the same bits.
    assert [d["loss"] for d in resumed] == [d["loss"] for d in got[3:]], (got, resumed)


def test_zero1_sums_the_tied_gradient_in_fp32_under_bf16(tmp_path):
    """Two replicas of two stages, bf16 weights: each of the 4 holders of the tied matrix has a
    bf16 gradient; its master's gradient is their fp32 sum (within fp32's rounding of 4 terms),
    not a bf16 sum, which rounds to 8 significant bits."""
    probe = tmp_path / "probe"
    probe.mkdir()
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), python_env()["PYTHONPATH"]]), "MOTLEY_PROBE_DIR": str(probe)}
    res = launch(two_replicas(), ["--steps", "1", "--seed", "4", "--dtype", "bf16", "--zero1"], tmp_path / "run",
                 module="zero_probe", extra_env=env)
    check_ok(res)
    got = [load_file(str(p)) for p in sorted(probe.iterdir())]
    assert len(got) == 4, "the first and last stage of each replica hold the tied matrix"
    before = [t for g in got for k, t in g.items() if k.startswith("before.")]
    assert len(before) == 4 and all(not torch.equal(t, before[0]) for t in before[1:])
    want = torch.stack(before).sum(0, dtype=torch.float64)
    bound = 3 * 2.0**-24 * torch.stack(before).abs().sum(0, dtype=torch.float64)  # (n - 1) u sum |g|
    for g in got:
        (after,) = [t for k, t in g.items() if k.startswith("after.")]
        assert after.dtype == torch.float32
        excess = ((after.double() - want).abs() - bound).max().item()
        assert excess <= 0, f"the tied gradient is not the fp32 sum: off by {excess:.3g} beyond fp32 rounding"


def unit_tensors(sdir: Path) -> dict:
    """Full model tensors of a checkpoint's model units (TP shards joined along their split)."""
    parts = {}
    for name, h in headers(sdir).items():
        if h["part"] != "model":
            continue
        data = load_file(str(sdir / name))
        for t, spec in h["tensors"].items():
            parts.setdefault(t, []).append((h["tp_rank"], spec["layout"], data[t]))
    out = {}
    for t, shards in parts.items():
        shards.sort(key=lambda s: s[0])
        layout = shards[0][1]
        out[t] = torch.cat([s[2] for s in shards], layout["axis"]) if layout["kind"] == "split" else shards[0][2]
    return out


@pytest.mark.parametrize("plan_name", ["two_replicas", "tp2"])
def test_zero1_in_bf16_exports_the_fp32_masters(tmp_path, plan_name):
    """--save-params and --save-hf after a ZeRO-1 run in bf16 hold the fp32 masters (those the
    last checkpoint's model units hold), not their bf16 copies."""
    plan = {"two_replicas": two_replicas, "tp2": tp2}[plan_name]()
    ckpt, params, hf = tmp_path / "ckpt", tmp_path / "params", tmp_path / "hf"
    res = launch(plan, ["--steps", "3", "--seed", "4", "--dtype", "bf16", "--zero1", "--bucket-mb", "0.01",
                        "--ckpt-dir", str(ckpt), "--ckpt-every", "3", "--ckpt-sync", "--save-params", str(params),
                        "--save-hf", str(hf)], tmp_path / "run")
    check_ok(res)
    masters = unit_tensors(ckpt / "step-00000003")
    saved = load_file(str(params / "params.safetensors"))
    spec = ModelSpec.from_dict(SPEC)
    with safe_open(str(hf / "model.safetensors"), framework="pt") as f:
        exported = {k: f.get_tensor(k) for k in f.keys()}
    assert set(saved) <= set(masters), (sorted(saved), sorted(masters))
    moved = 0
    for name, t in saved.items():
        m = masters[name]
        assert m.dtype == torch.float32
        moved += int((m.bfloat16().float() != m).sum())
        assert torch.equal(t, m), f"--save-params {name}: not the fp32 master"
        assert torch.equal(exported[hf_name(name, spec)], m), f"--save-hf {name}: not the fp32 master"
    assert moved > 0, "three AdamW steps leave masters that bf16 cannot hold"
