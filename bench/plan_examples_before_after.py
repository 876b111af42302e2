#!/usr/bin/env python3
"""The plans of two `motley` builds side by side on the example clusters: for each (cluster,
model, global batch), each build's micro-batch, replicas, predicted iteration seconds and its
planning wall time (the median of three runs, the builds alternating). Says what a planner
change moves, and what it costs in planning time.

    bench/plan_examples_before_after.py BEFORE_BIN AFTER_BIN [-o json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# (cluster, model, global batch): the README's lab, the two-type clusters, and small models
# on one GPU, where the micro-batch decides the most.
CASES = [
    ("examples/lab.yaml", "llama-7b", 256),
    ("examples/lab.yaml", "gpt3-1.3b", 64),
    ("examples/a100-h800.yaml", "llama-13b", 128),
    ("examples/a100x4-h800x2.yaml", "gpt3-2.7b", 64),
    ("examples/a100x1-h20x4.yaml", "gpt3-1.3b", 32),
    ("examples/mixed-nics.yaml", "llama-7b", 128),
    ("bench/gpu/one-h100.yaml", "GPU_CHECK", 32),
    ("bench/gpu/one-h100.yaml", "gpt3-1.3b", 32),
]


def _round(x):
    return None if x is None else round(x, 4)


def plan(binary: str, cluster: str, model: str, gb: int) -> tuple[dict, float]:
    t0 = time.perf_counter()
    out = subprocess.run([binary, "plan", "--cluster", cluster, "--model", model, "--global-batch", str(gb), "-o", "json"],
                         cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}, wall
    return json.loads(out.stdout), wall


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("-o", "--output", choices=("table", "json"), default="table")
    a = p.parse_args(argv)
    # python/gpu-check's llama, as bench/gpu/plans.sh writes it.
    sys.path.insert(0, str(REPO / "python"))
    from motley_torch.tools.gpu_check import MODEL
    gpu_check = Path(tempfile.mkdtemp()) / "gpu-check-llama.json"
    gpu_check.write_text(json.dumps(MODEL))
    rows = []
    for cluster, model, gb in CASES:
        model = str(gpu_check) if model == "GPU_CHECK" else model
        for name, binary in (("before", a.before), ("after", a.after)):
            walls, doc = [], {}
            for _ in range(3):
                doc, wall = plan(binary, cluster, model, gb)
                walls.append(wall)
            row = {"cluster": Path(cluster).stem, "model": Path(model).stem if model.endswith(".json") else model, "global_batch": gb, "build": name,
                   "wall_s": round(statistics.median(walls), 3)}
            if "error" in doc:
                row["error"] = doc["error"]
            else:
                row.update(micro_batch=doc["micro_batch"], replicas=len(doc["replicas"]),
                           iteration_s=round(doc["iteration_time_s"], 4), gpus_used=doc["gpus_used"],
                           megatron_s=_round((doc.get("baselines", {}).get("megatron") or {}).get("iteration_time_s")))
            rows.append(row)
            if a.output == "json":
                print(json.dumps(row), flush=True)
    if a.output == "table":
        print("| cluster | model | G | build | micro-batch | replicas | GPUs | iteration s | Megatron s | plan wall s |")
        print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            if "error" in r:
                print(f"| {r['cluster']} | {r['model']} | {r['global_batch']} | {r['build']} | {r['error']} ||||| {r['wall_s']} |")
            else:
                print(f"| {r['cluster']} | {r['model']} | {r['global_batch']} | {r['build']} | {r['micro_batch']} | "
                      f"{r['replicas']} | {r['gpus_used']} | {r['iteration_s']} | {r['megatron_s']} | {r['wall_s']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
