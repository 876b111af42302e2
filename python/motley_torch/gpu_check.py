"""`python/gpu-check`: what only a machine with CUDA GPUs can check, in one command.

    python/gpu-check [-o table|json] [--steps 20] [--seq-len 512]

On one GPU:
- the reference llama (8 layers, hidden 1024, 16 heads / 8 KV heads, vocab 32000) trains with
  `--dtype bf16` (where the GPU has bf16) and `--dtype fp16` (dynamic loss scaling) and fp32:
  the loss must be finite and fall; tokens/s and MFU per precision;
- an NCCL process group is created with a `netName` config (`ProcessGroupNCCL.Options().config`,
  world size 1) and all-reduces;
- the layer profiler runs on CUDA events (`python -m motley_torch.profile`), and AutoHet's
  eq. 5 is checked: the 8-layer block against twice the 4-layer block (within 15%).
With two GPUs or more, also one dp 2 run and one pp 2 run of the trainer (NCCL), whose losses
must equal the single process's within 5e-2 (bf16/fp16 numerics).

Without CUDA it says so and exits 0, claiming nothing. The table (or one JSON document with
`-o json`) lists every check with `ok`, what it measured and why it failed. The arithmetic
(MFU, the peak table, the rendering) is pure and unit-tested on any machine
(tests/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import List, Optional

# Dense tensor-core peak TFLOPS per precision (vendor datasheets; fp32 without TF32).
PEAKS = {
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "H800": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "A800": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "fp32": 91.6},
    "A10": {"bf16": 125.0, "fp16": 125.0, "fp32": 31.2},
    "V100": {"fp16": 125.0, "fp32": 15.7},
    "T4": {"fp16": 65.0, "fp32": 8.1},
}

MODEL = {"name": "gpu-check-llama", "family": "llama", "layers": 8, "hidden": 1024, "heads": 16, "kv_heads": 8,
         "ffn_hidden": 2816, "seq_len": 512, "vocab": 32000, "gated_mlp": True}


def peak_tflops(device_name: str, precision: str) -> Optional[float]:
    """The datasheet peak of the first table entry whose name is in the device's name."""
    up = device_name.upper()
    for key in sorted(PEAKS, key=len, reverse=True):
        if key in up:
            return PEAKS[key].get(precision)
    return None


def train_flops_per_token(spec: dict, seq_len: int) -> float:
    """Model FLOPs of one trained token: 6 x parameters (forward 2, backward 4) plus attention's
    QK^T and AV (12 x layers x hidden x seq_len, causal masking not discounted), the
    convention of Megatron-LM's and PaLM's MFU."""
    h, layers, ffn, vocab = spec["hidden"], spec["layers"], spec["ffn_hidden"], spec["vocab"]
    kv = spec.get("kv_heads", spec["heads"]) * h // spec["heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * ffn
    params = layers * per_layer + vocab * h  # the head's matrix; the embedding lookup is no matmul
    return 6.0 * params + 12.0 * layers * h * seq_len


def mfu(tokens_per_s: float, flops_per_token: float, peak: Optional[float]) -> Optional[float]:
    if not peak or tokens_per_s <= 0:
        return None
    return tokens_per_s * flops_per_token / (peak * 1e12)


def render(rows: List[dict]) -> str:
    head = ["check", "ok", "precision", "tokens/s", "MFU", "detail"]
    body = [[r["check"], "yes" if r["ok"] else "NO", r.get("precision", ""),
             f"{r['tokens_per_s']:.0f}" if r.get("tokens_per_s") else "",
             f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "", r.get("detail", "")] for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(b) for b in body])


def _py(args: List[str], env=None, timeout=1800) -> subprocess.CompletedProcess:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    e = dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in (here, os.environ.get("PYTHONPATH")) if x))
    e.update(env or {})
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=e, timeout=timeout)


def _losses(stdout: str) -> List[dict]:
    return [d for d in (json.loads(x) for x in stdout.splitlines() if x.startswith("{")) if "loss" in d]


def check_training(model_file: str, precision: str, steps: int, seq: int, device_name: str) -> dict:
    r = _py(["-m", "motley_torch.train", "--single-process", "--model", model_file, "--global-batch", "8",
             "--seq-len", str(seq), "--steps", str(steps), "--seed", "1", "--lr", "3e-4", "--dtype", precision])
    row = {"check": "train llama", "precision": precision}
    if r.returncode != 0:
        return dict(row, ok=False, detail=r.stderr.strip().splitlines()[-1][:200] if r.stderr.strip() else "failed")
    lines = _losses(r.stdout)
    taken = [d for d in lines if not d.get("skipped")]
    finite = all(d["loss"] == d["loss"] and abs(d["loss"]) != float("inf") for d in taken)
    falls = bool(taken) and taken[-1]["loss"] < taken[0]["loss"]
    tps = sorted(d["tokens_per_s"] for d in lines[2:])[len(lines[2:]) // 2] if len(lines) > 2 else 0.0
    u = mfu(tps, train_flops_per_token(MODEL, seq), peak_tflops(device_name, precision))
    detail = f"loss {taken[0]['loss']:.3f} -> {taken[-1]['loss']:.3f}" if taken else "every step skipped"
    skipped = sum(1 for d in lines if d.get("skipped"))
    if skipped:
        detail += f", {skipped} steps skipped (loss scale)"
    return dict(row, ok=finite and falls, tokens_per_s=tps, mfu=u, detail=detail)


NCCL_CHILD = r"""
import os, torch, torch.distributed as dist
opts = dist.ProcessGroupNCCL.Options()
opts.config.net_name = "Socket"
dist.init_process_group("nccl", rank=0, world_size=1, store=dist.HashStore(), pg_options=opts,
                        device_id=torch.device("cuda", 0))
t = torch.ones(4, device="cuda")
dist.all_reduce(t)
torch.cuda.synchronize()
print(float(t.sum()))
dist.destroy_process_group()
"""


def check_nccl() -> dict:
    r = _py(["-c", NCCL_CHILD], env={"NCCL_DEBUG": "INFO"})
    ok = r.returncode == 0 and r.stdout.strip().endswith("4.0")
    net = "NET/Socket" in r.stdout + r.stderr
    return {"check": "nccl netName config", "ok": ok, "detail": ("NET/Socket chosen" if net else "netName not seen in "
            "NCCL_DEBUG") if ok else (r.stderr.strip().splitlines() or ["failed"])[-1][:200]}


def check_profile(model_file: str, seq: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "p.yaml")
        r = _py(["-m", "motley_torch.profile", "--model", model_file, "--tp", "1", "--micro-batch", "2", "--seq-len",
                 str(seq), "--dtype", "bf16", "--output", out])
        if r.returncode != 0:
            return {"check": "profile eq. 5", "ok": False, "detail": (r.stderr.strip().splitlines() or ["failed"])[-1]}
        import yaml

        entry = yaml.safe_load(open(out))["profiles"][0]
    blocks = {b["layers"]: b for b in entry["blocks"]}
    ratio = (blocks[8]["fwd_ms"] + blocks[8]["bwd_ms"]) / (2 * (blocks[4]["fwd_ms"] + blocks[4]["bwd_ms"]))
    return {"check": "profile eq. 5", "ok": abs(ratio - 1) <= 0.15,
            "detail": f"8 layers / (2 x 4 layers) = {ratio:.3f}; fwd {entry['fwd_ms']:.3f} ms bwd {entry['bwd_ms']:.3f} "
                      f"ms per layer"}


def check_multi_gpu(model_file: str, precision: str, seq: int) -> List[dict]:
    """dp 2 and pp 2 plans on GPUs 0 and 1 through the tests' launcher (the agent's rank
    environment), against the single process."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from pathlib import Path

    from launcher import hand_plan, launch

    spec = dict(MODEL, seq_len=seq)
    args = ["--steps", "6", "--seed", "1", "--lr", "3e-4", "--dtype", precision]
    one = _losses(_py(["-m", "motley_torch.train", "--single-process", "--model", model_file, "--global-batch", "8",
                       "--seq-len", str(seq), *args[:-2], "--dtype", precision]).stdout)
    rows = []
    for name, reps in (
            ("dp 2", [dict(micro_batches=2, stages=[dict(layers=[0, 8], tp=1, dp=1, gpus=[("n", g)])]) for g in (0, 1)]),
            ("pp 2", [dict(micro_batches=4, stages=[dict(layers=[0, 4], tp=1, dp=1, gpus=[("n", 0)]),
                                                    dict(layers=[4, 8], tp=1, dp=1, gpus=[("n", 1)])])])):
        plan = hand_plan(spec, 8, 2, reps)
        with tempfile.TemporaryDirectory() as d:
            res = launch(plan, args, Path(d), timeout=1800)
        bad = [r for r in res if r.returncode != 0]
        got = _losses(res[0].stdout) if not bad else []
        diff = max((abs(a["loss"] - b["loss"]) for a, b in zip(got, one)), default=float("inf"))
        rows.append({"check": f"train {name} (nccl)", "precision": precision, "ok": not bad and diff <= 5e-2,
                     "detail": f"max |loss - single| {diff:.4f}" if not bad else f"rank {bad[0].rank} exit {bad[0].returncode}"})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python/gpu-check", description=__doc__.split("\n")[0])
    p.add_argument("-o", "--output", choices=("table", "json"), default="table")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq-len", type=int, default=512)
    a = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        msg = "gpu-check: no CUDA device here (torch.cuda.is_available() is False): nothing checked"
        print(json.dumps({"cuda": False, "checks": []}) if a.output == "json" else msg)
        return 0
    name = torch.cuda.get_device_name(0)
    with tempfile.TemporaryDirectory() as d:
        model_file = os.path.join(d, "model.json")
        with open(model_file, "w") as f:
            json.dump(dict(MODEL, seq_len=a.seq_len), f)
        precisions = (["bf16"] if torch.cuda.is_bf16_supported() else []) + ["fp16", "fp32"]
        rows = [check_training(model_file, pr, a.steps, a.seq_len, name) for pr in precisions]
        rows.append(check_nccl())
        rows.append(check_profile(model_file, a.seq_len))
        if torch.cuda.device_count() >= 2:
            rows += check_multi_gpu(model_file, precisions[0], a.seq_len)
    doc = {"cuda": True, "device": name, "gpus": torch.cuda.device_count(), "torch": torch.__version__, "checks": rows}
    print(json.dumps(doc) if a.output == "json" else f"{name} x {doc['gpus']}, torch {torch.__version__}\n" + render(rows))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
