"""Half weights on the plain path (`--half-weights`, python/README.md "Half weights") on CPU
ranks over gloo: the model's parameters in bf16/fp16 and fp32 masters beside them, cast once
per step. The losses are the autocast run's within one half-precision rounding, with the
gradient sync overlapped or not and with a tied embedding/head summed across stages; the
memory line shows the masters; a checkpoint holds the masters (fp32 units), which a run with
or without half weights restores; `--save-params` exports the masters."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from launcher import PYTHON, check_ok, hand_plan, launch, python_env
from test_zero1 import LAYERS, MODEL, SPEC, asymmetric, memory, steps, two_replicas
from tolerance import EPS_BF16, EPS_FP16, assert_half_steps_close, assert_steps_close

BASE = ["--steps", "4", "--seed", "4"]


@pytest.mark.parametrize("plan_name,dtype,sync", [
    # Two stages each: the tied matrix summed across them (TiedSync); overlapped, and after the
    # backward, which must sum the same elements.
    ("two_replicas", "bf16", "both"),
    # Rings of three and two members; fp16 with one loss scale for the job (and its skips, if any).
    ("asymmetric", "fp16", "late"),
])
def test_half_weights_give_the_autocast_losses_and_keep_fp32_masters(tmp_path, plan_name, dtype, sync):
    assert SPEC["tie_embeddings"], "the model holds a tied embedding/head"
    plan = {"two_replicas": two_replicas, "asymmetric": asymmetric}[plan_name]()
    base = BASE + ["--dtype", dtype] + (["--no-overlap"] if sync == "late" else [])
    plain = launch(plan, base, tmp_path / "plain")
    half = launch(plan, base + ["--half-weights"], tmp_path / "half")
    check_ok(plain)
    check_ok(half)
    assert all(f"motley-half-weights on: {dtype} weights" in r.log for r in half)
    a, b = steps(plain[0].stdout), steps(half[0].stdout)
    assert [d["step"] for d in b] == [d["step"] for d in a] == list(range(4))
    assert [d["skipped"] for d in b] == [d["skipped"] for d in a], "the same steps skipped"
    # The half run keeps bf16/fp16 weights where autocast rounds fp32 ones per product: they
    # differ by one rounding of what autocast leaves in fp32 (the embedding, the norm gains,
    # the residual stream), as ZeRO-1's half weights do (test_zero1).
    assert_half_steps_close([d["loss"] for d in b], [d["loss"] for d in a], f"{dtype} half weights' losses against "
                            f"autocast's", EPS_BF16 if dtype == "bf16" else EPS_FP16)
    before, after = memory(plain), memory(half)
    for r in before:
        # 2 bytes of half weight and 4 of master for every 4 of fp32 weight; the gradients the
        # optimizer steps are the masters' fp32 ones (the half ones are dropped as they come).
        assert after[r]["params_mb"] == pytest.approx(1.5 * before[r]["params_mb"], abs=0.002), (before[r], after[r])
        assert after[r]["grads_mb"] == pytest.approx(before[r]["grads_mb"], abs=0.002), (before[r], after[r])
        assert after[r]["optimizer_mb"] == pytest.approx(before[r]["optimizer_mb"], abs=0.002), (before[r], after[r])
    if sync == "both":
        # Each micro-batch's half gradient is added into its master's fp32 gradient before the
        # overlapped sync's hook counts it: a bucket launched from the backward holds every
        # micro-batch (two per replica here), and the losses are those of the sync run after
        # the backward within fp32 rounding (the same weights, the same sums).
        late = launch(plan, base + ["--half-weights", "--no-overlap"], tmp_path / "late")
        check_ok(late)
        assert_steps_close([d["loss"] for d in b], [d["loss"] for d in steps(late[0].stdout)], LAYERS,
                           "half weights overlapped against after the backward")


def test_half_weights_checkpoint_the_masters_and_export_them(tmp_path):
    """Saved with half weights at step 2: every model unit holds fp32 tensors (the masters). A
    run with half weights restored from it goes on exactly as the uninterrupted run; one
    without (fp32 weights under autocast) within a bf16 rounding. `--save-params` writes fp32
    masters, not their bf16 casts."""
    ckpt, params = tmp_path / "ckpt", tmp_path / "params"
    base = BASE + ["--dtype", "bf16"]
    first = launch(two_replicas(), base + ["--half-weights", "--ckpt-dir", str(ckpt), "--ckpt-every", "2",
                                           "--ckpt-sync", "--save-params", str(params)], tmp_path / "first")
    check_ok(first)
    got = steps(first[0].stdout)
    sdir = ckpt / "step-00000002"
    manifest = json.loads((sdir / "manifest.json").read_text())
    model_units = [u for u in manifest["units"] if u["part"] == "model"]
    assert {u["block"] for u in model_units} == {"embed", "head"} | {f"layer.{i}" for i in range(LAYERS)}
    for u in model_units:
        assert all(s["dtype"] == "F32" for s in u["tensors"].values()), u
        with safe_open(str(sdir / u["file"]), framework="pt") as f:
            assert all(f.get_tensor(k).dtype == torch.float32 for k in f.keys())
    files = json.dumps(sorted(str(p) for p in sdir.iterdir() if p.name.endswith(".safetensors")))
    again = launch(two_replicas(), base + ["--half-weights", "--ckpt-restore", files], tmp_path / "again")
    autocast = launch(two_replicas(), base + ["--ckpt-restore", files], tmp_path / "autocast")
    check_ok(again)
    check_ok(autocast)
    want = [d["loss"] for d in got[2:]]
    resumed = steps(again[0].stdout)
    assert [d["step"] for d in resumed] == [2, 3]
    assert_steps_close([d["loss"] for d in resumed], want, LAYERS, "half weights restored against the uninterrupted run",
                       steps=range(2, 4))
    assert_half_steps_close([d["loss"] for d in steps(autocast[0].stdout)], want,
                            "fp32 weights restored from half weights' masters", EPS_BF16)
    exported = load_file(str(params / "params.safetensors"))
    assert sorted(exported) and all(t.dtype == torch.float32 for t in exported.values())
    # A master is not its bf16 cast: after four AdamW steps of lr 1e-3 most elements fall
    # between two bf16 values.
    w = max(exported.values(), key=lambda t: t.numel())  # the embedding, randomly initialised
    assert (w != w.to(torch.bfloat16).float()).float().mean() > 0.5, "the export holds the fp32 masters"


def test_half_weights_refuse_what_they_cannot_keep(tmp_path):
    """fp32 has no half weights to keep; --save-grads would see none of the gradients (they go to
    the masters as they come); --single-process is the fp32 reference. Each exits 2, naming the
    flag and the fix."""
    plan = hand_plan(SPEC, 8, 2, [dict(micro_batches=4, stages=[dict(layers=[0, LAYERS], tp=1, dp=1, gpus=[("a", 0)])])])
    fp32 = launch(plan, BASE + ["--dtype", "fp32", "--half-weights"], tmp_path / "fp32")
    assert all(r.returncode == 2 for r in fp32)
    assert "--half-weights: the compute type is fp32" in fp32[0].log and "give --dtype bf16 or fp16" in fp32[0].log
    grads = launch(plan, BASE + ["--dtype", "bf16", "--half-weights", "--save-grads", str(tmp_path / "g")],
                   tmp_path / "grads")
    assert all(r.returncode == 2 for r in grads) and "--save-grads: not with --half-weights" in grads[0].log
    r = subprocess.run([PYTHON, "-m", "motley_torch.train", "--single-process", "--model", str(MODEL), "--global-batch",
                        "8", "--seq-len", "16", "--dtype", "bf16", "--half-weights"], capture_output=True, text=True,
                       env=python_env(OMP_NUM_THREADS="1"), timeout=120)
    assert r.returncode == 2 and "--half-weights: the ranks' runtime keeps half weights" in r.stderr, r.stderr

