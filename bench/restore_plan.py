#!/usr/bin/env python3
"""The restore planner's benchmarks (docs/restore.md), through `motley restore-plan`.

  bench/restore_plan.py autohet [--write examples/restore]   AutoHet's scenarios A, B, C for
      GPT-3 2.7B/6.7B/13B/20B: cloud-only (every rank its own shards, Varuna's way), AutoHet's
      strategy (a shard read once per replica, cloud bytes once per replica) as modelled
      here, the planner's makespan and lower bound, one table.
  bench/restore_plan.py scale [--nodes 64 --layers 80 --tp 8] [--runs 5]   a generated
      scenario of that size, planned --runs times; prints the wall time of each run.
  bench/restore_plan.py scale --emit FILE   only write the generated scenario.

MOTLEY (default target/ci/motley) is the binary to run.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOTLEY = os.environ.get("MOTLEY", os.path.join(ROOT, "target", "ci", "motley"))

# GPT-3 shapes as in the solver's catalog (layers, hidden); vocabulary 51200, sequence 2048.
MODELS = {"gpt3-2.7b": (32, 2560), "gpt3-6.7b": (32, 4096), "gpt3-13b": (40, 5120), "gpt3-20b": (44, 6144)}
VOCAB, SEQ = 51200, 2048
# 14 bytes per parameter: fp16 weights (2) in the model part; fp32 master, momentum and
# variance (12) in the optimizer part.
MODEL_B, OPT_B = 2, 12
CLOUD, NVME, ROCE, MEMCPY = 1200.0, 3500.0, 50000.0, 20000.0  # MB/s; 400 Gbit/s = 50,000 MB/s


def units(layers, hidden):
    layer = 12 * hidden * hidden + 13 * hidden
    embed = (VOCAB + SEQ) * hidden
    head = 2 * hidden  # the final layer norm; the output projection is tied to the embedding
    part = lambda p: {"model": p * MODEL_B, "optimizer": p * OPT_B}
    return {"layers": layers, "layer": part(layer), "embed": part(embed), "head": part(head)}


def node(name):
    return {"name": name, "nic_in_mb_s": ROCE, "disk_read_mb_s": NVME, "mem_copy_mb_s": MEMCPY}


def autohet(model):
    """Scenarios A, B, C of AutoHet section V.C. Assumed (the paper gives no more): each DP
    group is a two-stage pipeline, an A100 stage (TP 2, the embedding and the first two thirds
    of the layers) on N0 and an H20 stage (TP 2, the last third and the head) on N1 -- the split
    that reproduces the issue's 8.75x / 3.0x / 13x and the paper's 4.38x and 1.49x; shards are
    on the nodes' NVMe (memory is cleared when ranks restart), the cloud has the whole step."""
    layers, hidden = MODELS[model]
    cut = round(2 * layers / 3)
    s0 = f"embed,0-{cut - 1}"
    s1 = f"{cut}-{layers - 1},head"
    u = units(layers, hidden)
    tp2 = lambda layers_: [{"layers": layers_, "tp_size": 2}]
    base = {"cloud": {"egress_mb_s": CLOUD}, "units": u}
    a = dict(base, name=f"A {model}", nodes=[node("N0"), node("N1")],
             holdings=[{"node": "N0", "tier": "disk", "shards": tp2(s0)}, {"node": "N1", "tier": "disk", "shards": tp2(s1)}],
             demands=[{"node": "N0", "shards": tp2(s0)}] * 2 + [{"node": "N1", "shards": tp2(s1)}] * 2)
    b = dict(base, name=f"B {model}", nodes=[node("N1")],
             holdings=[{"node": "N1", "tier": "disk", "shards": tp2(s1)}],
             demands=[{"node": "N1", "shards": [{"layers": "all", "tp_size": 4}]}] * 2)
    c = dict(base, name=f"C {model}", nodes=[node("N0"), node("N1"), node("N2"), node("N3")],
             holdings=a["holdings"],
             demands=a["demands"] + [{"node": "N2", "shards": tp2(s0)}, {"node": "N3", "shards": tp2(s1)}])
    # AutoHet's strategy as the issue describes it: every replica reads its shards itself
    # (local disk, or a peer's disk over RDMA), missing bytes from the cloud once per replica.
    size = lambda spec: sum(u["layer"]["model"] + u["layer"]["optimizer"] for _ in range(spec)) / 1e6
    mb0 = (size(cut) + (u["embed"]["model"] + u["embed"]["optimizer"]) / 1e6)
    mb1 = (size(layers - cut) + (u["head"]["model"] + u["head"]["optimizer"]) / 1e6)
    autohet_s = {"A": max(2 * mb0, 2 * mb1) / NVME, "B": max(2 * mb0 / CLOUD, 2 * mb1 / NVME), "C": max(3 * mb0, 3 * mb1) / NVME}
    return {"A": a, "B": b, "C": c}, autohet_s


def run(scenario_path):
    out = subprocess.run([MOTLEY, "restore-plan", "--scenario", scenario_path, "-o", "json"], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"motley restore-plan {scenario_path} failed: {out.stderr}")
    return json.loads(out.stdout)


def cmd_autohet(args):
    tmp = tempfile.mkdtemp(prefix="restore-autohet-")
    rows = []
    for model in MODELS:
        scen, autohet_s = autohet(model)
        for key, sc in scen.items():
            path = os.path.join(tmp, f"autohet-{key.lower()}-{model}.json")
            with open(path, "w") as f:
                json.dump(sc, f, indent=1)
            if args.write and model == args.write_model:
                os.makedirs(args.write, exist_ok=True)
                with open(os.path.join(args.write, f"autohet-{key.lower()}-{model}.json"), "w") as f:
                    json.dump(sc, f, indent=1)
                    f.write("\n")
            r = run(path)
            rows.append((key, model, r["cloud_only_s"], autohet_s[key], r["makespan_s"], r["lower_bound_s"], r["bottleneck"]))
    print("| scenario | model | cloud-only s | AutoHet (modelled) s | Motley plan s | lower bound s | cloud-only / plan | AutoHet / plan | plan / bound | bottleneck |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for key, model, co, ah, mk, lb, bn in sorted(rows, key=lambda r: (r[0], list(MODELS).index(r[1]))):
        print(f"| {key} | {model} | {co:.2f} | {ah:.2f} | {mk:.2f} | {lb:.2f} | {co / mk:.2f}x | {ah / mk:.2f}x | {mk / lb:.3f} | {bn} |")


def scale(nodes, layers, tp, hidden):
    """Old plan: R replicas x S stages, one node per stage (TP `tp` over its 8 GPUs), every
    node holding its stage in memory and on disk. Then one node of every replica is lost
    (a diagonal: replica r loses stage r mod S) and as many fresh nodes join; the nodes whose
    index is odd restarted (memory cleared, disk kept). New plan on the same number of nodes:
    stages shifted by a third of a stage, TP `tp`/2 with two TP groups per node (re-slicing)."""
    stages = 8
    replicas = nodes // stages
    per = layers // stages
    def stage_layers(i, shift=0):
        lo, hi = max(0, i * per + shift), min(layers, (i + 1) * per + shift) if i < stages - 1 else layers
        spec = f"{lo}-{hi - 1}"
        return ("embed," if i == 0 else "") + spec + (",head" if i == stages - 1 else "")
    names = [f"n{i:03d}" for i in range(nodes)]
    lost = {r * stages + (r % stages) for r in range(replicas)}
    ns = [{"name": n, "nic_in_mb_s": ROCE, "disk_read_mb_s": NVME, "mem_copy_mb_s": MEMCPY} for n in names]
    ns += [{"name": f"new{j:03d}", "nic_in_mb_s": ROCE, "disk_read_mb_s": NVME, "mem_copy_mb_s": MEMCPY} for j in range(len(lost))]
    holdings = []
    for i, n in enumerate(names):
        if i in lost:
            continue
        sh = [{"layers": stage_layers(i % stages), "tp_size": tp}]
        holdings.append({"node": n, "tier": "disk", "shards": sh})
        if i % 2 == 0:
            holdings.append({"node": n, "tier": "memory", "shards": sh})
    live = [n for i, n in enumerate(names) if i not in lost] + [f"new{j:03d}" for j in range(len(lost))]
    shift = per // 3
    demands = []
    for k, n in enumerate(live):
        demands.append({"node": n, "shards": [{"layers": stage_layers(k % stages, shift if 0 < k % stages < stages else 0), "tp_size": tp // 2}]})
    return {"name": f"scale {nodes} nodes x {layers} layers x TP {tp}", "cloud": {"egress_mb_s": CLOUD},
            "units": units(layers, hidden), "nodes": ns, "holdings": holdings, "demands": demands}


def cmd_scale(args):
    sc = scale(args.nodes, args.layers, args.tp, args.hidden)
    path = args.emit or os.path.join(tempfile.mkdtemp(prefix="restore-scale-"), "scale.json")
    with open(path, "w") as f:
        json.dump(sc, f)
    if args.emit:
        return
    times = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        r = run(path)
        times.append(time.perf_counter() - t0)
    print(json.dumps({"scenario": sc["name"], "nodes": len(sc["nodes"]), "transfers": len(r["transfers"]),
                      "lower_bound_s": round(r["lower_bound_s"], 3), "makespan_s": round(r["makespan_s"], 3),
                      "bottleneck": r["bottleneck"], "wall_s": [round(t, 3) for t in times], "best_wall_s": round(min(times), 3)}))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("autohet")
    a.add_argument("--write", help="also write the scenario files of --write-model to this folder")
    a.add_argument("--write-model", default="gpt3-6.7b")
    s = sub.add_parser("scale")
    s.add_argument("--nodes", type=int, default=64)
    s.add_argument("--layers", type=int, default=80)
    s.add_argument("--tp", type=int, default=8)
    s.add_argument("--hidden", type=int, default=8192)
    s.add_argument("--runs", type=int, default=5)
    s.add_argument("--emit")
    args = p.parse_args()
    {"autohet": cmd_autohet, "scale": cmd_scale}[args.cmd](args)


if __name__ == "__main__":
    main()
