"""python/gpu-check's pure parts (the peak table, MFU arithmetic, the rendering) and its
behaviour without CUDA: it says so and exits 0, claiming nothing."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from motley_torch.components.mfu import mfu, peak_tflops, train_flops_per_token
from motley_torch.spec import ModelSpec
from motley_torch.tools.gpu_check import MODEL, _stage_of, eq5, render

SCRIPT = Path(__file__).resolve().parent.parent / "gpu-check"


def test_peaks_by_device_name():
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "fp32") == 19.5
    assert peak_tflops("Tesla V100-SXM2-32GB", "bf16") is None, "V100 has no bf16"
    assert peak_tflops("Some New GPU", "bf16") is None


def test_flops_per_token_and_mfu():
    spec = ModelSpec.from_dict({"hidden": 4096, "layers": 32, "heads": 32, "kv_heads": 8, "ffn_hidden": 14336,
                                "vocab": 128256, "seq_len": 8192, "gated_mlp": True, "family": "llama"})
    f = train_flops_per_token(spec, 8192)
    params = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336) + 128256 * 4096
    assert f == 6 * params + 12 * 32 * 4096 * 8192
    # Llama 3 8B at 8192 tokens: about 6 x 7.5e9 + attention.
    assert 4.5e10 < f < 6e10
    assert mfu(1000.0, 1e12, 989.0) == pytest.approx(1000 * 1e12 / 989e12)
    assert mfu(1000.0, 1e12, None) is None and mfu(0.0, 1e12, 989.0) is None
    assert train_flops_per_token(ModelSpec.from_dict(MODEL), 512) > 0
    # A GELU MLP has two matrices, not three.
    gelu = ModelSpec.from_dict({"hidden": 64, "layers": 2, "heads": 4, "ffn_hidden": 256, "vocab": 100, "seq_len": 8})
    assert train_flops_per_token(gelu, 8) == 6 * (2 * (4 * 64 * 64 + 2 * 64 * 256) + 100 * 64) + 12 * 2 * 64 * 8


def test_peak_override(monkeypatch):
    monkeypatch.setenv("MOTLEY_PEAK_TFLOPS", "12.5")
    assert peak_tflops("cpu", "fp32") == 12.5
    monkeypatch.setenv("MOTLEY_PEAK_TFLOPS", "fast")
    with pytest.raises(Exception, match="MOTLEY_PEAK_TFLOPS"):
        peak_tflops("cpu", "fp32")


def test_render_lists_every_check():
    out = render([{"check": "train llama", "ok": True, "precision": "bf16", "tokens_per_s": 1234.4, "mfu": 0.4567,
                   "detail": "loss 10.4 -> 7.1"},
                  {"check": "nccl netName config", "ok": False, "detail": "no NCCL"}])
    lines = out.splitlines()
    assert lines[0].split() == ["check", "ok", "precision", "tokens/s", "MFU", "detail"]
    assert "1234" in lines[2] and "45.7%" in lines[2] and "yes" in lines[2]
    assert "NO" in lines[3] and "no NCCL" in lines[3]


def test_eq5_sums_the_blocks_of_the_binary_digits():
    blocks = {1: 1.0, 2: 1.9, 4: 3.7, 8: 7.2}
    assert eq5(blocks, 3) == pytest.approx(2.9)
    assert eq5(blocks, 7) == pytest.approx(6.6)
    assert eq5(blocks, 8) == 7.2 and eq5(blocks, 6) == pytest.approx(5.6)


def test_the_memory_check_finds_each_ranks_stage():
    from launcher import hand_plan

    spec = dict(MODEL, layers=4)
    plan = hand_plan(spec, 8, 2, [dict(micro_batches=4, stages=[dict(layers=[0, 2], tp=1, dp=1, gpus=[("a", 0)]),
                                                               dict(layers=[2, 4], tp=1, dp=1, gpus=[("a", 1)])])])
    plan["replicas"][0]["stages"][1]["memory_gib_per_gpu"] = 3.5
    assert _stage_of(plan, 1)["memory_gib_per_gpu"] == 3.5
    with pytest.raises(ValueError, match="rank 7"):
        _stage_of(plan, 7)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA path")
def test_without_cuda_it_says_so_and_exits_0():
    import sys

    r = subprocess.run([str(SCRIPT)], capture_output=True, text=True, timeout=120, env={"PYTHON": sys.executable,
                                                                                     "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and "no CUDA device here" in r.stdout and "nothing checked" in r.stdout, r.stderr
    r = subprocess.run([str(SCRIPT), "-o", "json"], capture_output=True, text=True, timeout=120,
                       env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and json.loads(r.stdout) == {"cuda": False, "checks": []}


def test_fp16_is_held_to_ninety_percent_of_bf16():
    from motley_torch.tools.gpu_check import fp16_against_bf16

    rows = [{"precision": "bf16", "tokens_per_s": 1000.0}, {"precision": "fp16", "tokens_per_s": 905.0}]
    assert fp16_against_bf16(rows)[0]["ok"] is True
    rows[1]["tokens_per_s"] = 850.0
    got = fp16_against_bf16(rows)[0]
    assert got["ok"] is False and "85.0%" in got["detail"]
    assert fp16_against_bf16(rows[:1]) == [], "nothing to compare without both"


@pytest.mark.parametrize("bad", ["bf8", "bf16,tf32", ""])
def test_precisions_are_checked_by_name(bad):
    """--precisions names only bf16, fp16, fp32: anything else is refused (exit 2) before any
    GPU is looked at, naming the flag."""
    from motley_torch.tools.gpu_check import main

    with pytest.raises(SystemExit) as e:
        main(["--precisions", bad])
    assert e.value.code == 2


@pytest.mark.parametrize("bad", ["speed", "train,memroy", ""])
def test_checks_are_named_from_the_list(bad, capsys):
    """--checks names only train, nccl, profile, multi-gpu, memory: anything else is refused
    (exit 2) before any GPU is looked at, naming the flag and the names it takes."""
    from motley_torch.tools.gpu_check import main

    with pytest.raises(SystemExit) as e:
        main(["--checks", bad])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--checks" in err and "multi-gpu" in err
