#!/usr/bin/env python3
"""ImprovedMetis's Table 1 rows that finish in minutes (global batch 128, the anchor data
copied to examples/metis), side by side in one go:

1. under Metis's cost model: Motley's exact search of Metis's space and of the union, and
   Metis's own walk replayed in Rust with Metis's and ImprovedMetis's out-of-memory repair;
2. under Motley's cost model: Metis's winning plan priced as what it is, the best plan of
   Metis's space, and Motley's own best (union).

Whole-process CPU time (user + sys of the child and of /usr/bin/time around it, from
getrusage; the wrapper adds well under a millisecond) is the median of REPEAT runs (default
5); peak RSS (from /usr/bin/time) is the largest. Prints Markdown tables for BENCHMARKS.md.
"""
import json, os, resource, statistics, subprocess, sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
# Metis's inputs are read by the research tools' binary (baselines/), not the operator's `motley`.
BIN = os.environ.get("BIN", os.path.join(ROOT, "target/release/motley-baselines"))
M = "examples/metis"
REPEAT = int(os.environ.get("REPEAT", "5"))


def run(args):
    cpu, rss, out = [], 0, None
    for _ in range(REPEAT):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        p = subprocess.run(["/usr/bin/time", "-f", "RSS %M", BIN] + args + ["-o", "json"], cwd=ROOT, capture_output=True, text=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if p.returncode != 0:
            sys.exit(f"motley-baselines {' '.join(args)} failed: {p.stderr}")
        cpu.append((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime))
        rss = max(rss, int(p.stderr.strip().splitlines()[-1].split()[1]))
        out = json.loads(p.stdout)
    return out, statistics.median(cpu), rss / 1024


def inputs(layers, n):
    return ["--profiles", f"{M}/synth_L{layers}", "--hostfile", f"{M}/cluster/hostfile_{n}",
            "--clusterfile", f"{M}/cluster/clusterfile.json", "--layers", str(layers), "--global-batch", "128"]


def row(label, args):
    d, cpu, rss = run(args)
    c = d.get("counters", {})
    cells = [label, f"{d['cost_ms']:.2f}", str(d.get("plans_costed", "")), str(c.get("count", d.get("nodes", ""))),
             str(d.get("proven_optimal", "")), f"{cpu * 1000:.1f}", f"{rss:.1f}"]
    print("| " + " | ".join(cells) + " |")


ROWS = [(10, 16, 1), (20, 32, 128), (20, 64, 128)]
print("### Under Metis's cost model\n")
print("| row / search | best cost ms | plans costed | search steps (walk) / partial plans (exact) | proven optimal | CPU ms | peak RSS MiB |")
print("|---|---|---|---|---|---|---|")
for layers, n, _ in ROWS:
    tag = f"L{layers} {n}+{n}"
    row(f"{tag}: Motley exact, Metis's space", ["metis", "search"] + inputs(layers, n) + ["--space", "metis"])
    row(f"{tag}: Motley exact, union", ["metis", "search"] + inputs(layers, n) + ["--space", "union"])
    row(f"{tag}: Metis's walk (Rust replay)", ["metis", "search"] + inputs(layers, n) + ["--method", "metis"])
    row(f"{tag}: ImprovedMetis's walk (Rust replay)", ["metis", "search"] + inputs(layers, n) + ["--method", "improved-metis"])

print("\n### Under Motley's cost model\n")
print("| row / plan | cost ms | plans costed | partial plans | proven optimal | CPU ms | peak RSS MiB |")
print("|---|---|---|---|---|---|---|")
for layers, n, batches in ROWS:
    tag = f"L{layers} {n}+{n}"
    g = 2 * n
    win = json.dumps({"node_sequence": ["A100", "V100"], "device_groups": [g], "strategies": [[1, g]],
                      "batches": batches, "layer_partition": [0, layers]})
    row(f"{tag}: Metis's winner, priced by Motley", ["metis", "eval"] + inputs(layers, n) + ["--plan", win, "--cost-model", "motley"])
    row(f"{tag}: best of Metis's space", ["metis", "search"] + inputs(layers, n) + ["--space", "metis", "--cost-model", "motley"])
    row(f"{tag}: Motley's best (union)", ["metis", "search"] + inputs(layers, n) + ["--space", "union", "--cost-model", "motley"])
