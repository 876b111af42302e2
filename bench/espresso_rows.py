#!/usr/bin/env python3
"""Espresso's four paper models (and its README job), side by side in one go:

1. under Espresso's own estimator: Espresso's search (replayed in Rust, with the CPU seconds
   its Python code took here recorded in ../shared/anchors/espresso/RESULTS.md), Motley's
   exact search, and the exhaustive oracle over the same space;
2. under Motley's cost model (`motley provision` on examples/espresso-offers.yaml): the
   cheapest allocation for an SLO, the best homogeneous one (Sia-style), Espresso-style
   placement on the same GPUs, all with the opt-in superset bound, and (at the loose SLO) the
   default exact allocation search.

Whole-process CPU time (user + sys of the child, from getrusage) is the median of REPEAT runs
(default 3; the oracles and the exact allocation search run once). Prints Markdown for
BENCHMARKS.md. Run after `cargo build --release -p motley -p motley-baselines`.
"""
import json, os, resource, statistics, subprocess, sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
BIN = os.environ.get("BIN", os.path.join(ROOT, "target/release/motley"))
# Espresso's own files are read by the research tools' binary (baselines/).
BASELINES = os.environ.get("BASELINES", os.path.join(ROOT, "target/release/motley-baselines"))
E = "examples/espresso"
GPUS = f"{E}/gpu/espresso_gpu_config.json"
REPEAT = int(os.environ.get("REPEAT", "3"))

# Espresso's own search as published, run here (RESULTS.md): $ per iteration and CPU seconds.
RECORDED = {"llama_1.3b": (0.0229, 74), "llama_3b": (0.1490, 119), "llama_7b": (0.5610, 68), "ViT": (0.0088, 217),
            "open_llama_3b_v2": (0.2218, None)}
# RESULTS.md's "optimum" (every allocation in Espresso's pipeline-depth range, its placer).
RESULTS_OPTIMUM = {"llama_1.3b": 0.0229, "llama_3b": 0.1299, "llama_7b": 0.5610, "ViT": None, "open_llama_3b_v2": 0.20195}


def run(args, repeat=REPEAT, may_fail=False):
    cpu, out = [], None
    for _ in range(repeat):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        exe = BASELINES if args[0] == "espresso" else BIN
        p = subprocess.run([exe] + args + ["-o", "json"], cwd=ROOT, capture_output=True, text=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if p.returncode != 0:
            if may_fail:
                return p.stderr.strip(), None
            sys.exit(f"{os.path.basename(exe)} {' '.join(args)} failed: {p.stderr}")
        cpu.append((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime))
        out = json.loads(p.stdout)
    return out, statistics.median(cpu)


def job_args(job):
    if job == "open_llama_3b_v2":
        return ["--job", f"{E}/jobs/upstream_examples/open_llama_3b_v2.json", "--gpus", GPUS]
    return ["--job", f"{E}/jobs/this_run/{job}.json", "--model-config", f"{E}/jobs/this_run/{job}.model_config.json", "--gpus", GPUS]


def short(gpu):
    return {"a30-pcie-24gb": "A30", "a6000-pcie4-48gb": "A6000", "a4000-pcie4-16gb": "A4000", "3090-pcie4-24gb": "3090"}.get(gpu, gpu)


def plan_text(d):
    return f"dp{d['dp']} " + ", ".join(f"{short(s['gpu'])}:{s['layers']}" for s in d["stages"])


print("### Under Espresso's own estimator\n")
print("| model | search | plan (stage: layers) | s / iteration | $ / iteration | allocations placed / in space | CPU s |")
print("|---|---|---|---|---|---|---|")
homogeneous_rows = []
for job in ["llama_1.3b", "llama_3b", "llama_7b", "ViT", "open_llama_3b_v2"]:
    base = ["espresso", "search"] + job_args(job)
    rec_cost, rec_cpu = RECORDED[job]
    opt = RESULTS_OPTIMUM[job]
    print(f"| {job} | Espresso (Python, recorded in RESULTS.md) | | | {rec_cost} | | {rec_cpu if rec_cpu else 'n/a'} |")
    if opt:
        print(f"| {job} | RESULTS.md's optimum (Espresso's depth range) | | | {opt} | | |")
    for label, extra, rep in [("Espresso's allocator, replayed in Rust", ["--method", "espresso"], REPEAT),
                              ("**Motley exact**", [], REPEAT),
                              ("Motley, every order and split (`--space full`)", ["--space", "full"], 1),
                              ("oracle: every allocation placed", ["--exhaustive"], 1)]:
        d, cpu = run(base + extra, rep)
        s = d["search"]
        print(f"| {job} | {label} | {plan_text(d)} | {d['iteration_time_s']:.3f} | {d['cost_per_iteration']:.5f} | "
              f"{s['placed']} / {s['allocations']} | {cpu:.3f} |")
        if label == "**Motley exact**" and d.get("homogeneous"):
            h = d["homogeneous"]
            homogeneous_rows.append(f"| {job} | {plan_text(d)} | {d['cost_per_iteration']:.5f} | {plan_text(h)} | {h['cost_per_iteration']:.5f} | "
                                    f"{h['savings_vs_this'] * 100:.1f}% |")

print("\nUnder the same estimator, the cheapest plan on one GPU type only (Sia-style) against the cheapest mix:\n")
print("| model | cheapest plan | $ / iteration | cheapest on one GPU type | $ / iteration | mix saves |")
print("|---|---|---|---|---|---|")
print("\n".join(homogeneous_rows))

print("\n### Under Motley's cost model (`motley provision`, examples/espresso-offers.yaml)\n")
HEADER = ("| model | SLO s | Motley (`--superset-bound`): allocation | s / iter | $ / iter | best homogeneous | $ / iter | saving | Espresso-style on Motley's GPUs $ | planned / allocations | CPU s | default (exact allocation search): $ (CPU s) |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|")
print(HEADER)
def provision_rows(offers, models, batch, slos_of):
    for model, path in models:
        base = ["provision", "--offers", offers, "--model", path, "--global-batch", str(batch)]
        loose, _ = run(base + ["--slo", "100"], 1)
        for slo in slos_of(loose["iteration_time_s"]):
            d, cpu = run(base + ["--slo", str(slo), "--compare", "--superset-bound"], may_fail=True)
            if cpu is None:
                print(f"| {model} | {slo:g} | {d.splitlines()[-1][:160]} | | | | | | | | | |")
                continue
            # The exact allocation search plans thousands of allocations at tight SLOs: run it
            # where it takes minutes at most.
            exact, ecpu = run(base + ["--slo", str(slo)], 1) if slo == 100.0 else (None, None)
            exact_text = f"{exact['cost_per_iteration']:.5f} ({ecpu:.1f})" if exact else "not run"
            alloc = " + ".join(f"{a['gpus']} {a['gpu']}" for a in d["allocation"])
            h = d["compare"]["homogeneous"]
            hs = " + ".join(f"{a['gpus']} {a['gpu']}" for a in h["allocation"]) if h else "none meets the SLO"
            hc = f"{h['cost_per_iteration']:.5f}" if h else "-"
            sav = f"{h['savings_vs_this'] * 100:.1f}%" if h else "-"
            es = d["compare"]["espresso_placement"]
            ec = f"{es['cost_per_iteration']:.5f}" if es else "does not fit"
            s = d["search"]
            print(f"| {model} | {slo:g} | {alloc} | {d['iteration_time_s']:.3f} | {d['cost_per_iteration']:.5f} | {hs} | {hc} | {sav} | {ec} | "
                  f"{s['planned']} / {s['allocations']} | {cpu:.2f} | {exact_text} |")


provision_rows("examples/espresso-offers.yaml", [(m, f"{E}/motley/{m}.yaml") for m in ["llama-1.3b", "llama-3b", "llama-7b", "vit"]], 64,
               lambda t: [100.0, round(t / 1.5, 2), round(t / 2.5, 2)])
print("\n### Under Motley's cost model (`motley provision`, examples/cloud-offers.yaml: H100, A100, L20, RTX 4090)\n")
print(HEADER)
provision_rows("examples/cloud-offers.yaml", [("llama-7b", "llama-7b"), ("llama-13b", "llama-13b")], 128, lambda t: [100.0, round(t / 2, 2), round(t / 4, 2)])
