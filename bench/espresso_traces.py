#!/usr/bin/env python3
"""Motley's cost model against Espresso's measured DeepSpeed traces (BENCHMARKS.md, its fidelity section).

Reads ../shared/anchors/espresso/profiles (DATA.md): operations_record.csv per pipeline rank of
real DeepSpeed runs (bf16, activation checkpointing, 4 micro-batches). For every run below it
builds a cluster (one node per pipeline rank, one GPU each), a model file and the running plan
(DeepSpeed's stage boundaries as Motley layer ranges), prices that plan with
`motley replan --current plan.json -o json` (its `current_plan` is the plan priced as given,
with per-stage forward/backward seconds) and prints, side by side in one table:

  BEFORE  today's defaults: fp16 peaks, efficiency 0.5 for every GPU, no recompute, 10 Gbit/s
          Ethernet at 85%, sends overlapping compute;
  AFTER   the run as it ran: --precision bf16 (per-dtype peaks), --calibration (per-GPU
          efficiency, derived below), --recompute (DeepSpeed's activation checkpointing),
          --p2p-blocking (DeepSpeed's sends are synchronous) and --bandwidth with each hop's
          rate measured from the run's own send durations (the faster direction's median: a
          synchronous send also waits for its receiver), what nccl-tests would give.

Calibration: forward/backward efficiency per GPU type from CALIBRATION runs only -- one
homogeneous run per type (3 x A30, 3 x RTX3090, 4 x A4000, 2 x A6000, 3 x A10G; non-last stages,
so the output head is not in them) and, for V100 and T4, which have no homogeneous run, their
one stage in 2A10G+V100 and 2A10G+T4. Rows used to calibrate are marked `cal`; every other row
(the mixed runs, and A10G+V100+2T4 entirely) is validation.

The workload (DATA.md does not record it; inferred): Espresso's upstream motivation job,
LLaMA with hidden 2048, 16 heads, SwiGLU FFN 5504, vocab 32000, sequence 2000, global batch 32
in 4 micro-batches of 8 (the juchiyun sends carry 8 x 2000 x 2048 bf16 = 65.5 MB each at
~0.35 GB/s, matching the traces); 32 layers for the juchiyun runs (35 DeepSpeed specs),
24 for the AWS ones (27 specs).

Usage: python3 bench/espresso_traces.py [--write-calibration FILE]
BIN defaults to target/ci/motley, else target/release/motley. Python 3 stdlib only.
"""
import csv, glob, json, os, statistics, subprocess, sys, tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
DATA = os.environ.get("ESPRESSO", os.path.join(ROOT, "..", "shared", "anchors", "espresso", "profiles"))
BIN = os.environ.get("BIN") or next(
    (p for p in (os.path.join(ROOT, "target/ci/motley"), os.path.join(ROOT, "target/release/motley")) if os.path.exists(p)),
    os.path.join(ROOT, "target/ci/motley"))

H, HEADS, FFN, VOCAB, SEQ, MB, M = 2048, 16, 5504, 32000, 2000, 8, 4
# (run name, directory under DATA, GPU of each pipeline rank, transformer layers)
RUNS = [
    ("3xA10G", "real_data/motivation1_3A10G", ["A10G", "A10G", "A10G"], 24),
    ("2xA10G+T4", "real_data/motivation1_2A10G_1T4_test", ["A10G", "A10G", "T4"], 24),
    ("2xA10G+V100", "real_data/motivation1_2A10G_1V100", ["A10G", "A10G", "V100-16G"], 24),
    ("A10G+V100+2xT4", "real_data/motivation1_A10G_1V100_2T4", ["A10G", "V100-16G", "T4", "T4"], 24),
    ("3xA30", "juchiyunData/motivation1_3A30", ["A30"] * 3, 32),
    ("3xRTX3090", "juchiyunData/motivation1_33090", ["RTX3090"] * 3, 32),
    ("4xA4000", "juchiyunData/motivation1_4A4000", ["A4000"] * 4, 32),
    ("2xA6000", "juchiyunData/motivation1_2A6000", ["A6000"] * 2, 32),
    ("2xA30+A4000", "juchiyunData/motivation1_2A30_A4000", ["A30", "A30", "A4000"], 32),
    ("A30+3xA4000", "juchiyunData/motivation1_A30_3A4000", ["A30", "A4000", "A4000", "A4000"], 32),
    ("A6000+2xA4000", "juchiyunData/motivation1_A6000_2A4000", ["A6000", "A4000", "A4000"], 32),
    ("A6000+A30", "juchiyunData/motivation1_A6000_A30", ["A6000", "A30"], 32),
]
# Calibration stages: (run, stage index). Homogeneous runs: every stage but the last.
CAL = {("3xA10G", 0), ("3xA10G", 1), ("3xA30", 0), ("3xA30", 1), ("3xRTX3090", 0), ("3xRTX3090", 1),
       ("4xA4000", 0), ("4xA4000", 1), ("4xA4000", 2), ("2xA6000", 0), ("2xA10G+T4", 2), ("2xA10G+V100", 2)}
# Dense bf16 TFLOPS, as Motley's catalog (solver/src/hardware.rs) has them.
BF16 = {"A10G": 125.0, "T4": 8.1, "V100-16G": 15.7, "A30": 165.0, "RTX3090": 71.0, "A4000": 76.7, "A6000": 154.8}
AFTER_FLAGS = ["--recompute", "--precision", "bf16", "--p2p-blocking"]


def layer_flops():
    """Motley's forward FLOPs of one layer and of the output head for one micro-batch (model.rs)."""
    matmul = 4 * H * H + 3 * H * FFN
    return MB * (2 * matmul * SEQ + 4 * SEQ * SEQ * H), MB * 2 * SEQ * H * VOCAB


def read_run(path, stages):
    """Per rank: median forward and backward ms per micro-batch (first iteration left out),
    the median send ms on each hop, and the median iteration (OptimizerStep end to end) in ms."""
    ranks = {}
    for f in glob.glob(os.path.join(DATA, path, "*", "operations_record.csv")):
        rows = list(csv.DictReader(open(f)))
        ranks[int(rows[0]["rank"])] = rows
    assert sorted(ranks) == list(range(stages)), (path, sorted(ranks))
    out = []
    for r in range(stages):
        rows = ranks[r]
        first_end = next(float(x["end_time"]) for x in rows if x["task"] == "OptimizerStep")
        steady = [x for x in rows if float(x["start_time"]) > first_end]
        med = lambda task: statistics.median(float(x["duration"]) for x in steady if x["task"] == task) * 1e3
        ends = [float(x["end_time"]) for x in rows if x["task"] == "OptimizerStep"]
        out.append({"fwd": med("ForwardPass"), "bwd": med("BackwardPass"),
                    "send_act": med("SendActivation") if r + 1 < stages else None,
                    "send_grad": med("SendGrad") if r > 0 else None,
                    "iter": statistics.median(b - a for a, b in zip(ends, ends[1:])) * 1e3})
    return out


def layer_ranges(path, layers):
    """DeepSpeed's stage boundaries over its specs (embedding, blocks, norm, head) as Motley's
    half-open layer ranges."""
    d = os.path.basename(glob.glob(os.path.join(DATA, path, "*"))[0])
    # The directory is <rank>_<experiment>_<b0>_..._<bn>_tmp: the boundaries are the trailing
    # numbers from the first 0 (an experiment name may end in digits: motivation1_33090).
    parts = d.removesuffix("_tmp").split("_")
    tail = []
    for p in reversed(parts):
        if not p.isdigit():
            break
        tail.append(int(p))
    tail = list(reversed(tail))
    bounds = tail[tail.index(0):]
    clip = lambda b: min(max(b, 1), layers + 1) - 1
    return [[clip(a), clip(b)] for a, b in zip(bounds, bounds[1:])]


def calibrate(measured, ranges):
    """Per GPU type: forward and backward efficiency at bf16, from the CAL stages only, solving
    Motley's roofline with recompute (F = flops / (P e_f); B = recompute at e_f + 2 x layer flops
    at e_b + 2 x head flops at e_f) on the summed stages of the type."""
    lf, hf = layer_flops()
    acc = {}
    for name, path, gpus, layers in RUNS:
        for i, g in enumerate(gpus):
            if (name, i) not in CAL:
                continue
            n = ranges[name][i][1] - ranges[name][i][0]
            head = i + 1 == len(gpus)
            p = BF16[g] * 1e12
            a = acc.setdefault(g, {"ff": 0.0, "F": 0.0, "B": 0.0, "bf": 0.0, "fixed": 0.0, "src": []})
            a["ff"] += n * lf + head * hf
            a["F"] += measured[name][i]["fwd"] / 1e3
            a["B"] += measured[name][i]["bwd"] / 1e3
            a["bf"] += 2 * n * lf
            a["fixed"] += n * lf + 2 * head * hf  # seconds once divided by P e_f
            a["p"] = p
            a["src"].append(f"{name} stage {i}")
    cal = {}
    for g, a in acc.items():
        ef = a["ff"] / (a["p"] * a["F"])
        eb = a["bf"] / (a["p"] * (a["B"] - a["fixed"] / (a["p"] * ef)))
        cal[g] = (ef, eb, a["src"])
    return cal


def calibration_yaml(cal):
    lines = ["# Per-GPU efficiency at bf16 from Espresso's DeepSpeed traces (bench/espresso_traces.py):",
             "# LLaMA h2048, seq 2000, micro-batch 8, activation checkpointing; calibration stages only.", "gpus:"]
    for g, (ef, eb, src) in sorted(cal.items()):
        lines.append(f"  - {{gpu: {g}, precision: bf16, efficiency: {ef:.3f}, backward_efficiency: {eb:.3f}, "
                     f"source: \"Espresso traces: {', '.join(src)}\"}}")
    return "\n".join(lines) + "\n"


def write(path, text):
    with open(path, "w") as f:
        f.write(text)
    return path


def price(tmp, name, gpus, layers, ranges, bw, flags):
    nodes = "\n".join(f"  - {{name: s{i}, gpu: {g}, gpus: 1}}" for i, g in enumerate(gpus))
    cluster = write(os.path.join(tmp, f"{name}.cluster.yaml"), f"name: {name}\nnodes:\n{nodes}\n")
    model = write(os.path.join(tmp, f"llama-h2048-{layers}l.yaml"),
                  f"name: llama-h2048-{layers}l\nlayers: {layers}\nhidden: {H}\nheads: {HEADS}\nseq_len: {SEQ}\n"
                  f"vocab: {VOCAB}\nffn_hidden: {FFN}\ngated_mlp: true\n")
    stages = [{"layers": r, "gpu": g, "tp": 1, "dp": 1, "gpus": [{"node": f"s{i}", "index": 0}]}
              for i, (r, g) in enumerate(zip(ranges, gpus))]
    plan = write(os.path.join(tmp, f"{name}.plan.json"),
                 json.dumps({"global_batch": MB * M, "micro_batch": MB, "replicas": [{"micro_batches": M, "stages": stages}]}))
    args = [BIN, "replan", "--current", plan, "--cluster", cluster, "--model", model, "-o", "json"] + flags
    if bw is not None:
        pairs = "\n".join(f"  - {{a: s{i}, b: s{i + 1}, gb_per_s: {x:.4f}}}" for i, x in enumerate(bw))
        args += ["--bandwidth", write(os.path.join(tmp, f"{name}.bw.yaml"), f"pairs:\n{pairs}\n")]
    out = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(args)}\n{out.stderr}")
    rep = json.loads(out.stdout)
    st = rep["current_plan"]["replicas"][0]["stages"]
    return [(s["fwd_s"] * 1e3, s["bwd_s"] * 1e3) for s in st], rep["current_now_s"] * 1e3


def err(p, m):
    return (p - m) / m


def main():
    measured, ranges = {}, {}
    for name, path, gpus, layers in RUNS:
        measured[name] = read_run(path, len(gpus))
        ranges[name] = layer_ranges(path, layers)
    cal = calibrate(measured, ranges)
    text = calibration_yaml(cal)
    if "--write-calibration" in sys.argv:
        write(sys.argv[sys.argv.index("--write-calibration") + 1], text)
    act_bytes = MB * SEQ * H * 2
    rows, it_rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        calfile = write(os.path.join(tmp, "calibration.yaml"), text)
        for name, path, gpus, layers in RUNS:
            m = measured[name]
            # Each hop's rate: activations one way, gradients the other. DeepSpeed's sends are
            # synchronous, so a send also waits for its receiver to post the receive: the faster
            # direction's median is the transfer itself.
            bw = [act_bytes / (min(m[i]["send_act"], m[i + 1]["send_grad"]) / 1e3) / 1e9 for i in range(len(gpus) - 1)]
            before, it_b = price(tmp, name, gpus, layers, ranges[name], None, [])
            after, it_a = price(tmp, name, gpus, layers, ranges[name], bw, AFTER_FLAGS + ["--calibration", calfile])
            for i, g in enumerate(gpus):
                rows.append((name, i, g, ranges[name][i], (name, i) in CAL, m[i]["fwd"], before[i][0], after[i][0],
                             m[i]["bwd"], before[i][1], after[i][1]))
            it_rows.append((name, "+".join(gpus), any((name, i) in CAL for i in range(len(gpus))), m[0]["iter"], it_b, it_a,
                            "/".join(f"{x:.2f}" for x in bw)))
    print("Calibration (bf16 efficiency, forward / backward, from the `cal` rows only):\n")
    for g, (ef, eb, src) in sorted(cal.items()):
        print(f"- {g}: {ef:.3f} / {eb:.3f} ({', '.join(src)})")
    print()
    print("| run | stage | GPU | layers | set | fwd ms measured | before | err | after | err | bwd ms measured | before | err | after | err |")
    print("|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, i, g, r, c, fm, fb, fa, bm, bb, ba in rows:
        print(f"| {name} | {i} | {g} | {r[0]}-{r[1]}{' +head' if i == len([x for x in rows if x[0] == name]) - 1 else ''} | {'cal' if c else 'val'} "
              f"| {fm:.0f} | {fb:.0f} | {err(fb, fm):+.0%} | {fa:.0f} | {err(fa, fm):+.0%} "
              f"| {bm:.0f} | {bb:.0f} | {err(bb, bm):+.0%} | {ba:.0f} | {err(ba, bm):+.0%} |")
    print()
    print("| run | GPUs | set | hop GB/s (measured sends) | iteration ms measured | before | err | after | err |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|")
    for name, g, c, im, ib, ia, bw in it_rows:
        print(f"| {name} | {g} | {'cal' if c else 'val'} | {bw} | {im:.0f} | {ib:.0f} | {err(ib, im):+.0%} | {ia:.0f} | {err(ia, im):+.0%} |")
    print()

    def summary(label, errs):
        a = [abs(e) for e in errs]
        within = sum(x <= 0.15 for x in a)
        return f"{label}: median |err| {statistics.median(a):.0%}, max {max(a):.0%}, {within}/{len(a)} within 15%"

    for subset, keep in (("validation rows", lambda c: not c), ("all rows", lambda c: True)):
        st = [x for x in rows if keep(x[4])]
        it = [x for x in it_rows if keep(x[2])]
        print(f"**{subset}**\n")
        for which, k in (("before", 0), ("after", 1)):
            print(f"- {which}: " + "; ".join([
                summary("stage fwd", [err((x[6], x[7])[k], x[5]) for x in st]),
                summary("stage bwd", [err((x[9], x[10])[k], x[8]) for x in st]),
                summary("iteration", [err((x[4], x[5])[k], x[3]) for x in it])]))
        print()


if __name__ == "__main__":
    main()
