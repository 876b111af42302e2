#!/usr/bin/env python3
"""Motley's trainer against torch's own DistributedDataParallel, side by side, on equal work.

    OMP_NUM_THREADS=1 .venv/bin/python bench/trainer_vs_ddp.py [--steps 20] [--skip 3] [-o table|json]
        [--sizes small,medium,large] [--configs dp2-overlap|all]

The same llama-family model (motley_torch's GPTStage) at three sizes (`SIZES`: hidden 128 with 4
sequences of 64 tokens per rank, where a fixed per-step cost shows; hidden 256 and 512 at 256
tokens), the same synthetic global batches, the same (multi-tensor) AdamW, fp32, two CPU
processes with gloo:
- Motley: a plan of two one-stage replicas (dp 2), half the global batch each in micro-batches of 2,
  with its gradient sync overlapped with the backward pass (default, 25 MiB buckets) and
  without (`--no-overlap`), and with ZeRO-1 (`--zero1`: AdamW state sharded over the two
  ranks, gradients reduced onto their owner, parameters broadcast back) both ways;
- DDP: `torch.nn.parallel.DistributedDataParallel` over the same model, each rank its half
  in the same micro-batches (gradients accumulated under `no_sync()` but for the
  last, DDP's own bucketed overlap).
DDP runs once beside each configuration (just before it), so a shared machine's drift over
minutes does not enter the ratio. Reports the median step wall time (the first `--skip` steps
dropped) and tokens/s of each, and
Motley's tokens/s over DDP's (goal: 0.95 or more). `-o json`: one line per configuration,
{size, config, motley_tokens_per_s, ddp_tokens_per_s, ratio, motley_step_s, ddp_step_s}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "python" / "tests"))
sys.path.insert(0, str(HERE.parent / "python"))

# (model, global batch, micro-batch): three sizes of the same llama; `small` is the size at which
# a fixed per-step cost shows (4 sequences of 64 tokens per rank).
SIZES = {
    "small": ({"name": "bench-llama-small", "family": "llama", "layers": 4, "hidden": 128, "heads": 4, "kv_heads": 2,
               "ffn_hidden": 344, "seq_len": 64, "vocab": 4096, "gated_mlp": True}, 8, 2),
    "medium": ({"name": "bench-llama", "family": "llama", "layers": 4, "hidden": 256, "heads": 8, "kv_heads": 4,
                "ffn_hidden": 688, "seq_len": 256, "vocab": 4096, "gated_mlp": True}, 16, 2),
    "large": ({"name": "bench-llama-large", "family": "llama", "layers": 4, "hidden": 512, "heads": 8, "kv_heads": 4,
               "ffn_hidden": 1376, "seq_len": 256, "vocab": 8192, "gated_mlp": True}, 16, 2),
}
SEED = 1
CONFIGS = {"dp2-overlap": [], "dp2-no-overlap": ["--no-overlap"], "dp2-zero1": ["--zero1"],
           "dp2-zero1-no-overlap": ["--zero1", "--no-overlap"]}


def ddp_worker(size: str, steps: int, out: str) -> int:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from motley_torch.components.data import global_batch_tokens
    from motley_torch.models.transformer import GPTStage
    from motley_torch.spec import ModelSpec

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    MODEL, GB, MB = SIZES[size]
    spec = ModelSpec.from_dict(MODEL)
    seq = spec.seq_len
    model = GPTStage(spec, seq, (0, spec.layers))
    model.init_from_seed(SEED)
    ddp = DDP(model)
    # The multi-tensor AdamW, as Motley's on the CPU: the comparison is of the step around it.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01,
                            foreach=True)
    share = GB // world
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        tokens = global_batch_tokens(SEED, step, GB, seq, spec.vocab)[rank * share : (rank + 1) * share]
        chunks = tokens.split(MB)
        for i, c in enumerate(chunks):
            last = i == len(chunks) - 1
            ctx = ddp.no_sync() if not last else _null()
            with ctx:
                logits = ddp(c[:, :-1])
                loss = F.cross_entropy(logits.float().reshape(-1, spec.vocab), c[:, 1:].reshape(-1), reduction="sum")
                # DDP averages over ranks; scale so the update is the global mean's, as Motley's.
                (loss * world / (GB * seq)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(t)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()
    return 0


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def run_ddp(size: str, steps: int, work: Path) -> list:
    from launcher import free_port, python_env

    port = free_port()
    work.mkdir(parents=True, exist_ok=True)
    out = work / "ddp.json"
    procs = []
    for r in range(2):
        env = python_env(OMP_NUM_THREADS="1", RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                         MASTER_PORT=str(port), LOCAL_RANK=str(r))
        procs.append(subprocess.Popen([sys.executable, __file__, "--ddp-worker", "--sizes", size, "--steps",
                                       str(steps), "--out", str(out)], env=env))
    for p in procs:
        if p.wait() != 0:
            raise SystemExit("the DDP run failed")
    return json.loads(out.read_text())


def run_motley(size: str, steps: int, work: Path, extra: list) -> list:
    from launcher import check_ok, hand_plan, launch

    MODEL, GB, MB = SIZES[size]
    plan = hand_plan(MODEL, GB, MB, [dict(micro_batches=GB // 2 // MB, stages=[
        dict(layers=[0, MODEL["layers"]], tp=1, dp=1, gpus=[(n, 0)])]) for n in ("a", "b")])
    res = launch(plan, ["--steps", str(steps), "--seed", str(SEED), "--dtype", "fp32", *extra], work, timeout=1800)
    check_ok(res)
    return [d["step_s"] for d in map(json.loads, res[0].stdout.splitlines()) if "step_s" in d]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--skip", type=int, default=3)
    p.add_argument("-o", "--output", choices=("table", "json"), default="table")
    p.add_argument("--sizes", default="small,medium,large", help="model sizes, of " + ", ".join(SIZES))
    p.add_argument("--configs", default="dp2-overlap", help="Motley configurations, of " + ", ".join(CONFIGS)
                   + " (or all)")
    p.add_argument("--ddp-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.ddp_worker:
        return ddp_worker(a.sizes, a.steps, a.out)
    work = Path(tempfile.mkdtemp(prefix="motley-vs-ddp-"))
    configs = list(CONFIGS) if a.configs == "all" else a.configs.split(",")
    rows = []
    for size in a.sizes.split(","):
        tokens = SIZES[size][1] * SIZES[size][0]["seq_len"]
        for config in configs:
            # DDP runs again beside each configuration: a shared machine's speed drifts over
            # minutes, and each ratio compares two runs made one after the other.
            ddp = statistics.median(run_ddp(size, a.steps, work / f"ddp-{size}-{config}")[a.skip:])
            m = statistics.median(run_motley(size, a.steps, work / f"{size}-{config}", CONFIGS[config])[a.skip:])
            rows.append({"size": size, "config": config, "motley_tokens_per_s": round(tokens / m, 1),
                         "ddp_tokens_per_s": round(tokens / ddp, 1), "ratio": round(ddp / m, 3),
                         "motley_step_s": round(m, 4), "ddp_step_s": round(ddp, 4)})
    if a.output == "json":
        for r in rows:
            print(json.dumps(r))
        return 0
    print(f"command: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')} {sys.executable} "
          f"{' '.join(sys.argv)}\n")
    print("| size | config | Motley median step s | DDP median step s | Motley tokens/s | DDP tokens/s | ratio |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['size']} | {r['config']} | {r['motley_step_s']:.4f} | {r['ddp_step_s']:.4f} | {r['motley_tokens_per_s']:.0f} | "
              f"{r['ddp_tokens_per_s']:.0f} | {r['ratio']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
