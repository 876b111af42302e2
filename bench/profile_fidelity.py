#!/usr/bin/env python3
"""How well AutoHet's eq. 5 predicts the time of n layers from the profiled blocks of 1, 2, 4 and 8.

Profiles a small GPT with `python -m motley_torch.profile` (blocks of n = 1, 2, 4, 8 layers,
tp 1), then times n = 1..8 consecutive layers directly in this process with the profiler's own
code (`motley_torch.profile.time_blocks`: same layers, inputs, warm-up and median, per-thread
CPU time on the CPU, CUDA events on a GPU) and prints, for forward and backward, eq. 5's
prediction (3 = 2+1, 5 = 4+1, 6 = 4+2, 7 = 4+2+1; for 1, 2, 4, 8 the profiled block itself,
so those rows show the run-to-run noise), the linear estimate n * fwd_ms (the per-layer time
the profiles file carries, the 8-layer block / 8), the measured time and eq. 5's error.
Markdown for BENCHMARKS.md.

    OMP_NUM_THREADS=1 python bench/profile_fidelity.py [--micro-batch 2] [--runs 7] [--warmup 2]
        [--model FILE]    # default: a small built-in GPT (8 layers, hidden 256, seq 128)
        [--wait-idle CORES [--wait-max S]]   # first wait until fewer than CORES cores are busy

Prints the load average and how many cores the rest of the machine kept busy during the run
(/proc/stat minus this benchmark's own CPU time).
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))

import yaml  # noqa: E402

DEFAULT_MODEL = dict(name="fidelity-gpt", layers=8, hidden=256, heads=4, seq_len=128, vocab=1024)


def decompose(n: int):
    """n as a sum of the profiled blocks, largest first (7 = 4+2+1)."""
    out = []
    for b in (8, 4, 2, 1):
        while n >= b:
            out.append(b)
            n -= b
    return out


def busy_jiffies() -> int:
    """CPU time (jiffies) every process of the machine has used (/proc/stat's cpu line)."""
    f = open("/proc/stat").readline().split()
    user, nice, system, idle, iowait, irq, softirq, steal = map(int, f[1:9])
    return user + nice + system + irq + softirq + steal


def own_cpu_s() -> float:
    import resource

    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))


def wait_idle(threshold: float, limit_s: float) -> float:
    """Wait (at most limit_s) until fewer than `threshold` cores are busy (3 s samples)."""
    import time

    deadline = time.monotonic() + limit_s
    while True:
        j0, t0 = busy_jiffies(), time.monotonic()
        time.sleep(3)
        b = (busy_jiffies() - j0) / os.sysconf("SC_CLK_TCK") / (time.monotonic() - t0)
        if b < threshold or time.monotonic() > deadline:
            return b


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model YAML file (default: a small built-in GPT)")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--wait-idle", type=float, default=0.0, metavar="CORES",
                    help="first wait until fewer than CORES cores are busy (at most --wait-max s; default: do not wait)")
    ap.add_argument("--wait-max", type=float, default=600.0)
    a = ap.parse_args()
    import time

    if a.wait_idle:
        wait_idle(a.wait_idle, a.wait_max)
    load_start = " ".join(f"{x:.2f}" for x in os.getloadavg())
    j0, c0, w0 = busy_jiffies(), own_cpu_s(), time.monotonic()

    tmp = tempfile.mkdtemp(prefix="profile-fidelity-")
    model = a.model
    if model is None:
        model = os.path.join(tmp, "model.yaml")
        with open(model, "w") as f:
            yaml.safe_dump(DEFAULT_MODEL, f, sort_keys=False)
    out = os.path.join(tmp, "profiles.yaml")
    cmd = [sys.executable, "-m", "motley_torch.profile", "--model", model, "--tp", "1",
           "--micro-batch", str(a.micro_batch), "--warmup", str(a.warmup), "--runs", str(a.runs), "--output", out]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (os.path.join(ROOT, "python"), env.get("PYTHONPATH")) if x)
    subprocess.run(cmd, check=True, env=env)
    with open(out) as f:
        entry = yaml.safe_load(f)["profiles"][0]
    prof_blocks = {b["layers"]: b for b in entry["blocks"]}

    from motley_torch.tools import profile as prof

    spec = prof.load_spec(model)
    args = SimpleNamespace(micro_batch=a.micro_batch, warmup=a.warmup, runs=a.runs, dtype="fp32", tp=1,
                           seq_len=None)
    seq = spec.seq_len
    prof._setup_device(SimpleNamespace(tp=1), 0)
    ctx = prof.Ctx(args, spec, seq, 0, None)
    measured = {n: prof.time_blocks(ctx, n) for n in range(1, 9)}
    wall = time.monotonic() - w0
    ours = (own_cpu_s() - c0) / wall
    others = max(0.0, (busy_jiffies() - j0) / os.sysconf("SC_CLK_TCK") / wall - ours)
    load_end = " ".join(f"{x:.2f}" for x in os.getloadavg())

    print(f"Command: `OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')} python bench/profile_fidelity.py "
          f"--micro-batch {a.micro_batch} --runs {a.runs} --warmup {a.warmup}"
          + (f" --wait-idle {a.wait_idle}" if a.wait_idle else "") + (f" --model {a.model}" if a.model else "") + "`")
    print(f"Profiler: `{' '.join(shlex.quote(c if c != sys.executable else 'python') for c in cmd)}`")
    print(f"Machine: nproc {os.cpu_count()}, {cpu_model()}; torch {entry['torch']}; device {entry['device']}; "
          f"timer: {'CUDA events' if ctx.device.type == 'cuda' else 'time.thread_time (1 intra-op thread)'}")
    print(f"Model: {yaml.safe_dump(prof.canonical_spec(spec), default_flow_style=True, width=200).strip()}, "
          f"micro-batch {a.micro_batch}, seq {seq}, {entry['dtype']}, median of {a.runs} runs after {a.warmup}")
    print(f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average {load_start} at the start, "
          f"{load_end} at the end; cores busy during the run: this benchmark {ours:.2f}, the rest of the machine "
          f"{others:.2f} (/proc/stat)")
    print(f"Per-layer times in the profiles file: fwd_ms {entry['fwd_ms']:.3f}, bwd_ms {entry['bwd_ms']:.3f}")
    print()
    for i, what in ((0, "fwd"), (1, "bwd")):
        key = f"{what}_ms"
        noise = max(abs(prof_blocks[n][key] - measured[n][i]) / measured[n][i] for n in (1, 2, 4, 8))
        composed = max(abs(sum(prof_blocks[b][key] for b in decompose(n)) - measured[n][i]) / measured[n][i]
                       for n in (3, 5, 6, 7))
        print(f"{what}: noise floor (the profiled blocks 1, 2, 4, 8 re-measured) max |error| {100 * noise:.1f}%; "
              f"eq. 5 on 3, 5, 6, 7 max |error| {100 * composed:.1f}%")
        print()
        print(f"| layers | blocks | eq. 5 {what} ms | n x {key} | measured ms | eq. 5 error | linear error |")
        print("|---:|:---|---:|---:|---:|---:|---:|")
        for n in range(1, 9):
            parts = decompose(n)
            pred = sum(prof_blocks[b][key] for b in parts)
            lin = n * entry[key]
            m = measured[n][i]
            print(f"| {n} | {'+'.join(map(str, parts))} | {pred:.3f} | {lin:.3f} | {m:.3f} | "
                  f"{100 * (pred - m) / m:+.1f}% | {100 * (lin - m) / m:+.1f}% |")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
