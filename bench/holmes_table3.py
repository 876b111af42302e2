#!/usr/bin/env python3
"""Holmes Table 3, side by side in one go: GPT 3.6B / 7.5B (Table 2's parameter groups) on
4, 6 and 8 nodes of 8 x A100-80G under four NIC environments (examples/holmes/*.yaml):
InfiniBand 200 Gbit/s, RoCE 200 Gbit/s, Ethernet 25 Gbit/s, and Hybrid (half the nodes IB,
half RoCE, Ethernet between). For each cell: Motley's predicted TFLOPS per GPU (model FLOPs,
6 x params x tokens plus attention, as Megatron counts them) next to the paper's measured
TFLOPS, the plan's shape, and for Hybrid the speed-up over the best plan that ignores NIC
kinds (one flat Ethernet fabric: the Ethernet row's plan, which is what a NIC-blind launcher
runs on this cluster). Checks the bars: IB >= RoCE > Hybrid > Ethernet and Hybrid within 25%
of RoCE. Prints Markdown for BENCHMARKS.md. Run after `cargo build --release`.

EFFICIENCY (default 0.5, Motley's default) is the fraction of A100 peak a layer reaches.
"""
import json, os, subprocess, sys, time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
BIN = os.environ.get("BIN", os.path.join(ROOT, "target/release/motley"))
EFF = os.environ.get("EFFICIENCY", "0.5")
H = "examples/holmes"
# (group, model file, global batch, paper PP): Holmes Table 2.
GROUPS = [(1, "gpt-3.6b", 768, 2), (2, "gpt-3.6b", 1536, 2), (3, "gpt-7.5b", 1536, 3), (4, "gpt-7.5b", 2688, 3)]
ENVS = ["ib", "roce", "ethernet", "hybrid"]
# Holmes Table 3, TFLOPS per GPU: PAPER[group][env] = (4 nodes, 6 nodes, 8 nodes).
PAPER = {
    1: {"ib": (197, 188, 148), "roce": (160, 151, 145), "ethernet": (122, 99, 83), "hybrid": (149, 129, 112)},
    2: {"ib": (206, 200, 156), "roce": (168, 162, 159), "ethernet": (145, 128, 114), "hybrid": (162, 152, 132)},
    3: {"ib": (229, 220, 189), "roce": (196, 185, 185), "ethernet": (168, 143, 132), "hybrid": (191, 170, 168)},
    4: {"ib": (233, 228, 196), "roce": (201, 193, 194), "ethernet": (180, 168, 158), "hybrid": (200, 187, 177)},
}
MODELS = {"gpt-3.6b": (30, 3072, 2048, 51200), "gpt-7.5b": (36, 4096, 2048, 51200)}


def plan(env, nodes, model, batch, pp=None):
    args = [BIN, "plan", "--cluster", f"{H}/{env}-{nodes}.yaml", "--model", f"{H}/{model}.yaml",
            "--global-batch", str(batch), "--efficiency", EFF, "--p2p-blocking", "-o", "json"]
    if pp:
        args += ["--tp", "1", "--max-stages", str(pp)]
    t0 = time.perf_counter()
    out = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return json.loads(out), time.perf_counter() - t0


def tflops(model, batch, seconds, gpus):
    layers, h, s, v = MODELS[model]
    # Megatron-LM's model FLOPs per iteration (Narayanan et al. 2021, eq. 3, no recompute).
    flops = 72 * batch * s * layers * h * h * (1 + s / (6 * h) + v / (12 * h * layers)) * (3 / 4) * 4 / 3
    return flops / seconds / gpus / 1e12


def shape(r):
    reps = r["replicas"]
    st = reps[0]["stages"]
    uniform = all([(s["layers"], s["tp"], s["dp"]) for s in x["stages"]] == [(s["layers"], s["tp"], s["dp"]) for s in st] for x in reps)
    split = "/".join(str(s["layers"][1] - s["layers"][0]) for s in st)
    return f"{len(reps)}x pp{len(st)} tp{st[0]['tp']} [{split}]" + ("" if uniform else " (mixed)")


def main():
    ok = True
    print("| group | nodes | env | Motley TFLOPS/GPU (Holmes's tp 1, pp <= {2,3}) | paper TFLOPS/GPU | Motley / paper | Motley plan | DP rings | Motley free plan TFLOPS/GPU | free plan | plan s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    summary = []
    for g, model, batch, pp in GROUPS:
        for ni, nodes in enumerate((4, 6, 8)):
            row = {}
            for env in ENVS:
                r, wall = plan(env, nodes, model, batch, pp)
                tf = tflops(model, batch, r["iteration_time_s"], nodes * 8)
                free, wall2 = plan(env, nodes, model, batch)
                tf_free = tflops(model, batch, free["iteration_time_s"], nodes * 8)
                rings = sorted({c["transport"] for c in r["comm_groups"] if c["kind"] == "dp"})
                row[env] = (tf, r)
                paper = PAPER[g][env][ni]
                print(f"| {g} | {nodes} | {env} | {tf:.1f} | {paper} | {tf / paper:.2f} | {shape(r)} | {','.join(rings)} | "
                      f"{tf_free:.1f} | {shape(free)} | {max(wall, wall2):.2f} |")
            ib, ro, et, hy = (row[e][0] for e in ENVS)
            order = ib >= ro > hy > et
            within = hy >= 0.75 * ro
            ok &= order and within
            summary.append((g, nodes, ib, ro, hy, et, order, within))
    print()
    print("| group | nodes | IB >= RoCE > Hybrid > Ethernet | Hybrid / RoCE (Motley) | Hybrid / RoCE (paper) | Hybrid over flat Ethernet plan (Motley) | (paper) |")
    print("|---|---|---|---|---|---|---|")
    for g, nodes, ib, ro, hy, et, order, within in summary:
        ni = (4, 6, 8).index(nodes)
        p = PAPER[g]
        print(f"| {g} | {nodes} | {'yes' if order else 'NO'} | {hy / ro:.2f} | {p['hybrid'][ni] / p['roce'][ni]:.2f} | "
              f"{hy / et:.2f}x | {p['hybrid'][ni] / p['ethernet'][ni]:.2f}x |")
    print()
    print("all bars met" if ok else "BARS NOT MET")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
