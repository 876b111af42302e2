#!/usr/bin/env python3
"""Emulated GPUs at the speeds asked for (docs/emulation.md): `motley dev up --emulate` of a
cluster of one A100-80G and one V100-32G (one GPU each), a job whose two ranks run the same
fixed layer workload at once (a transformer MLP block's forward and backward, torch on one
thread), each timing it by the wall clock. The kernel holds each rank to its node's share of one
core, so the slow rank's time over the fast rank's should be the fast share over the slow share
(312/125 TFLOPS: about 2.5). Prints a Markdown row for BENCHMARKS.md.

Run as root (the agents set cgroup CPU quotas) after `cargo build --profile ci`, with the
project's venv: `sudo .venv/bin/python bench/emulation_speed.py` (MOTLEY_BIN: the motley binary,
default target/ci/motley). Needs nothing else running: the shares are of this machine's cores.
"""
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = os.environ.get("MOTLEY_BIN", str(ROOT / "target" / "ci" / "motley"))
STEPS = int(os.environ.get("STEPS", "200"))

WORKLOAD = f"""
import os, time, torch
torch.set_num_threads(1)
torch.manual_seed(0)
w1, w2 = torch.randn(512, 2048, requires_grad=True), torch.randn(2048, 512, requires_grad=True)
x = torch.randn(256, 512)
def step():
    y = torch.relu(x @ w1) @ w2
    y.square().mean().backward()
step()
t = time.perf_counter()
for _ in range({STEPS}):
    step()
print(f"layer_s={{(time.perf_counter() - t) / {STEPS}:.5f}} node={{os.environ.get('MOTLEY_NODE')}}", flush=True)
"""


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="motley-emulation-") as tmp:
        tmp = Path(tmp)
        (tmp / "cluster.yaml").write_text(
            "name: emu\nnodes:\n  - {name: fast, gpu: A100-80G, gpus: 1}\n  - {name: slow, gpu: V100-32G, gpus: 1}\n")
        (tmp / "work.py").write_text(WORKLOAD)
        (tmp / "job.yaml").write_text(
            "name: emulation-speed\nmodel: gpt3-1.3b\nglobal_batch: 8\nresources: {gpus: 2}\n"
            f"run: '{sys.executable} {tmp / 'work.py'}'\n")
        out = subprocess.run([BIN, "dev", "up", str(tmp / "cluster.yaml"), str(tmp / "job.yaml"), "--emulate",
                              "--dir", str(tmp / "state")], capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            sys.exit(f"motley dev up failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
        shares = dict(re.findall(r"emulating (\S+) on ([0-9.]+) of one core", out.stdout))
        times = {node: float(t) for t, node in re.findall(r"layer_s=([0-9.]+) node=(\S+)", out.stdout)}
        if set(times) != {"fast", "slow"} or len(shares) != 2:
            sys.exit(f"missing lines in the run's output:\n{out.stdout}")
        asked = float(shares["A100-80G"]) / float(shares["V100-32G"])
        measured = times["slow"] / times["fast"]
        print("| A100-80G share | V100-32G share | asked ratio | A100 layer s | V100 layer s | measured ratio | error |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        print(f"| {shares['A100-80G']} | {shares['V100-32G']} | {asked:.3f} | {times['fast']:.4f} | {times['slow']:.4f} | "
              f"{measured:.3f} | {100 * (measured / asked - 1):+.1f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
