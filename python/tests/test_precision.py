"""Mixed precision and overlapped gradient sync on CPU ranks (gloo): fp32 master weights with
bf16/fp16 autocast, one dynamic loss scale for the job (an overflow skips the step on every
rank and halves the scale, clean steps double it, the scale survives a checkpoint), gradient
buckets launched during the backward pass giving the losses of the unbucketed sync, and the
memory line."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
import yaml

from launcher import DATA, PYTHON, check_ok, hand_plan, launch, python_env
from tolerance import EPS_BF16, EPS_FP16, assert_half_steps_close, assert_steps_close

from motley_torch.spec import PlanError
from motley_torch.components.precision import LossScaler, resolve

MODEL = DATA / "tiny-llama.yaml"
SPEC = yaml.safe_load(MODEL.read_text())
LAYERS = SPEC["layers"]


def steps(stdout: str):
    return [d for d in map(json.loads, stdout.splitlines()) if "loss" in d]


def two_replicas():
    """Two replicas of two stages each (4 ranks): every layer's ring has two members."""
    return hand_plan(SPEC, 8, 2, [dict(micro_batches=2, stages=[
        dict(layers=[0, 2], tp=1, dp=1, gpus=[(n, 0)]), dict(layers=[2, 4], tp=1, dp=1, gpus=[(n, 1)])])
        for n in ("a", "b")])


def single(*extra):
    r = subprocess.run([PYTHON, "-m", "motley_torch.train", "--single-process", "--model", str(MODEL),
                        "--global-batch", "8", "--seq-len", "16", "--seed", "4", *extra], capture_output=True,
                       text=True, env=python_env(OMP_NUM_THREADS="1"), timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_resolve_follows_the_plan_on_cuda_and_is_fp32_on_the_cpu():
    cpu = torch.device("cpu")
    assert resolve("auto", "fp16", cpu) == "fp32"
    assert resolve("bf16", "fp16", cpu) == "bf16"
    with pytest.raises(PlanError, match="--dtype: 'fp8'"):
        resolve("fp8", None, cpu)


def test_the_loss_scaler_skips_on_any_ranks_overflow_and_grows_after_a_window():
    p = torch.nn.Parameter(torch.ones(3))
    s = LossScaler(True, initial=8.0, window=2)
    p.grad = torch.full((3,), 16.0)
    assert s.step([p], agree=lambda local: True) is True, "another rank overflowed: skip"
    assert s.scale == 4.0 and p.grad is None
    p.grad = torch.full((3,), 8.0)
    assert s.step([p], agree=lambda local: local) is False and torch.equal(p.grad, torch.full((3,), 2.0))
    p.grad = torch.full((3,), 8.0)
    assert s.step([p]) is False and s.scale == 8.0, "two clean steps double it"
    p.grad = torch.tensor([1.0, float("inf"), 0.0])
    assert s.step([p]) is True and s.scale == 4.0 and s.clean == 0
    off = LossScaler(False)
    p.grad = torch.tensor([float("nan"), 0.0, 0.0])
    assert off.step([p]) is False and off.factor() == 1.0
    with pytest.raises(PlanError, match="--loss-scale-window"):
        LossScaler(True, window=0)


def test_fp16_loss_scale_is_one_for_the_job_and_survives_a_checkpoint(tmp_path):
    """A scale far too large overflows: every step is skipped on every rank (rank 0's lines say
    so) and the scale halves until steps go through; then it doubles every 2 clean steps. The
    distributed run takes the single process's decisions, and a restore from step 6 goes on
    with the scale it had."""
    args = ["--dtype", "fp16", "--initial-loss-scale", str(2.0 ** 24), "--loss-scale-window", "2", "--seed", "4"]
    ckpt = tmp_path / "ckpt"
    res = launch(two_replicas(), ["--steps", "10", *args, "--ckpt-dir", str(ckpt), "--ckpt-every", "6",
                                  "--ckpt-sync"], tmp_path / "run")
    check_ok(res)
    got = steps(res[0].stdout)
    want = steps(single("--steps", "10", "--dtype", "fp16", "--initial-loss-scale", str(2.0 ** 24),
                        "--loss-scale-window", "2"))
    decisions = [(d["loss_scale"], d["skipped"]) for d in got]
    assert decisions == [(d["loss_scale"], d["skipped"]) for d in want], (got, want)
    assert decisions[0] == (2.0 ** 24, True) and any(not s for _, s in decisions), decisions
    first = next(i for i, (_, s) in enumerate(decisions) if not s)
    assert all(decisions[i][0] == decisions[i - 1][0] / 2 for i in range(1, first + 1))
    # Both in fp16: the same fp32 masters rounded to the same halves; the runs part only where
    # their fp32 sums' order carries a value across a half rounding boundary, which moves it by
    # one unit roundoff.
    assert_half_steps_close([d["loss"] for d in got], [d["loss"] for d in want], "fp16 losses against the single "
                            "process's", EPS_FP16)
    files = sorted(str(p) for p in (ckpt / "step-00000006").iterdir() if p.name.endswith(".safetensors"))
    again = launch(two_replicas(), ["--steps", "10", *args, "--ckpt-restore", json.dumps(files)], tmp_path / "again")
    check_ok(again)
    resumed = steps(again[0].stdout)
    assert [(d["step"], d["loss_scale"], d["skipped"]) for d in resumed] == [
        (d["step"], d["loss_scale"], d["skipped"]) for d in got[6:]]


def test_bf16_trains_close_to_fp32_and_overlap_equals_the_unbucketed_sync(tmp_path):
    plan = two_replicas()
    base = ["--steps", "4", "--seed", "4"]
    over = launch(plan, base + ["--bucket-mb", "0.01"], tmp_path / "over")
    plain = launch(plan, base + ["--no-overlap"], tmp_path / "plain")
    check_ok(over)
    check_ok(plain)
    a, b = steps(over[0].stdout), steps(plain[0].stdout)
    assert len(a) == 4
    # Every ring has two members, and a + b is b + a whatever buckets group them: the same bits.
    assert [d["loss"] for d in a] == [d["loss"] for d in b], (a, b)
    want = steps(single("--steps", "4"))
    assert_steps_close([d["loss"] for d in a], [d["loss"] for d in want], LAYERS,
                       "the bucketed sync's losses against the single process's")
    half = launch(plan, base + ["--dtype", "bf16"], tmp_path / "bf16")
    check_ok(half)
    h = steps(half[0].stdout)
    # bf16 rounds each product's inputs by up to one unit roundoff (today the losses stay within
    # about 1/300 of the bound).
    assert_half_steps_close([d["loss"] for d in h], [d["loss"] for d in want], "bf16 losses against fp32's", EPS_BF16)
    fp32_noise = max(abs(x["loss"] - y["loss"]) for x, y in zip(a, want))
    assert max(abs(x["loss"] - y["loss"]) for x, y in zip(h, want)) > 10 * fp32_noise, "bf16 really ran"
    assert all("motley-precision bf16" in r.log for r in half)
    mem = [json.loads(x)["memory"] for r in over for x in r.stdout.splitlines() if x.startswith('{"memory"')]
    assert len(mem) == 4, "every rank prints one memory line after its first step"
    for m in mem:
        assert m["optimizer_mb"] == pytest.approx(2 * m["params_mb"], rel=0.01), m
        assert m["grads_mb"] == pytest.approx(m["params_mb"], rel=0.01) and m["peak_mb"] > 0


def test_recompute_gives_the_same_losses_on_a_tp2_pipeline(tmp_path):
    plan = hand_plan(SPEC, 8, 2, [dict(micro_batches=4, stages=[
        dict(layers=[0, 2], tp=2, dp=1, gpus=[("a", 0), ("a", 1)]),
        dict(layers=[2, 4], tp=2, dp=1, gpus=[("b", 0), ("b", 1)])])])
    plan["recompute"] = True
    on = launch(plan, ["--steps", "3", "--seed", "4"], tmp_path / "on")
    plan["recompute"] = False
    off = launch(plan, ["--steps", "3", "--seed", "4"], tmp_path / "off")
    check_ok(on)
    check_ok(off)
    a, b = steps(on[0].stdout), steps(off[0].stdout)
    assert len(a) == 3
    # Recomputing runs the same operations on the same values again: the same bits.
    assert [d["loss"] for d in a] == [d["loss"] for d in b], (a, b)
    want = steps(single("--steps", "3", "--recompute"))
    assert_steps_close([d["loss"] for d in a], [d["loss"] for d in want], LAYERS,
                       "the TP 2 pipeline's losses against the single process's")
    assert all("motley-recompute on" in r.log for r in on) and not any("motley-recompute on" in r.log for r in off)


def test_recompute_runs_every_block_forward_again_in_backward(monkeypatch):
    from motley_torch.models.transformer import Block, GPTStage
    from motley_torch.spec import ModelSpec

    spec = ModelSpec.from_dict(SPEC)
    seen = []
    forward = Block.forward
    monkeypatch.setattr(Block, "forward", lambda self, x: seen.append(1) or forward(self, x))
    for recompute, calls in ((False, 1), (True, 2)):
        seen.clear()
        m = GPTStage(spec, 8, (0, 4))
        m.init_from_seed(1)
        m.recompute = recompute
        m(torch.randint(0, 64, (2, 8))).sum().backward()
        assert len(seen) == 4 * calls, (recompute, len(seen))


def test_ranks_follow_the_planners_precision_and_recompute(tmp_path):
    """A plan from `motley plan --recompute`: it records its precision (auto resolved) and
    recompute; CPU ranks compute in fp32 under auto (the plan's GPUs are only stood in for) and
    recompute as the plan assumes."""
    from launcher import motley_plan

    plan = motley_plan("uniform-4x2.yaml", "tiny-llama.yaml", 8, "--tp", "2", "--micro-batch", "2", "--reserve-gib",
                       "0", "--max-stages", "2", "--recompute")
    assert plan["recompute"] is True and plan["precision"] in ("bf16", "fp16"), plan.get("precision")
    res = launch(plan, ["--steps", "2", "--seed", "4"], tmp_path)
    check_ok(res)
    assert all(f"motley-precision fp32 (asked auto, plan {plan['precision']})" in r.log for r in res)
    assert all("motley-recompute on" in r.log for r in res)
