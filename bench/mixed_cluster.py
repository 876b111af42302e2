#!/usr/bin/env python3
"""Motley's plan beside its baselines' plans on a mixed cluster emulated on one machine, timed end
to end (docs/emulation.md, "The side-by-side benchmark").

Every node of the cluster file is a network namespace running a real motley-agent; each GPU is a
CPU rank the kernel holds to the node's `emulate: {cpu: F}` share of one core. Each
`rdma_domain` is an island (a bridge) of its own; the link between the two islands is shaped to
the nodes' Ethernet rate as the file declares it (`gbps` of their `ethernet` NICs, the slowest),
the links inside an island are left as they are (veths, far faster). Then, through the real
coordinator and agents:

 1. profile: `motley profile run` of the model on one node of every GPU type (tp 1, at every
    count of sequences a GPU of the type may take: the plans' micro-batch over each
    data-parallel degree that divides it), so the agents' profiler measures each emulated
    device at the sizes the plans run;
 2. plan: `motley plan` with those profiles and the links as measured between the islands
    (`--bandwidth`: a TCP transfer across each link before the runs) for Motley and for every
    baseline (`--baseline megatron|whale|fast-only`);
 3. run: each plan pinned (`plan:`) as one job, one after the other on the same cluster, the
    same model, seed, data, global batch and steps; the reference trainer on every rank (fp32,
    gloo over the node's eth0). With `--profiles beside`, every type is profiled again before
    each run after the first and that plan priced from those profiles as given (`motley plan
    --price`).

For each system it reports the plan's predicted iteration seconds, the measured median
iteration seconds (rank 0's `step_s`, after --warmup steps), tokens/s, and the losses, which
must be the same on every plan (the same samples and the same maths: within 1e-4). With
`-o json`, one line per system `{system, predicted_s, measured_s, tokens_per_s, ...}`, then one
`{speedup_vs_best_baseline_measured, speedup_vs_best_baseline_predicted, max_prediction_error,
...}`. Exits 1 when the losses differ or a run fails.

    sudo .venv/bin/python bench/mixed_cluster.py --cluster bench/mixed/lab.yaml \\
        --model bench/mixed/model.yaml -o json

Needs root and iproute2 (namespaces, veths, bridges, tc), cgroup CPU quotas (v1 or v2),
target/ci/motley with motley-coordinator and motley-agent beside it (or MOTLEY_BIN), and the
project's venv (python/run-tests makes it). The shares are of this machine's cores: run it on an
otherwise idle machine. Everything it makes is removed when it ends, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from project_venv import use_project_venv

REPO = Path(__file__).resolve().parent.parent
use_project_venv("mixed_cluster")

import yaml  # noqa: E402

sys.path.insert(0, str(REPO / "python" / "tests"))
sys.path.insert(0, str(REPO / "python"))
os.environ.setdefault("MOTLEY_BIN", str(REPO / "target" / "ci" / "motley"))

import netcluster as nc  # noqa: E402
from netns import Net, cpu_cgroup_root, requirements  # noqa: E402

SYSTEMS = ("motley", "megatron", "whale", "fast-only")
BASELINES = SYSTEMS[1:]
LOSS_TOLERANCE = 1e-4
SEED = 7


def log(*a):
    print(*a, file=sys.stderr, flush=True)


class BenchError(Exception):
    """Bad input or a failed step, said in one line."""


# ---- the cluster file --------------------------------------------------------------------------


def read_cluster(path: Path) -> dict:
    """The cluster file, its node entries expanded (`count`), every one emulated. Node names
    become n0, n1, ... (a namespace's name holds a few characters); `names` maps them back."""
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise BenchError(f"--cluster: cannot read {path}: {e}")
    if not isinstance(doc, dict) or not isinstance(doc.get("nodes"), list) or not doc["nodes"]:
        raise BenchError(f"--cluster: {path} has no `nodes` list")
    nodes, names = [], {}
    for i, entry in enumerate(doc["nodes"]):
        if not isinstance(entry, dict):
            raise BenchError(f"--cluster: nodes[{i}] is not a mapping")
        share = (entry.get("emulate") or {}).get("cpu")
        if not isinstance(share, (int, float)) or share <= 0:
            raise BenchError(f"--cluster: nodes[{i}].emulate.cpu is missing: every node of the bench is emulated; "
                             "give each node entry `emulate: {cpu: FRACTION}` (its GPUs' share of one core each)")
        eth = [n for n in entry.get("nics") or [] if n.get("kind") == "ethernet"]
        if not eth:
            raise BenchError(f"--cluster: nodes[{i}].nics has no ethernet NIC: the link between islands is shaped "
                             "to the nodes' Ethernet rate; declare one, e.g. {name: eth0, kind: ethernet, gbps: 0.1}")
        count = int(entry.get("count", 1))
        for k in range(count):
            short = f"n{len(nodes)}"
            names[short] = f"{entry['name']}-{k}" if count > 1 else entry["name"]
            e = {key: v for key, v in entry.items() if key not in ("name", "count", "nics")}
            # Inside the namespace the node has one interface, eth0: the one NIC it declares.
            e["nics"] = [{"name": "eth0", "kind": "ethernet", "gbps": min(float(n["gbps"]) for n in eth)}]
            nodes.append((short, e))
    domains = sorted({e.get("rdma_domain") or "default" for _, e in nodes})
    if len(domains) > 2:
        raise BenchError(f"--cluster: {len(domains)} rdma_domains ({', '.join(domains)}); the bench joins at most two "
                         "islands by one shaped link: give the nodes at most two rdma_domain values")
    shares = sum(float(e["emulate"]["cpu"]) * int(e.get("gpus", 1)) for _, e in nodes)
    cores = os.cpu_count() or 1
    if shares > 0.8 * cores:
        raise BenchError(f"--cluster: the ranks' shares add up to {shares:.2f} cores, more than 80% of this machine's "
                         f"{cores}; the coordinator and the agents need the rest: lower the emulate.cpu values")
    islands = {letter: [n for n, e in nodes if (e.get("rdma_domain") or "default") == d]
               for letter, d in zip("AB", domains + ["default-empty"] * (2 - len(domains)))}
    across_gbps = min(e["nics"][0]["gbps"] for _, e in nodes)
    return {"name": doc.get("name", path.stem), "gpu_types": doc.get("gpu_types"), "entries": dict(nodes),
            "names": names, "islands": islands, "domains": domains, "across_mbit": across_gbps * 1000,
            "shares": shares}


def cluster_doc(c: dict) -> dict:
    """The expanded cluster as a cluster file for `motley plan`."""
    doc = {"name": c["name"], "nodes": [dict(name=n, **e) for n, e in c["entries"].items()]}
    if c["gpu_types"]:
        doc["gpu_types"] = c["gpu_types"]
    return doc


# ---- the steps ---------------------------------------------------------------------------------


class LinkShares:
    """A CPU cgroup per emulated node at its share, for the link measurements' two ends: a rank
    on an emulated node runs the kernel's network stack (its TCP sends and receives, gloo's
    copies) inside its node's share, so a transfer measured unconfined overstates what its ranks
    can move (docs/emulation.md, "Links measured inside the shares"). The period rule is the
    agent's (5 ms of CPU time in every 5/F ms, `agent/src/ranks/cpu_share.rs`)."""

    def __init__(self, shares: dict):
        self.root, self.v2 = self._find()
        self.dirs = {}
        for node, share in shares.items():
            d = self.root / f"motley-bench-link-{os.getpid()}-{node}"
            d.mkdir(exist_ok=True)
            period = min(1_000_000, max(1_000, round(5_000 / min(share, 1.0))))
            quota = max(1_000, round(share * period))
            if self.v2:
                (d / "cpu.max").write_text(f"{quota} {period}")
            else:
                (d / "cpu.cfs_period_us").write_text(str(period))
                (d / "cpu.cfs_quota_us").write_text(str(quota))
            self.dirs[node] = d

    @staticmethod
    def _find():
        try:
            return cpu_cgroup_root()
        except RuntimeError as e:
            raise BenchError(f"{e} to hold the link measurements to the nodes' shares; --links-unconfined measures "
                             "them outside the shares")

    def procs(self, node: str) -> str:
        return str(self.dirs[node] / "cgroup.procs")

    def close(self):
        for d in self.dirs.values():
            try:
                d.rmdir()
            except OSError:
                pass


# One side of a two-process gloo all-reduce: the ring the ranks' gradient sync runs, on the
# interface the agents give their ranks, each end in its node's share once torch is loaded.
GLOO_SIDE = """
import os, statistics, sys, time, datetime
import torch, torch.distributed as dist
rank, host, port, mb, procs = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
torch.set_num_threads(1)
store = dist.TCPStore(host, port, 2, rank == 0, datetime.timedelta(seconds=60), wait_for_workers=False)
if rank == 0:
    print("ready", store.port, flush=True)
if procs != "-":
    open(procs, "w").write("0")
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
x = torch.ones(int(mb * 1e6 / 4))
dist.all_reduce(x[: len(x) // 8])
times = []
for _ in range(3):
    dist.barrier()
    t0 = time.perf_counter()
    dist.all_reduce(x)
    times.append(time.perf_counter() - t0)
if rank == 0:
    print(x.numel() * 4 / statistics.median(times) / 1e6, flush=True)
dist.destroy_process_group()
"""


def gloo_rate(net: Net, a: str, b: str, mb: float, procs=(None, None), timeout: float = 180.0) -> float:
    """MB/s of a two-rank gloo all-reduce of `mb` MB between nodes `a` and `b` (the median of
    three): the bytes over the time, which is the rate the planner's ring formula, 2(n-1)/n x
    bytes / rate, gives back at n = 2. `procs`: each end's share, as `Net.transfer`'s."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1")

    def argv(node, rank, port, path):
        cmd = [sys.executable, "-c", GLOO_SIDE, str(rank), net.ip[a], str(port), str(mb), path or "-"]
        return net.argv(node, cmd, cgroups=path is not None)

    first = subprocess.Popen(argv(a, 0, 0, procs[0]), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env)
    try:
        ready = first.stdout.readline().split()
        if ready[:1] != ["ready"] or len(ready) != 2:
            raise BenchError(f"gloo link measurement {a}-{b}: {first.stderr.read()[-2000:]}")
        second = subprocess.run(argv(b, 1, int(ready[1]), procs[1]), capture_output=True, text=True, timeout=timeout,
                                env=env)
        out, err = first.communicate(timeout=timeout)
        if first.returncode != 0 or second.returncode != 0:
            raise BenchError(f"gloo link measurement {a}-{b} failed: {err[-2000:]} {second.stderr[-2000:]}")
        return float(out.strip())
    finally:
        if first.poll() is None:
            first.kill()


def measured_links(net: Net, c: dict, shares: LinkShares | None = None, by: str = "gloo") -> dict:
    """`--bandwidth` pairs (GB/s): inside an island and across the shaped link, each the median
    of three two-rank gloo all-reduces (`gloo_rate`: the ring the ranks' gradient sync runs) or,
    `by="tcp"`, of three TCP transfers; each end held to its node's CPU share (`LinkShares`;
    unconfined without), once per pair of distinct shares (nodes of equal shares move bytes
    alike)."""
    share = {n: float(e["emulate"]["cpu"]) for n, e in c["entries"].items()}
    measured: dict = {}

    def rate(a, b):
        across = net.island_of[a] != net.island_of[b]
        key = (across, net.island_of[a], net.island_of[b], share[a], share[b])
        if key not in measured:
            mb = max(0.5, c["across_mbit"] / 8 / 4) if across else 32.0
            procs = (shares.procs(a), shares.procs(b)) if shares else (None, None)
            if by == "gloo":
                measured[key] = gloo_rate(net, a, b, mb, procs) / 1000.0
            else:
                measured[key] = statistics.median(net.transfer(a, b, megabytes=mb, procs=procs)
                                                  for _ in range(3)) / 1000.0
        return measured[key]

    pairs = []
    nodes = list(c["entries"])
    inside: dict = {}
    across = None
    for i, a in enumerate(nodes):
        for b in nodes[i + 1:]:
            gbs = rate(a, b)
            ia, ib = net.island_of[a], net.island_of[b]
            if ia == ib:
                inside[ia] = min(inside.get(ia, gbs), gbs)
            else:
                across = min(across if across is not None else gbs, gbs)
            pairs.append({"a": a, "b": b, "gb_per_s": round(gbs, 6)})
    return {"pairs": pairs, "inside_gb_per_s": inside, "across_gb_per_s": across, "confined": shares is not None,
            "by": by}


def sequences_per_gpu(c: dict, micro_batch: int) -> dict:
    """For each GPU type, every count of sequences a GPU of it may take in a micro-batch: the
    micro-batch over each data-parallel degree that divides it and that the type's GPUs can
    fill. Each is profiled, so no plan is priced from a profile scaled to another size."""
    gpus = {}
    for e in c["entries"].values():
        gpus[e["gpu"]] = gpus.get(e["gpu"], 0) + int(e.get("gpus", 1))
    return {gpu: sorted({micro_batch // d for d in range(1, n + 1) if micro_batch % d == 0}, reverse=True)
            for gpu, n in sorted(gpus.items())}


def profile_all(cluster: nc.NetCluster, c: dict, model: str, micro_batch: int, seq_len: int | None,
                together: bool = False) -> dict:
    """Stored profiles measured by an agent of each GPU type, at every count of sequences a GPU
    of the type may take (`sequences_per_gpu`): a profiles file. `together`: every profile runs
    at once, so each emulated device is measured while the others compute, as the ranks of a
    plan run (docs/emulation.md, "Profiles under load")."""
    wanted = [(gpu, m) for gpu, counts in sequences_per_gpu(c, micro_batch).items() for m in counts]

    def one(gpu: str, m: int) -> dict:
        args = ["profile", "run", "--model", model, "--tp", "1", "--micro-batch", str(m), "--gpu", gpu,
                "--wait", "-o", "json"]
        if seq_len:
            args += ["--seq-len", str(seq_len)]
        t = time.time()
        out = cluster.cli(*args, check=False, timeout=900)
        if out.returncode != 0:
            raise BenchError(f"profiling {gpu} failed ({out.returncode}): {out.stdout} {out.stderr}\n{cluster.logs()}")
        run = json.loads(out.stdout)
        shown = json.loads(cluster.cli("profile", "show", str(run["profile"]), "-o", "json").stdout)
        log(f"profiled {gpu} at {m} sequences in {time.time() - t:.0f} s (profile {run['profile']})")
        return shown["entry"]

    if not together:
        return {"profiles": [one(gpu, m) for gpu, m in wanted]}
    with concurrent.futures.ThreadPoolExecutor(len(wanted)) as pool:
        futures = [pool.submit(one, gpu, m) for gpu, m in wanted]
        return {"profiles": [f.result() for f in futures]}


def plan(tmp: Path, system: str, args, seq_len: int | None) -> dict:
    argv = [os.environ["MOTLEY_BIN"], "plan", "--cluster", str(tmp / "cluster.yaml"), "--model", args.model,
            "--global-batch", str(args.global_batch), "--micro-batch", str(args.micro_batch), "--tp", "1",
            "--profiles", str(tmp / "profiles.yaml"), "--bandwidth", str(tmp / "bandwidth.yaml"),
            "--precision", "fp32", "--eager", "-o", "json"]
    if seq_len:
        argv += ["--seq-len", str(seq_len)]
    if system != "motley":
        argv += ["--baseline", system]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise BenchError(f"motley plan ({system}) failed: {out.stderr.strip()}")
    return json.loads(out.stdout)


def price(tmp: Path, system: str, args, profiles: Path) -> dict:
    """`system`'s plan (plan-SYSTEM.json) priced as given from `profiles` and the measured
    links (`motley plan --price`): the same GPUs, stages and shares, a prediction from the
    devices as they measure now."""
    argv = [os.environ["MOTLEY_BIN"], "plan", "--cluster", str(tmp / "cluster.yaml"), "--model", args.model,
            "--price", str(tmp / f"plan-{system}.json"), "--profiles", str(profiles),
            "--bandwidth", str(tmp / "bandwidth.yaml"), "-o", "json"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise BenchError(f"motley plan --price ({system}) failed: {out.stderr.strip()}")
    return json.loads(out.stdout)


def steal_s() -> float:
    """Seconds of CPU time the hypervisor has taken from this machine since boot (/proc/stat's
    `steal`, all CPUs): what a run's share of it says about the host beside the bench."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def shape(doc: dict) -> str:
    """A plan in a few words: each replica's stages as GPU type x count [layers]."""
    out = []
    for r in doc["replicas"]:
        stages = [f"{s['gpu']}x{len(s['gpus'])}[{s['layers'][0]}-{s['layers'][1]}]" for s in r["stages"]]
        out.append(f"{r.get('samples', '?')}:" + "|".join(stages))
    return " ; ".join(out)


def run_plan(cluster: nc.NetCluster, tmp: Path, system: str, doc: dict, args, priced: dict | None = None) -> dict:
    """Run `doc` pinned as one job; `priced`, the same plan priced from profiles retaken just
    before (`price`), gives the prediction when there is one."""
    priced = priced or doc
    model = yaml.safe_load(Path(args.model).read_text()) if Path(args.model).is_file() else args.model
    job = nc.train_job(f"mixed-{system}", model, args.global_batch, args.steps, SEED, args.steps, tmp / "cloud",
                       plan=doc, replan="off", profiling={"mode": "off"})
    job.pop("checkpoint")
    job["run"] += " --dtype fp32"
    if args.timings:
        job["run"] += f" --timings {shlex.quote(str(tmp.resolve() / f'timings-{system}-{{rank}}.jsonl'))}"
    t0, steal0 = time.time(), steal_s()
    jid = cluster.submit(job)
    state = cluster.wait_done(jid, args.timeout)
    if state["state"] != "succeeded":
        events = [(e["kind"], e.get("message", "")[:200]) for e in cluster.events(jid)]
        raise BenchError(f"{system}: job {jid} ended {state['state']}: {events}\n{cluster.logs()}")
    lines = nc.rank0_lines(cluster.tmp, jid, state["generation"])
    steps = [d for d in lines if "step_s" in d]
    losses = [d["loss"] for d in lines if "loss" in d]
    if len(steps) <= args.warmup:
        raise BenchError(f"{system}: rank 0 printed {len(steps)} steps, no more than --warmup {args.warmup}")
    measured = statistics.median(d["step_s"] for d in steps[args.warmup:])
    seq = doc["seq_len"]
    return {"system": system, "predicted_s": round(priced["iteration_time_s"], 4), "measured_s": round(measured, 4),
            "tokens_per_s": round(args.global_batch * seq / measured, 1),
            "predicted_tokens_per_s": round(priced["tokens_per_s"], 1),
            "predicted_at_plan_s": round(doc["iteration_time_s"], 4), "plan": shape(doc),
            "losses": losses, "wall_s": round(time.time() - t0, 1), "steal_s": round(steal_s() - steal0, 2),
            **({"terms": step_terms(tmp, system, priced, args.warmup)} if args.timings else {})}


# What a step's timings line splits a step into (motley_torch/trainer.py, `_write_timings`).
PHASES = ("step", "pipeline", "finish", "grad_sync", "vote", "optimizer", "loss_sync")


def predicted_terms(rep: dict) -> dict:
    """A replica's predicted iteration as the trainer's timings split a step: the pipeline (its
    forward and backward passes and hops: what neither the sync nor the optimizer takes), the
    gradient sync the backward passes do not hide, the optimizer step."""
    t, sync, opt = rep.get("iteration_time_s"), rep.get("sync_s"), rep.get("optimizer_s")
    pipeline = t - sync - opt if None not in (t, sync, opt) else None
    return {"iteration_s": t, "pipeline_s": pipeline, "sync_s": sync, "optimizer_s": opt}


def step_terms(tmp: Path, system: str, doc: dict, warmup: int) -> list:
    """For each replica of the plan: the planner's terms (`iteration_time_s`, `sync_s`,
    `optimizer_s`) beside the median of each phase of its ranks' measured steps (`--timings`,
    steps after the warm-up), the slowest rank of the replica for each phase: where a
    prediction and a measurement part, this says which term."""
    by_replica: dict = {}
    for path in sorted(tmp.glob(f"timings-{system}-*.jsonl")):
        recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        recs = [r for r in recs if r["step"] >= warmup]
        if not recs:
            continue
        r0 = recs[0]
        phases = {f"{ph}_ms": round(statistics.median(r[f"{ph}_ms"] for r in recs), 2) for ph in PHASES}
        cpu = {f"{ph}_cpu_ms": round(statistics.median(r[f"{ph}_cpu_ms"] for r in recs), 2)
               for ph in PHASES if f"{ph}_cpu_ms" in r0}
        by_replica.setdefault(r0["replica"], []).append({"rank": r0["rank"], "stage": r0["stage"], **phases, **cpu})
    out = []
    for i, rep in enumerate(doc["replicas"]):
        ranks = by_replica.get(i, [])
        out.append({"replica": i, "samples": rep.get("samples"),
                    "predicted": predicted_terms(rep),
                    "measured_slowest_rank": {k: max(r[k] for r in ranks) for k in ranks[0] if k.endswith("_ms")}
                    if ranks else {},
                    "ranks": ranks})
    return out


def summary(rows: list) -> dict:
    mine = next(r for r in rows if r["system"] == "motley")
    base = [r for r in rows if r["system"] != "motley"]
    out = {"max_prediction_error": round(max(abs(r["measured_s"] / r["predicted_s"] - 1) for r in rows), 4)}
    if base:
        best_measured = max(base, key=lambda r: r["tokens_per_s"])
        best_predicted = min(base, key=lambda r: r["predicted_s"])
        out["speedup_vs_best_baseline_measured"] = round(mine["tokens_per_s"] / best_measured["tokens_per_s"], 3)
        out["speedup_vs_best_baseline_predicted"] = round(best_predicted["predicted_s"] / mine["predicted_s"], 3)
        out["best_baseline_measured"] = best_measured["system"]
    out["order_measured"] = [r["system"] for r in sorted(rows, key=lambda r: r["measured_s"])]
    out["order_predicted"] = [r["system"] for r in sorted(rows, key=lambda r: r["predicted_s"])]
    steps = min(len(r["losses"]) for r in rows)
    out["loss_max_diff"] = max((abs(r["losses"][i] - mine["losses"][i]) for r in rows for i in range(steps)),
                               default=None)
    out["loss_steps_compared"] = steps
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cluster", required=True, type=Path, help="cluster file; every node with emulate: {cpu: F}")
    p.add_argument("--model", required=True, help="model file (YAML) or a Hugging Face model directory")
    p.add_argument("--global-batch", type=int, default=16, help="sequences per iteration (default 16)")
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch, every plan (default 2)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's)")
    p.add_argument("--steps", type=int, default=30, help="training steps of each run (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of the median (default 5)")
    p.add_argument("--only", default=",".join(SYSTEMS), help=f"which systems, comma-separated: {', '.join(SYSTEMS)}")
    p.add_argument("--timeout", type=float, default=1200, help="seconds one run may take (default 1200)")
    p.add_argument("--keep", metavar="DIR", help="keep the runs' files (logs, plans, profiles) here")
    p.add_argument("--timings", action="store_true",
                   help="every rank writes its steps' timings (the trainer's --timings); each system's row then "
                        "carries `terms`: per replica, the plan's sync and optimizer terms beside the measured phases")
    p.add_argument("--links-unconfined", action="store_true",
                   help="measure the links with both ends outside the nodes' CPU shares (by default each end is held "
                        "to its node's share, as its ranks' network stack is)")
    p.add_argument("--links-by", choices=("gloo", "tcp"), default="gloo",
                   help="measure each link by a two-rank gloo all-reduce (the ring the ranks' gradient sync runs; the "
                        "default) or by a TCP transfer")
    p.add_argument("--profiles-apart", action="store_true",
                   help="profile the GPU types one after another on an otherwise idle machine (by default every "
                        "profile runs at once: each emulated device measured while the others compute, as a plan's "
                        "ranks run)")
    p.add_argument("--profiles", choices=("once", "beside"), default="once",
                   help="once (the default): every prediction from the profiles the plans were made from; beside: "
                        "before each system's run after the first, profile every GPU type again and price that "
                        "system's plan from those profiles (`motley plan --price`; `predicted_at_plan_s` keeps the "
                        "first price). On a 2-vCPU host the first profiles predicted better (docs/emulation.md)")
    p.add_argument("-o", "--output", choices=("table", "json"), default="table")
    args = p.parse_args()
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    bad = [s for s in only if s not in SYSTEMS]
    if bad or "motley" not in only:
        raise SystemExit(f"mixed_cluster: --only: {bad or 'motley missing'}; name systems of {', '.join(SYSTEMS)}, "
                         "motley among them")
    if args.warmup >= args.steps:
        raise SystemExit(f"mixed_cluster: --warmup {args.warmup} leaves none of --steps {args.steps} to measure")
    why = requirements()
    if why:
        raise SystemExit(f"mixed_cluster: {why}")
    # The profiler the agents start imports motley_torch from here.
    os.environ["PYTHONPATH"] = str(REPO / "python")
    try:
        c = read_cluster(args.cluster)
    except BenchError as e:
        raise SystemExit(f"mixed_cluster: {e}")
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="motley-mixed-"))
    root.mkdir(parents=True, exist_ok=True)
    model = args.model
    if Path(model).is_file():
        model = str(Path(model).resolve())
    args.model = model
    seq_len = args.seq_len
    log(f"mixed_cluster: {len(c['entries'])} emulated nodes ({', '.join(f'{k}={v}' for k, v in c['names'].items())}), "
        f"islands {c['islands']}, {c['shares']:.2f} cores of shares, the link between islands at "
        f"{c['across_mbit']:g} Mbit/s; files in {root}")
    (root / "cluster.yaml").write_text(yaml.safe_dump(cluster_doc(c)))
    net = Net(c["islands"], link_mbit=c["across_mbit"] if all(c["islands"].values()) else None)
    cluster = None
    rows = []
    try:
        cluster = nc.NetCluster(root, net, c["entries"], gpu_types=c["gpu_types"],
                                agent_args=["--probe-duty", "0", "--python", sys.executable])
        cluster.wait_live()
        link_shares = None if args.links_unconfined else LinkShares(
            {n: float(e["emulate"]["cpu"]) for n, e in c["entries"].items()})
        try:
            links = measured_links(net, c, link_shares, by=args.links_by)
        finally:
            if link_shares is not None:
                link_shares.close()
        (root / "bandwidth.yaml").write_text(yaml.safe_dump({"pairs": links["pairs"]}))
        log(f"links (by {links['by']}, {'inside the shares' if links['confined'] else 'unconfined'}): inside "
            f"{links['inside_gb_per_s']} GB/s (the slowest pair), across {links['across_gb_per_s']} GB/s")
        def profiles(path: Path) -> Path:
            path.write_text(yaml.safe_dump(profile_all(cluster, c, model, args.micro_batch, seq_len,
                                                       together=not args.profiles_apart)))
            return path

        profiles(root / "profiles.yaml")
        plans = {s: plan(root, s, args, seq_len) for s in only}
        for s, doc in plans.items():
            (root / f"plan-{s}.json").write_text(json.dumps(doc, indent=1))
            log(f"{s}: predicted {doc['iteration_time_s']:.3f} s/iteration: {shape(doc)}")
        for i, s in enumerate(only):
            priced = None
            if args.profiles == "beside" and i > 0:
                # The host's speed drifts over the minutes between the first profiles and this
                # run (docs/emulation.md, "Profiles beside each run"): measure the devices again.
                priced = price(root, s, args, profiles(root / f"profiles-{s}.yaml"))
                (root / f"priced-{s}.json").write_text(json.dumps(priced, indent=1))
                log(f"{s}: priced {priced['iteration_time_s']:.3f} s/iteration from profiles retaken now "
                    f"({plans[s]['iteration_time_s']:.3f} from the first)")
            row = run_plan(cluster, root, s, plans[s], args, priced)
            log(f"{s}: measured {row['measured_s']} s/iteration (predicted {row['predicted_s']}), {row['wall_s']} s, "
                f"{row['steal_s']} s of CPU stolen by the host")
            for t in row.get("terms", []):
                log(f"  replica {t['replica']}: predicted {t['predicted']}, measured (slowest rank, ms) "
                    f"{t['measured_slowest_rank']}")
            rows.append(row)
    except BenchError as e:
        raise SystemExit(f"mixed_cluster: {e}")
    finally:
        if cluster is not None:
            cluster.close()
        net.close()
    s = summary(rows)
    s["command"] = " ".join(shlex.quote(a) for a in [sys.argv[0], *sys.argv[1:]])
    s["machine"] = {"nproc": os.cpu_count(), "uname": os.uname().release}
    s["across_mbit"] = c["across_mbit"]
    s["inside_gb_per_s"] = links["inside_gb_per_s"]
    s["links_confined"] = links["confined"]
    s["links_by"] = links["by"]
    s["profiles"] = args.profiles
    if args.output == "json":
        for r in rows:
            print(json.dumps({k: v for k, v in r.items() if k != "losses"} | {"final_loss": r["losses"][-1]}))
        print(json.dumps(s))
    else:
        print(f"{'system':<10} {'predicted s':>11} {'measured s':>10} {'error':>7} {'tokens/s':>9}  plan")
        for r in rows:
            err = r["measured_s"] / r["predicted_s"] - 1
            print(f"{r['system']:<10} {r['predicted_s']:>11.3f} {r['measured_s']:>10.3f} {100 * err:>+6.1f}% "
                  f"{r['tokens_per_s']:>9.1f}  {r['plan']}")
        print(json.dumps(s))
    log(f"reproduce: {s['command']}")
    if s["loss_max_diff"] is not None and s["loss_max_diff"] > LOSS_TOLERANCE:
        log(f"mixed_cluster: the plans' losses differ by {s['loss_max_diff']:.3g} (> {LOSS_TOLERANCE})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
