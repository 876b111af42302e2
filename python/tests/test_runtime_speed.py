"""The runtime's speed features keep the maths: compiled blocks (`--compile on`) give the eager
run's losses (fp32 and bf16), the optimizer is the multi-tensor AdamW on the CPU (fused on
CUDA), the progress lines carry `mfu` exactly when every rank's peak is known, and the flags
are checked. Speed itself is measured by benches (bench/gpu/mfu.py, bench/trainer_vs_ddp.py),
never asserted here."""

from __future__ import annotations

import json
import subprocess
import types

import pytest
import torch
import yaml

from launcher import DATA, PYTHON, check_ok, hand_plan, launch, python_env
from tolerance import EPS_BF16, assert_half_steps_close, assert_steps_close

from motley_torch.components.mfu import train_flops_per_token
from motley_torch.components.stage_init import make_optimizer
from motley_torch.spec import ModelSpec

MODEL = DATA / "tiny-llama.yaml"
SPEC = yaml.safe_load(MODEL.read_text())


def run_single(*extra, env=None):
    r = subprocess.run([PYTHON, "-m", "motley_torch.train", "--single-process", "--model", str(MODEL),
                        "--global-batch", "4", "--seq-len", "16", "--seed", "2", "--steps", "3", *extra],
                       capture_output=True, text=True, env=python_env(OMP_NUM_THREADS="1", **(env or {})), timeout=600)
    return r


def losses(stdout: str):
    return [d["loss"] for d in map(json.loads, stdout.splitlines()) if "loss" in d]


def test_compiled_blocks_give_the_eager_losses():
    eager = run_single("--compile", "off")
    compiled = run_single("--compile", "on")
    assert eager.returncode == 0 and compiled.returncode == 0, eager.stderr + compiled.stderr
    assert "motley-compile on (asked on)" in compiled.stderr and "motley-compile off" in eager.stderr
    # fp32: the compiled kernels add the same elements in another order (fused reductions): the
    # rounding bound of tolerance.assert_steps_close, as for any reordered fp32 sum (1e-5 and
    # tighter on this model).
    assert_steps_close(losses(compiled.stdout), losses(eager.stdout), SPEC["layers"],
                       "compiled fp32 losses against eager")
    assert max(abs(a - b) for a, b in zip(losses(compiled.stdout), losses(eager.stdout))) <= 1e-5
    half_eager = run_single("--compile", "off", "--dtype", "bf16")
    half = run_single("--compile", "on", "--dtype", "bf16")
    assert half.returncode == 0 and half_eager.returncode == 0, half.stderr
    # bf16: the fused kernels round their intermediates to bf16 at other points than eager's
    # separate kernels (a value kept in fp32 registers instead of stored as bf16, or the
    # reverse), each such rounding at most one unit roundoff: the bound of two bf16 runs in
    # another order (tolerance.assert_half_steps_close).
    assert_half_steps_close(losses(half.stdout), losses(half_eager.stdout), "compiled bf16 against eager bf16",
                            EPS_BF16)


def test_compile_flags_are_checked():
    bad = run_single("--compile", "sometimes")
    assert bad.returncode == 2 and "--compile" in bad.stderr
    graphs = run_single("--cuda-graphs")
    assert graphs.returncode == 2
    assert "--cuda-graphs" in graphs.stderr and "CUDA" in graphs.stderr, graphs.stderr
    assert "motley-compile off (asked auto)" in run_single("--steps", "1").stderr, "auto is off on the CPU"


def test_adamw_is_multi_tensor_on_the_cpu():
    model = torch.nn.Linear(4, 3)
    opt = make_optimizer(model.parameters(), types.SimpleNamespace(lr=1e-3, weight_decay=0.01))
    assert opt.defaults["foreach"] is True and not opt.defaults.get("fused")
    assert all(float(st["step"]) == 0.0 and st["exp_avg"].shape == p.shape for p, st in opt.state.items())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused AdamW kernel is CUDA's (python/gpu-check's machine)")
def test_adamw_is_fused_on_cuda():
    model = torch.nn.Linear(4, 3).cuda()
    opt = make_optimizer(model.parameters(), types.SimpleNamespace(lr=1e-3, weight_decay=0.01))
    assert opt.defaults["fused"] is True
    assert all(st["step"].device.type == "cuda" for st in opt.state.values())


def test_mfu_is_reported_when_every_peak_is_known(tmp_path):
    plan = hand_plan(SPEC, 4, 1, [dict(micro_batches=2, stages=[dict(layers=[0, SPEC["layers"]], tp=1, dp=1,
                                                                     gpus=[(n, 0)])]) for n in ("a", "b")])
    args = ["--steps", "2", "--seed", "1"]
    known = launch(plan, args, tmp_path / "known", extra_env={"MOTLEY_PEAK_TFLOPS": "0.5"})
    check_ok(known)
    lines = [d for d in map(json.loads, known[0].stdout.splitlines()) if "loss" in d]
    per_token = train_flops_per_token(ModelSpec.from_dict(SPEC), plan["seq_len"])
    for d in lines:
        # Two ranks of 0.5 TFLOPS each: the job's peak is their sum.
        assert d["mfu"] == pytest.approx(d["tokens_per_s"] * per_token / 1e12, rel=1e-3, abs=1e-5), d
    # One rank's peak unknown: no rank claims an MFU.
    half = launch(plan, args, tmp_path / "half", rank_env={0: {"MOTLEY_PEAK_TFLOPS": "0.5"}})
    check_ok(half)
    assert all("mfu" not in d for d in map(json.loads, half[0].stdout.splitlines()) if "loss" in d)
    r = run_single("--steps", "1", env={"MOTLEY_PEAK_TFLOPS": "2"})
    line = [d for d in map(json.loads, r.stdout.splitlines()) if "loss" in d][0]
    assert line["mfu"] == pytest.approx(line["tokens_per_s"] * train_flops_per_token(ModelSpec.from_dict(SPEC), 16)
                                        / 2e12, rel=1e-3, abs=1e-5)


def test_torch_profile_writes_the_kernels_of_two_steps(tmp_path):
    """--torch-profile DIR: each rank writes its operator table and Chrome trace of steps 3 and 4
    (past compilation and warm-up); the run's losses are the unprofiled run's."""
    plan = hand_plan(SPEC, 4, 1, [dict(micro_batches=2, stages=[dict(layers=[0, SPEC["layers"]], tp=1, dp=1,
                                                                     gpus=[(n, 0)])]) for n in ("a", "b")])
    args = ["--steps", "5", "--seed", "1"]
    prof = tmp_path / "prof"
    got = launch(plan, [*args, "--torch-profile", str(prof)], tmp_path / "profiled")
    check_ok(got)
    plain = launch(plan, args, tmp_path / "plain")
    check_ok(plain)
    assert losses(got[0].stdout) == losses(plain[0].stdout)
    tables = [(prof / f"kernels.rank{rank}.txt").read_text() for rank in (0, 1)]
    for rank, table in enumerate(tables):
        assert table.startswith("# steps 3..4, sorted by self_cpu_time_total"), table[:200]
        assert (prof / f"trace.rank{rank}.json.gz").stat().st_size > 0
    # The rows are torch's profiler's: once, in a whole suite's run on this 2-core machine, one
    # rank's window kept only its gloo collective and none of the operators around it (the other
    # rank's had them all), which no rerun reproduced. The operators are checked on the ranks
    # together.
    assert any("aten::mm" in t or "aten::addmm" in t for t in tables), tables[0][:2000]


@pytest.mark.parametrize("dev", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_a_ranks_micro_batches_reach_its_device_whole(dev):
    """device_micro_batches: the rank's rows of the step's tokens on its device (on a GPU one
    pinned copy, the micro-batches views of it), equal to rank_micro_batches'."""
    from motley_torch.components.data import device_micro_batches, rank_micro_batches
    from motley_torch.plan import Plan

    plan = Plan(hand_plan(SPEC, 8, 2, [dict(micro_batches=2, stages=[dict(layers=[0, SPEC["layers"]], tp=1, dp=1,
                                                                          gpus=[(n, 0)])]) for n in ("a", "b")]))
    tokens = torch.randint(0, 100, (8, 17))
    for rank in (0, 1):
        want = rank_micro_batches(plan, rank, tokens)
        got = device_micro_batches(plan, rank, tokens, torch.device(dev))
        assert len(got) == len(want) == 2
        for (x, y), (wx, wy) in zip(got, want):
            assert x.device.type == dev and torch.equal(x.cpu(), wx) and torch.equal(y.cpu(), wy)


def test_the_plan_says_whether_it_was_priced_for_compiled_blocks():
    """`compiled` (motley plan's default true, --eager false) is read from the plan; documents
    from before it was added were priced eager."""
    from motley_torch.plan import Plan

    doc = hand_plan(SPEC, 4, 2, [dict(micro_batches=2, stages=[dict(layers=[0, SPEC["layers"]], tp=1, dp=1,
                                                                    gpus=[("a", 0)])])])
    assert Plan(doc).compiled is False
    assert Plan(dict(doc, compiled=True)).compiled is True
