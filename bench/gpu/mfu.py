#!/usr/bin/env python3
"""Motley's trainer beside a careful user's baseline, on one CUDA GPU, in one run.

    python3 bench/gpu/mfu.py [-o table|json] [--steps 14] [--skip 4] [--models gpu-check,llama-1b]
                             [--variants motley,baseline,motley-eager] [--micro-batches N]

Models (llama family, bf16 compute under autocast over fp32 master weights on both sides, the same
precision recipe):
- `gpu-check`: python/gpu-check's llama (8 layers, hidden 1024, 16 / 8 KV heads, ffn 2816, vocab
  32000), 32 sequences of 512 tokens per step;
- `llama-1b`: shaped like Llama 3.2 1B (16 layers, hidden 2048, 32 / 8 KV heads, ffn 8192, vocab
  128256, tied embeddings), 4 sequences of 2048 tokens per step.
Systems:
- `motley`: the reference trainer as a job runs it (`python -m motley_torch.train` as the one
  rank of a one-GPU plan, NCCL, the agent's rank environment: python/tests/launcher.py), with its
  defaults on CUDA (`--compile auto`: compiled blocks, fused AdamW, the chunked head loss);
- `baseline`: transformers' LlamaForCausalLM (SDPA attention) under `torch.compile`, AdamW
  `fused=True`, bf16 autocast, `F.cross_entropy` on the float logits, the same batches;
- `motley-eager` (`--compile off`), `motley-cudagraphs` (`--cuda-graphs`), `motley-zero1`
  (`--zero1`: bf16 weights beside fp32 masters) and `motley-half` (`--half-weights`: the same
  without ZeRO-1) on request.
Each system's tokens/s is the median over the steps after the first `--skip` (compilation and
warm-up), its MFU components.mfu's (6 N + 12 L H S FLOPs per token over the GPU's dense bf16
peak), its peak the CUDA allocator's maximum. `-o json`: one line per (model, system)
{model, system, tokens_per_s, mfu, peak_mib, step_s}, then per model {model, ratio} (Motley's
tokens/s over the baseline's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO / "python" / "tests"))
sys.path.insert(0, str(REPO / "python"))

from motley_torch.tools.gpu_check import MODEL as GPU_CHECK_MODEL  # noqa: E402

MODELS = {
    "gpu-check": (dict(GPU_CHECK_MODEL), 32),
    "llama-1b": (dict(name="llama-1b", family="llama", layers=16, hidden=2048, heads=32, kv_heads=8, ffn_hidden=8192,
                      seq_len=2048, vocab=128256, gated_mlp=True, tie_embeddings=True, rope_theta=500000.0), 4),
}


def baseline_child(model_name: str, steps: int):
    """One process: the baseline's steps; prints one JSON line per step and one summary line."""
    import time

    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    from motley_torch.components.data import global_batch_tokens

    spec, batch = MODELS[model_name]
    torch.manual_seed(1)
    cfg = LlamaConfig(hidden_size=spec["hidden"], intermediate_size=spec["ffn_hidden"],
                      num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
                      num_key_value_heads=spec["kv_heads"], vocab_size=spec["vocab"],
                      max_position_embeddings=spec["seq_len"], rms_norm_eps=1e-5,
                      rope_theta=spec.get("rope_theta", 10000.0), tie_word_embeddings=spec.get("tie_embeddings", False),
                      attn_implementation="sdpa")
    dev = torch.device("cuda")
    model = LlamaForCausalLM(cfg).to(dev)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, fused=True)
    cmodel = torch.compile(model)
    seq, vocab = spec["seq_len"], spec["vocab"]
    for step in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        tokens = global_batch_tokens(1, step, batch, seq, vocab).to(dev, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = cmodel(input_ids=tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = float(loss.detach())
        dt = time.perf_counter() - t0
        print(json.dumps({"step": step, "loss": value, "tokens_per_s": batch * seq / dt, "step_s": dt}), flush=True)
    print(json.dumps({"memory": {"peak_mb": torch.cuda.max_memory_allocated(dev) / 2**20}}), flush=True)


def run_baseline(model_name: str, steps: int) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in (str(REPO / "python"), os.environ.get("PYTHONPATH"))
                                                      if x))
    r = subprocess.run([sys.executable, __file__, "--baseline-child", model_name, "--steps", str(steps)],
                       capture_output=True, text=True, env=env, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"baseline {model_name} exit {r.returncode}: {r.stderr[-3000:]}")
    return parse(r.stdout)


def run_motley(model_name: str, steps: int, extra: list, micro_batches: int = 1) -> dict:
    from launcher import check_ok, hand_plan, launch

    spec, batch = MODELS[model_name]
    plan = hand_plan(spec, batch, batch // micro_batches,
                     [dict(micro_batches=micro_batches, stages=[dict(layers=[0, spec["layers"]], tp=1, dp=1,
                                                                     gpus=[("n", 0)])])])
    plan["precision"] = "bf16"
    args = ["--steps", str(steps), "--seed", "1", "--lr", "3e-4", "--dtype", "bf16", *extra]
    with tempfile.TemporaryDirectory() as d:
        res = launch(plan, args, Path(d), timeout=1800, cuda=True)
    check_ok(res)
    return parse(res[0].stdout)


def parse(stdout: str) -> dict:
    lines = [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]
    return {"steps": [d for d in lines if "tokens_per_s" in d],
            "peak_mb": next((d["memory"]["peak_mb"] for d in lines if "memory" in d), None)}


def summarise(model_name: str, system: str, got: dict, skip: int) -> dict:
    import torch

    from motley_torch.components.mfu import mfu, peak_tflops, train_flops_per_token
    from motley_torch.spec import ModelSpec

    spec, _ = MODELS[model_name]
    kept = got["steps"][skip:] or got["steps"]
    tps = statistics.median(d["tokens_per_s"] for d in kept)
    step_s = statistics.median(d["step_s"] for d in kept)
    u = mfu(tps, train_flops_per_token(ModelSpec.from_dict(spec), spec["seq_len"]),
            peak_tflops(torch.cuda.get_device_name(0), "bf16"))
    return {"model": model_name, "system": system, "tokens_per_s": round(tps, 1), "mfu": None if u is None else round(u, 4),
            "peak_mib": None if got["peak_mb"] is None else round(got["peak_mb"], 1), "step_s": round(step_s, 5),
            "loss_first": got["steps"][0]["loss"] if got["steps"] else None,
            "loss_last": got["steps"][-1]["loss"] if got["steps"] else None}


# motley-zero1: ZeRO-1 on the one rank keeps the weights in bf16 beside fp32 masters, so the
# forward casts no weight (one cast per step, after the optimizer). motley-half: the plain
# path's half weights (`--half-weights`), the same one cast per step; autocast casts every
# weight once per micro-batch, so the two part only with --micro-batches above 1.
VARIANTS = {"motley": [], "motley-eager": ["--compile", "off"], "motley-cudagraphs": ["--cuda-graphs"],
            "motley-zero1": ["--zero1"], "motley-half": ["--half-weights"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-o", "--output", choices=("table", "json"), default="table")
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--skip", type=int, default=4)
    p.add_argument("--models", default="gpu-check,llama-1b")
    p.add_argument("--variants", default="motley,baseline")
    p.add_argument("--micro-batches", type=int, default=1, metavar="N",
                   help="Motley's step in N micro-batches (the plan's); the baseline's stays one batch")
    p.add_argument("--profile-dir", metavar="DIR",
                   help="Motley's runs also write the trainer's --torch-profile into DIR/MODEL-VARIANT")
    p.add_argument("--baseline-child", metavar="MODEL", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    chosen = [m for m in a.models.split(",") if m in MODELS]
    if a.micro_batches < 1 or any(MODELS[m][1] % a.micro_batches for m in chosen):
        p.error(f"--micro-batches: {a.micro_batches} must divide the batch of every model asked for "
                f"({', '.join(f'{m} {MODELS[m][1]}' for m in chosen)})")
    if a.baseline_child:
        baseline_child(a.baseline_child, a.steps)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("bench/gpu/mfu.py: no CUDA device here: nothing measured", file=sys.stderr)
        return 1
    rows = []
    for m in a.models.split(","):
        if m not in MODELS:
            print(f"--models: {m!r} is not one of {', '.join(MODELS)}", file=sys.stderr)
            return 2
        for v in a.variants.split(","):
            if v != "baseline" and v not in VARIANTS:
                print(f"--variants: {v!r} is not one of baseline, {', '.join(VARIANTS)}", file=sys.stderr)
                return 2
            try:
                extra = list(VARIANTS.get(v, []))
                if a.profile_dir and v != "baseline":
                    extra += ["--torch-profile", os.path.join(os.path.abspath(a.profile_dir), f"{m}-{v}")]
                got = run_baseline(m, a.steps) if v == "baseline" else run_motley(m, a.steps, extra, a.micro_batches)
                row = summarise(m, v, got, a.skip)
            except Exception as e:  # one failed system is reported, the others still measured
                row = {"model": m, "system": v, "error": str(e)[-1500:]}
            rows.append(row)
            print(json.dumps(row) if a.output == "json" else row, flush=True)
        by = {r["system"]: r for r in rows if r["model"] == m and "tokens_per_s" in r}
        if "motley" in by and "baseline" in by:
            ratio = {"model": m, "ratio": round(by["motley"]["tokens_per_s"] / by["baseline"]["tokens_per_s"], 3)}
            rows.append(ratio)
            print(json.dumps(ratio) if a.output == "json" else ratio, flush=True)
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}", file=sys.stderr)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
