"""`python/gpu-check`: what only a machine with CUDA GPUs can check, in one command.

    python/gpu-check [-o table|json] [--steps 20] [--seq-len 512] [--plan FILE ...] [--checks LIST]

On one GPU:
- the reference llama (8 layers, hidden 1024, 16 heads / 8 KV heads, vocab 32000) trains with
  `--dtype bf16` (where the GPU has bf16) and `--dtype fp16` (dynamic loss scaling) and fp32:
  the loss must be finite and fall; tokens/s and MFU per precision;
- an NCCL process group is created with a `netName` config (`ProcessGroupNCCL.Options().config`,
  world size 1) and all-reduces;
- the layer profiler runs on CUDA events (`python -m motley_torch.profile`), and AutoHet's
  eq. 5 is checked: stacks of 3, 5, 6 and 7 layers measured directly against the sum of the
  profiled blocks of their binary digits (within 15%), with the linear estimate beside it;
- with `--plan FILE` (plans from `motley plan -o json` for this machine's GPUs), each plan runs
  2 steps and every rank's peak allocated memory is held against the plan's
  `memory_gib_per_gpu` (within 10%).
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
from typing import List

from ..components.mfu import mfu, peak_tflops, train_flops_per_token
from ..spec import ModelSpec

# python/, which holds motley_torch: what a child Python needs on its path.
PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODEL = {"name": "gpu-check-llama", "family": "llama", "layers": 8, "hidden": 1024, "heads": 16, "kv_heads": 8,
         "ffn_hidden": 2816, "seq_len": 512, "vocab": 32000, "gated_mlp": True}


def render(rows: List[dict]) -> str:
    head = ["check", "ok", "precision", "tokens/s", "MFU", "detail"]
    body = [[r["check"], "yes" if r["ok"] else "NO", r.get("precision", ""),
             f"{r['tokens_per_s']:.0f}" if r.get("tokens_per_s") else "",
             f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "", r.get("detail", "")] for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(b) for b in body])


def _py(args: List[str], env=None, timeout=1800) -> subprocess.CompletedProcess:
    here = PYTHON_DIR
    e = dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in (here, os.environ.get("PYTHONPATH")) if x))
    e.update(env or {})
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=e, timeout=timeout)


def _losses(stdout: str) -> List[dict]:
    return [d for d in (json.loads(x) for x in stdout.splitlines() if x.startswith("{")) if "loss" in d]


def check_training(model_file: str, precision: str, steps: int, seq: int, device_name: str, batch: int = 32,
                   compile_: str = "auto") -> dict:
    r = _py(["-m", "motley_torch.train", "--single-process", "--model", model_file, "--global-batch", str(batch),
             "--seq-len", str(seq), "--steps", str(steps), "--seed", "1", "--lr", "3e-4", "--dtype", precision,
             "--compile", compile_])
    row = {"check": "train llama", "precision": precision}
    if r.returncode != 0:
        return dict(row, ok=False, detail=r.stderr.strip().splitlines()[-1][:200] if r.stderr.strip() else "failed")
    lines = _losses(r.stdout)
    taken = [d for d in lines if not d.get("skipped")]
    finite = all(d["loss"] == d["loss"] and abs(d["loss"]) != float("inf") for d in taken)
    falls = bool(taken) and taken[-1]["loss"] < taken[0]["loss"]
    tps = sorted(d["tokens_per_s"] for d in lines[2:])[len(lines[2:]) // 2] if len(lines) > 2 else 0.0
    u = mfu(tps, train_flops_per_token(ModelSpec.from_dict(dict(MODEL, seq_len=seq)), seq),
            peak_tflops(device_name, precision))
    detail = f"loss {taken[0]['loss']:.3f} -> {taken[-1]['loss']:.3f}" if taken else "every step skipped"
    skipped = sum(1 for d in lines if d.get("skipped"))
    if skipped:
        detail += f", {skipped} steps skipped (loss scale)"
    return dict(row, ok=finite and falls, tokens_per_s=tps, mfu=u, detail=detail)


def fp16_against_bf16(rows: List[dict]) -> List[dict]:
    """fp16 with loss scaling must train within 10% of bf16's tokens/s (the scaler's overflow
    checks and unscaling are its only extra work)."""
    by = {r["precision"]: r for r in rows if r.get("tokens_per_s")}
    if "bf16" not in by or "fp16" not in by:
        return []
    ratio = by["fp16"]["tokens_per_s"] / by["bf16"]["tokens_per_s"]
    return [{"check": "fp16 speed against bf16", "ok": ratio >= 0.9, "precision": "fp16",
             "detail": f"{100 * ratio:.1f}% of bf16's tokens/s (goal 90% or more)"}]


NCCL_CHILD = r"""
import os, torch, torch.distributed as dist
opts = dist.ProcessGroupNCCL.Options()
opts.config.net_name = "Socket"
dist.init_process_group("nccl", rank=0, world_size=1, store=dist.HashStore(), pg_options=opts,
                        device_id=torch.device("cuda", 0))
t = torch.ones(4, device="cuda")
dist.all_reduce(t)
torch.cuda.synchronize()
print("nccl-sum", float(t.sum()), flush=True)
dist.destroy_process_group()
"""


def check_nccl() -> dict:
    # NCCL_DEBUG=INFO writes to stdout too: the result is the line that says so.
    r = _py(["-c", NCCL_CHILD], env={"NCCL_DEBUG": "INFO"})
    ok = r.returncode == 0 and "nccl-sum 4.0" in r.stdout.splitlines()
    net = "NET/Socket" in r.stdout + r.stderr
    tail = [x for x in (r.stderr + r.stdout).strip().splitlines() if x.strip()][-1:] or ["no output"]
    return {"check": "nccl netName config", "ok": ok, "detail": ("NET/Socket chosen" if net else "netName not seen in "
            "NCCL_DEBUG") if ok else f"exit {r.returncode}: {tail[0][:200]}"}


# Times blocks of the depths eq. 5 composes (3 = 2+1, 5 = 4+1, 6 = 4+2, 7 = 4+2+1) directly,
# with the profiler's own timer (CUDA events), model and settings.
DEPTHS_CHILD = r"""
import json, sys, types
from motley_torch.model_source import load_model
from motley_torch.tools.profile import Ctx, time_blocks
a = types.SimpleNamespace(tp=1, micro_batch=int(sys.argv[3]), warmup=5, runs=20, dtype=sys.argv[4], compile="auto")
spec = load_model(sys.argv[1])
ctx = Ctx(a, spec, int(sys.argv[2]), 0, None)
print(json.dumps({n: sum(time_blocks(ctx, n)) for n in (3, 5, 6, 7)}))
"""


def eq5(blocks: dict, n: int) -> float:
    """AutoHet's eq. 5: n layers cost the measured blocks of n's binary digits."""
    return sum(blocks[b] for b in (8, 4, 2, 1) if n & b)


def check_profile(model_file: str, seq: int, micro_batch: int = 8) -> dict:
    """The profiler on CUDA events; then layers of depths 3, 5, 6 and 7 measured directly
    against eq. 5's sum of blocks and against the linear estimate (depth x the per-layer time
    the profile reports): eq. 5 must be within 15% everywhere."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "p.yaml")
        r = _py(["-m", "motley_torch.profile", "--model", model_file, "--tp", "1", "--micro-batch", str(micro_batch),
                 "--seq-len", str(seq), "--dtype", "bf16", "--warmup", "5", "--runs", "20", "--output", out])
        if r.returncode != 0:
            return {"check": "profile eq. 5", "ok": False, "detail": (r.stderr.strip().splitlines() or ["failed"])[-1]}
        import yaml

        entry = yaml.safe_load(open(out))["profiles"][0]
    blocks = {b["layers"]: b["fwd_ms"] + b["bwd_ms"] for b in entry["blocks"]}
    m = _py(["-c", DEPTHS_CHILD, model_file, str(seq), str(micro_batch), "bf16"])
    if m.returncode != 0:
        return {"check": "profile eq. 5", "ok": False, "detail": (m.stderr.strip().splitlines() or ["failed"])[-1]}
    measured = {int(k): v for k, v in json.loads(m.stdout.strip().splitlines()[-1]).items()}
    per_layer = entry["fwd_ms"] + entry["bwd_ms"]
    err = {n: eq5(blocks, n) / t - 1 for n, t in measured.items()}
    lin = {n: n * per_layer / t - 1 for n, t in measured.items()}
    worst = max(abs(e) for e in err.values())
    return {"check": "profile eq. 5", "ok": worst <= 0.15,
            "detail": "eq. 5 error " + " ".join(f"{n}:{100 * e:+.1f}%" for n, e in sorted(err.items()))
                      + "; linear " + " ".join(f"{n}:{100 * e:+.1f}%" for n, e in sorted(lin.items()))
                      + f"; {per_layer:.3f} ms per layer"}


def check_memory(plan_file: str, seq: int) -> List[dict]:
    """A plan from `motley plan` for this machine's GPUs, run for 2 steps: every rank's peak
    allocated memory (its memory line) against the stage's memory_gib_per_gpu."""
    sys.path.insert(0, os.path.join(PYTHON_DIR, "tests"))
    from pathlib import Path

    from launcher import launch

    with open(plan_file) as f:
        plan = json.load(f)
    args = ["--steps", "2", "--seed", "1", "--dtype", plan.get("precision") or "bf16"]
    with tempfile.TemporaryDirectory() as d:
        res = launch(plan, args, Path(d), timeout=900, cuda=True)
    name = os.path.basename(plan_file)
    rows = []
    for r in res:
        mem = [json.loads(x)["memory"] for x in r.stdout.splitlines() if x.startswith('{"memory"')]
        if r.returncode != 0 or not mem:
            rows.append({"check": f"memory {name} rank {r.rank}", "ok": False, "detail": f"exit {r.returncode}: "
                         + (r.log.strip().splitlines() or ["no output"])[-1][:200]})
            continue
        st = _stage_of(plan, r.rank)
        want = st["memory_gib_per_gpu"] * 1024
        got = mem[0]["peak_mb"]
        rows.append({"check": f"memory {name} rank {r.rank}", "precision": plan.get("precision"),
                     "ok": abs(got / want - 1) <= 0.10,
                     "detail": f"peak {got:.0f} MiB, plan {want:.0f} MiB ({100 * (got / want - 1):+.1f}%); params "
                               f"{mem[0]['params_mb']:.0f} grads {mem[0]['grads_mb']:.0f} optimizer "
                               f"{mem[0]['optimizer_mb']:.0f} MiB; zero1 {bool(plan.get('zero1'))}"})
    return rows


def _stage_of(plan: dict, rank: int) -> dict:
    from ..plan import Plan

    p = Plan(plan)
    for ri, rep in enumerate(p.replicas):
        for si, st in enumerate(rep.stages):
            if rank in st.ranks:
                return plan["replicas"][ri]["stages"][si]
    raise ValueError(f"rank {rank} is in no stage of the plan")


def check_multi_gpu(model_file: str, precision: str, seq: int) -> List[dict]:
    """dp 2 and pp 2 plans on GPUs 0 and 1 through the tests' launcher (the agent's rank
    environment), against the single process."""
    sys.path.insert(0, os.path.join(PYTHON_DIR, "tests"))
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
            res = launch(plan, args, Path(d), timeout=1800, cuda=True)
        bad = [r for r in res if r.returncode != 0]
        got = _losses(res[0].stdout) if not bad else []
        diff = max((abs(a["loss"] - b["loss"]) for a, b in zip(got, one)), default=float("inf"))
        rows.append({"check": f"train {name} (nccl)", "precision": precision, "ok": not bad and diff <= 5e-2,
                     "detail": f"max |loss - single| {diff:.4f}" if not bad else f"rank {bad[0].rank} exit {bad[0].returncode}"})
    return rows


# What `--checks` can name; every one runs by default.
CHECKS = ("train", "nccl", "profile", "multi-gpu", "memory")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python/gpu-check", description=__doc__.split("\n")[0])
    p.add_argument("-o", "--output", choices=("table", "json"), default="table")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="the trainer's --compile for the training checks (auto: compiled blocks on CUDA)")
    p.add_argument("--precisions", metavar="LIST",
                   help="the training checks' precisions, comma-separated (default: bf16 where the GPU has it, fp16, "
                        "fp32)")
    p.add_argument("--plan", action="append", default=[], metavar="FILE",
                   help="also run this plan (motley plan -o json, for this machine's GPUs) and check every rank's "
                        "peak memory against the plan's memory_gib_per_gpu (within 10%%); repeatable")
    p.add_argument("--checks", metavar="LIST", default=",".join(CHECKS),
                   help=f"which checks run, comma-separated (default: all of {', '.join(CHECKS)}; memory runs only "
                        "with --plan)")
    a = p.parse_args(argv)
    checks = a.checks.split(",")
    unknown = [x for x in checks if x not in CHECKS]
    if unknown or not a.checks:
        p.error(f"--checks: {a.checks!r}; use a comma-separated list of {', '.join(CHECKS)}")
    if a.precisions is not None:
        bad = [x for x in a.precisions.split(",") if x not in ("bf16", "fp16", "fp32")]
        if bad or not a.precisions:
            p.error(f"--precisions: {a.precisions!r}; use a comma-separated list of bf16, fp16, fp32")
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
        precisions = [x for x in (["bf16"] if torch.cuda.is_bf16_supported() else []) + ["fp16", "fp32"]
                      if a.precisions is None or x in a.precisions.split(",")]
        rows: List[dict] = []

        def done(new: List[dict]):
            # Each check's rows on stderr as it finishes: a run cut short by a time limit still
            # says what it measured.
            for r in new:
                print("gpu-check row " + json.dumps(r), file=sys.stderr, flush=True)
            rows.extend(new)

        if "train" in checks:
            for pr in precisions:
                done([check_training(model_file, pr, a.steps, a.seq_len, name, compile_=a.compile)])
            done(fp16_against_bf16(rows))
        if "nccl" in checks:
            done([check_nccl()])
        if "profile" in checks:
            done([check_profile(model_file, a.seq_len)])
        if "multi-gpu" in checks and torch.cuda.device_count() >= 2:
            done(check_multi_gpu(model_file, precisions[0], a.seq_len))
        if "memory" in checks:
            for plan_file in a.plan:
                done(check_memory(plan_file, a.seq_len))
    doc = {"cuda": True, "device": name, "gpus": torch.cuda.device_count(), "torch": torch.__version__, "checks": rows}
    print(json.dumps(doc) if a.output == "json" else f"{name} x {doc['gpus']}, torch {torch.__version__}\n" + render(rows))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
