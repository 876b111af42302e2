#!/usr/bin/env python3
"""The AdamW step per layer as the profiler could time it (BENCHMARKS.md, "The optimizer step as
a stage runs it"): over 1, 2, 4, 8 and 16 layers of a model file at once, repeated, and the same
with a forward and backward pass over the layers before each step (what the profiler now does,
`motley_torch.tools.profile.optimizer_and_fixed`). Prints, per depth, the median thread-CPU ms of
the step divided by the depth (12 steps after 3 untimed), unconfined, one intra-op thread.

    OMP_NUM_THREADS=1 .venv/bin/python bench/optimizer_probe.py [--model bench/mixed/model.yaml] [-o json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python"))

from motley_torch.components.stage_init import make_optimizer  # noqa: E402
from motley_torch.tools import profile as prof  # noqa: E402

DEPTHS = (1, 2, 4, 8, 16)


def per_layer_ms(ctx, depth: int, after_backward: bool, steps: int = 12, warmup: int = 3) -> float:
    m = ctx.blocks(depth)
    x = ctx.randn(ctx.args.micro_batch, ctx.seq, ctx.spec.hidden)

    def backward():
        for p in m.parameters():
            p.grad = None
        m(x).float().square().mean().backward()

    backward()
    opt = make_optimizer(m.parameters(), SimpleNamespace(lr=1e-3, weight_decay=0.01))
    times = []
    for i in range(warmup + steps):
        if after_backward:
            backward()
        t0 = time.thread_time()
        opt.step()
        if i >= warmup:
            times.append((time.thread_time() - t0) * 1e3 / depth)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(REPO / "bench" / "mixed" / "model.yaml"))
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("-o", "--output", choices=("table", "json"), default="table")
    a = p.parse_args(argv)
    args = prof.parse_args(["--model", a.model, "--micro-batch", str(a.micro_batch), "--tp", "1"])
    spec = prof.load_spec(args.model)
    ctx = prof.Ctx(args, spec, spec.seq_len, 0, None)
    for after in (False, True):
        row = {"after_backward": after, **{str(d): round(per_layer_ms(ctx, d, after), 2) for d in DEPTHS}}
        if a.output == "json":
            print(json.dumps(row), flush=True)
        else:
            print(("after a backward " if after else "repeated         ") +
                  "  ".join(f"{d}: {row[str(d)]:.2f}" for d in DEPTHS), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
