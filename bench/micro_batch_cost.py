#!/usr/bin/env python3
"""What each micro-batch costs beyond its work, on this machine's CPU (BENCHMARKS.md, "An H200:
... what each micro-batch costs"): a llama of 8 layers at hidden 64, 32 sequences of 32 tokens a
step, one rank through the tests' launcher (the agent's rank environment), its step split into
each of the given micro-batch counts; prints each count's median step seconds over steps 3-11.

    OMP_NUM_THREADS=1 .venv/bin/python bench/micro_batch_cost.py [--counts 1,8,32] [--compile off|on]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python" / "tests"))
sys.path.insert(0, str(REPO / "python"))

from launcher import check_ok, hand_plan, launch  # noqa: E402

SPEC = dict(name="small-llama", family="llama", layers=8, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, seq_len=32,
            vocab=256, gated_mlp=True)
BATCH = 32


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--counts", default="1,8,32", help="micro-batch counts, each dividing 32")
    p.add_argument("--compile", choices=("off", "on"), default="off")
    a = p.parse_args(argv)
    counts = [int(x) for x in a.counts.split(",")]
    if any(c < 1 or BATCH % c for c in counts):
        p.error(f"--counts: {a.counts!r}; each must divide {BATCH}")
    for n in counts:
        plan = hand_plan(SPEC, BATCH, BATCH // n, [dict(micro_batches=n, stages=[dict(layers=[0, 8], tp=1, dp=1,
                                                                                       gpus=[("n", 0)])])])
        with tempfile.TemporaryDirectory() as d:
            res = launch(plan, ["--steps", "12", "--seed", "1", "--compile", a.compile], Path(d), timeout=600)
        check_ok(res)
        steps = [json.loads(x) for x in res[0].stdout.splitlines() if x.startswith('{"step"')]
        print(json.dumps({"micro_batches": n, "compile": a.compile,
                          "step_s": statistics.median(s["step_s"] for s in steps[3:])}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
