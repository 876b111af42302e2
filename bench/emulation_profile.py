#!/usr/bin/env python3
"""The agents' layer profiler on emulated GPUs (docs/emulation.md): `motley dev up --emulate` of
a cluster of one A100-80G and one V100-32G (one GPU each, at 0.5 and 0.2 of a core: FAST, SLOW)
and a job planned from measured
profiles only (`profiling: {mode: only}`, tp 1, micro-batch 1), so the coordinator sends each
node's agent a `Profile` run and its profiler (`python -m motley_torch.profile`, the same
program as on a real GPU) measures the model's layers inside the node's CPU share. The profiles
the coordinator stored are read back from its database: the V100's layer time (forward plus
backward, over every block the profiler timed: 1, 2, 4 and 8 layers, 15 layers in all, the
least noisy figure a profile holds) over the A100's should be the A100's share over the V100's (2.5, as the types' peaks: 312/125 TFLOPS), so the planner learns each type's speed from
measurements, not from the catalog. Prints a Markdown row for BENCHMARKS.md; exits 1 when the
measured ratio is more than 10% from the one asked for.

Run as root (the agents set cgroup CPU quotas) after `cargo build --profile ci`, with the
project's venv: `sudo .venv/bin/python bench/emulation_profile.py` (MOTLEY_BIN: the motley
binary, default target/ci/motley; HIDDEN, LAYERS, SEQ: the model's size). Needs nothing else
running: the shares are of this machine's cores.
"""
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = os.environ.get("MOTLEY_BIN", str(ROOT / "target" / "ci" / "motley"))
HIDDEN = int(os.environ.get("HIDDEN", "256"))
LAYERS = int(os.environ.get("LAYERS", "4"))
SEQ = int(os.environ.get("SEQ", "128"))
# The shares asked for, explicit: `dev up --emulate` would give 1.0 and 0.4 on a 2-core machine,
# and the two profilers together with the coordinator and the agents would then contend for
# the cores (a throttled rank waiting for a core is slower than its share).
FAST = float(os.environ.get("FAST", "0.5"))
SLOW = float(os.environ.get("SLOW", "0.2"))
BOUND = 0.10


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="motley-emulation-profile-") as tmp:
        tmp = Path(tmp)
        (tmp / "cluster.yaml").write_text(
            "name: emu\nnodes:\n"
            f"  - {{name: fast, gpu: A100-80G, gpus: 1, emulate: {{cpu: {FAST}}}}}\n"
            f"  - {{name: slow, gpu: V100-32G, gpus: 1, emulate: {{cpu: {SLOW}}}}}\n")
        (tmp / "job.yaml").write_text(
            "name: emulation-profile\n"
            f"model: {{name: emu-gpt, layers: {LAYERS}, hidden: {HIDDEN}, heads: 4, seq_len: {SEQ}, vocab: 512}}\n"
            "global_batch: 2\nresources: {gpus: 2}\n"
            "plan_options: {tp: 1, micro_batch: 1}\nprofiling: {mode: only}\n"
            "run: 'true'\nenvs: {OMP_NUM_THREADS: '1'}\n")
        env = dict(os.environ, MOTLEY_PYTHON=sys.executable, PYTHONPATH=str(ROOT / "python"), OMP_NUM_THREADS="1")
        work = tmp / "state"
        out = subprocess.run([BIN, "dev", "up", str(tmp / "cluster.yaml"), str(tmp / "job.yaml"), "--emulate",
                              "--dir", str(work)], capture_output=True, text=True, timeout=900, env=env)
        if out.returncode != 0:
            sys.exit(f"motley dev up failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
        shares = {"A100-80G": FAST, "V100-32G": SLOW}
        dbs = list(work.rglob("coordinator.db"))
        if len(dbs) != 1:
            sys.exit(f"no database ({dbs}) in the run:\n{out.stdout}")
        with sqlite3.connect(str(dbs[0])) as db:
            rows = db.execute("SELECT gpu, node, dtype, entry FROM layer_profiles").fetchall()
        layer_ms, dtypes = {}, set()
        for gpu, node, dtype, entry in rows:
            e = json.loads(entry)
            blocks = e["blocks"]
            layer_ms[gpu] = (sum(float(b["fwd_ms"]) + float(b["bwd_ms"]) for b in blocks) / sum(int(b["layers"]) for b in blocks),
                             float(e["fwd_ms"]) + float(e["bwd_ms"]))
            dtypes.add(dtype)
        if set(layer_ms) != {"A100-80G", "V100-32G"}:
            sys.exit(f"profiles stored for {sorted(layer_ms)}, not both types:\n{out.stdout}")
        asked = FAST / SLOW
        (fast, fast_entry), (slow, slow_entry) = layer_ms["A100-80G"], layer_ms["V100-32G"]
        measured = slow / fast
        error = measured / asked - 1
        print("| model (layers x hidden, seq) | dtype | A100-80G share | V100-32G share | asked ratio "
              "| A100 layer ms (fwd+bwd, blocks) | V100 layer ms | measured ratio | error | entries' fwd+bwd ratio |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        print(f"| {LAYERS} x {HIDDEN}, {SEQ} | {','.join(sorted(dtypes))} | {shares['A100-80G']} | "
              f"{shares['V100-32G']} | {asked:.3f} | {fast:.2f} | {slow:.2f} | {measured:.3f} | {100 * error:+.1f}% | "
              f"{slow_entry / fast_entry:.3f} |")
        return 0 if abs(error) <= BOUND else 1


if __name__ == "__main__":
    sys.exit(main())
