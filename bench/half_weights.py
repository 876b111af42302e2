#!/usr/bin/env python3
"""The plain path's half weights (`--half-weights`) beside autocast over fp32 weights, side by
side in one run: Motley's trainer as one rank (python/tests/launcher.py), bf16, the same model,
batches and steps, with the step's batch in M micro-batches (autocast casts every weight once
per micro-batch, half weights once per step). Rounds alternate the two, so a drift of the
machine reaches both; each run's step time is the median after the first `--skip` steps.

    OMP_NUM_THREADS=1 .venv/bin/python bench/half_weights.py [--micro-batches 4] [--rounds 3] [--cuda] [-o json]

`-o json`: one line per (round, system) {round, system, micro_batches, step_s, tokens_per_s},
then {ratio}: the median over rounds of autocast's step time over half weights'."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "python" / "tests")]

MODEL = {"name": "half-weights-bench", "family": "llama", "layers": 4, "hidden": 256, "heads": 4, "kv_heads": 4,
         "ffn_hidden": 768, "seq_len": 64, "vocab": 2048, "gated_mlp": True, "tie_embeddings": False,
         "rope_theta": 10000.0, "norm_eps": 1e-5}
SYSTEMS = {"autocast": [], "half-weights": ["--half-weights"]}


def run(system: str, micro_batches: int, steps: int, cuda: bool) -> list:
    from launcher import check_ok, hand_plan, launch

    plan = hand_plan(MODEL, micro_batches, 1, [dict(micro_batches=micro_batches,
                                            stages=[dict(layers=[0, MODEL["layers"]], tp=1, dp=1, gpus=[("n", 0)])])])
    plan["precision"] = "bf16"
    args = ["--steps", str(steps), "--seed", "1", "--dtype", "bf16", *SYSTEMS[system]]
    with tempfile.TemporaryDirectory() as d:
        res = launch(plan, args, Path(d), timeout=1800, cuda=cuda)
    check_ok(res)
    return [d for d in map(json.loads, (x for x in res[0].stdout.splitlines() if x.startswith("{"))) if "step_s" in d]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--skip", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cuda", action="store_true", help="the rank on CUDA device 0 (default: the CPU)")
    p.add_argument("-o", "--output", choices=("table", "json"), default="table")
    a = p.parse_args()
    if a.steps <= a.skip:
        print("--steps: must exceed --skip (the steps counted come after it)", file=sys.stderr)
        return 2
    times = {s: [] for s in SYSTEMS}
    for r in range(a.rounds):
        for system in SYSTEMS:
            lines = run(system, a.micro_batches, a.steps, a.cuda)[a.skip:]
            step_s = statistics.median(d["step_s"] for d in lines)
            times[system].append(step_s)
            row = {"round": r, "system": system, "micro_batches": a.micro_batches, "step_s": round(step_s, 5),
                   "tokens_per_s": round(statistics.median(d["tokens_per_s"] for d in lines), 1)}
            print(json.dumps(row) if a.output == "json" else
                  f"round {r}  {system:<13} {a.micro_batches} micro-batches  step {step_s:.4f} s  "
                  f"{row['tokens_per_s']:.0f} tokens/s", flush=True)
    ratio = statistics.median(x / y for x, y in zip(times["autocast"], times["half-weights"]))
    print(json.dumps({"ratio": round(ratio, 4)}) if a.output == "json" else
          f"autocast's step over half weights' (median of {a.rounds} rounds): {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
