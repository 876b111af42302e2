#!/usr/bin/env python3
"""Re-planning a 256-GPU cluster after a bandwidth change, timed as a user runs it.

The cluster (written to a temporary folder): an InfiniBand island of 16 x 8 A100-80G and a
RoCE island of 16 x 8 H800, 25 Gbit/s Ethernet between. The change: every pair inside the
InfiniBand island measures at half its nominal rate (a 16 x 16 matrix file). For each model:
`motley plan -o json` on the nominal network, then `motley replan --current ... --bandwidth
...`, whole process, median wall and CPU (user + sys) of REPEAT runs (default 5). Prints
Markdown for BENCHMARKS.md. Run after `cargo build --release`.
"""
import json, os, resource, statistics, subprocess, sys, tempfile, time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
BIN = os.environ.get("BIN", os.path.join(ROOT, "target/release/motley"))
REPEAT = int(os.environ.get("REPEAT", "5"))
JOBS = [("gpt3-6.7b", 1024), ("llama-13b", 1024), ("llama-70b", 512)]


def cluster_yaml():
    lines = ["name: two-islands-256", "nodes:"]
    lines.append("  - {name: ib, count: 16, gpu: A100-80G, gpus: 8, nics: [{name: mlx5_0, kind: ib, gbps: 200}, "
                 "{name: mlx5_1, kind: ib, gbps: 200}, {name: eth0, kind: ethernet, gbps: 25}], rdma_domain: ib}")
    lines.append("  - {name: roce, count: 16, gpu: H800, gpus: 8, nics: [{name: mlx5_0, kind: roce, gbps: 400}, "
                 "{name: eth0, kind: ethernet, gbps: 25}], rdma_domain: roce}")
    return "\n".join(lines) + "\n"


def halved_matrix():
    nominal = 400 / 8 * 0.85  # two 200 Gbit/s IB rails, GB/s at 85%
    names = [f"ib-{i}" for i in range(16)]
    rows = [[None if i == j else nominal / 2 for j in range(16)] for i in range(16)]
    return json.dumps({"nodes": names, "matrix": rows})


def island_share(plan):
    """Fraction of the plan's layer-samples-GPUs (its work) on the InfiniBand island."""
    island = total = 0
    for r in plan["replicas"]:
        for s in r["stages"]:
            w = r["samples"] * (s["layers"][1] - s["layers"][0]) * len(s["gpus"])
            total += w
            island += w if s["gpus"][0]["node"].startswith("ib-") else 0
    return island / total


def timed(args):
    walls, cpus, out = [], [], None
    for _ in range(REPEAT):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        p = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
        walls.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
        if p.returncode != 0:
            sys.exit(f"{' '.join(args)} failed: {p.stderr}")
        out = p.stdout
    return statistics.median(walls), statistics.median(cpus), out


def main():
    tmp = tempfile.mkdtemp(prefix="motley-replan-")
    cluster = os.path.join(tmp, "cluster.yaml")
    bw = os.path.join(tmp, "ib-halved.json")
    open(cluster, "w").write(cluster_yaml())
    open(bw, "w").write(halved_matrix())
    print("| model | global batch | plan s (wall / CPU) | replan s (wall / CPU) | current plan: planned -> on measured network | new plan | gain | verdict | GPUs moved | GB moved | IB island's share of the work: before -> after |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for model, batch in JOBS:
        base = ["--cluster", cluster, "--model", model, "--global-batch", str(batch)]
        pw, pc, plan_out = timed([BIN, "plan", *base, "-o", "json"])
        cur = os.path.join(tmp, f"{model}.json")
        open(cur, "w").write(plan_out)
        rw, rc, out = timed([BIN, "replan", "--current", cur, "--bandwidth", bw, *base, "-o", "json"])
        r = json.loads(out)
        worst = max(worst, rw)
        print(f"| {model} | {batch} | {pw:.3f} / {pc:.3f} | {rw:.3f} / {rc:.3f} | {r['current_planned_s']:.3f} -> {r['current_now_s']:.3f} s | "
              f"{r['new_iteration_time_s']:.3f} s | {r['gain'] * 100:+.1f}% | {'switch' if r['worth_switching'] else 'keep'} | "
              f"{r['gpus_moved']} | {abs(r['switch_bytes']) / 1e9:.1f} | "
              f"{island_share(json.loads(plan_out)):.3f} -> {island_share(r['new_plan']):.3f} |")
    print()
    print(f"slowest replan: {worst:.3f} s wall ({'under' if worst < 1.0 else 'OVER'} the 1 s bar)")
    return 0 if worst < 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
