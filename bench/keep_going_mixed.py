#!/usr/bin/env python3
"""A node lost on an emulated mixed cluster: the survivors' throughput against what the planner
predicts for them (docs/keep-going.md, "Measured"; docs/emulation.md).

bench/mixed_cluster.py's cluster (every node a network namespace with a real motley-agent, each
GPU a CPU rank held to its node's `emulate: {cpu: F}` share, the links measured inside the
shares), the agents' profiles of every GPU type, and Motley's plan made from them, run pinned as
one job that keeps going (the default for two replicas or more). Once --lose-after steps ran,
one node's agent and every rank on it are SIGKILLed (a vanished spot node; by default the node
of the last replica that does not hold rank 0). The coordinator opens the next membership: the
survivors split the same global batch by the coordinator's prices (`membership_changed`'s
`micro_batches`).

On a machine whose ranks share the cores unconfined, losing a rank frees CPU for the others
(bench/keep_going.py's runs cannot show this); here every rank is held to its share, as a GPU
does not speed up when its neighbour dies. Predictions are `motley plan`'s from the agents'
profiles and the measured links: the whole plan as planned, and the survivors with the split
they ran priced as given (`motley plan --price`); measurements are rank 0's step times (medians
after --warmup steps, and after the first two steps of the new epoch):

  predicted_full_s / measured_full_s           the whole plan before the loss
  predicted_degraded_s / measured_degraded_s   the survivors with the membership's split
  degraded_vs_predicted                        predicted_degraded_s / measured_degraded_s (the
                                               goal: 0.9 or more)
  degraded_vs_full_error                       how much further the survivors' measurement is
                                               from its prediction than the whole plan's
  phases                                       each rank's median ms per step phase (--timings),
                                               before the loss and degraded

    sudo .venv/bin/python bench/keep_going_mixed.py --cluster bench/mixed/two-speed.yaml \\
        --model bench/mixed/model.yaml -o json

Needs what bench/mixed_cluster.py needs (root, iproute2, cgroup CPU quotas, target/ci/motley and
the agents beside it, the project's venv); run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from project_venv import use_project_venv

REPO = Path(__file__).resolve().parent.parent
use_project_venv("keep_going_mixed")

import yaml  # noqa: E402

import mixed_cluster as mc  # noqa: E402
import netcluster as nc  # noqa: E402
from netns import Net, requirements  # noqa: E402

log = mc.log


def default_victim(doc: dict) -> str:
    """The node of the last replica with no GPU on rank 0's node (rank 0 keeps leading)."""
    first = doc["replicas"][0]["stages"][0]["gpus"][0]["node"]
    for r in reversed(doc["replicas"][1:]):
        nodes = {g["node"] for s in r["stages"] for g in s["gpus"]}
        if first not in nodes and len(nodes) == 1:
            return nodes.pop()
    raise mc.BenchError(f"no replica lives on one node apart from rank 0's: {mc.shape(doc)}; name one with --lose")


def survivors(doc: dict, split: dict) -> dict:
    """The plan as the members run it: the lost replicas left out, each member's micro-batches
    those of the membership's split (`micro_batches`, keyed by replica index)."""
    out = dict(doc)
    out["replicas"] = [dict(r, micro_batches=split[str(i)], samples=split[str(i)] * doc["micro_batch"])
                       for i, r in enumerate(doc["replicas"]) if str(i) in split]
    # Its rings are the members' (rebuilt per epoch); the pricer derives them from the replicas.
    out.pop("comm_groups", None)
    return out


def phases(root: Path, lost_after: int, first_degraded) -> dict:
    """Each rank's median milliseconds per phase of a step (the trainer's --timings), before the
    loss and from the second degraded step on."""
    keys = ("step_ms", "pipeline_ms", "finish_ms", "grad_sync_ms", "vote_ms", "optimizer_ms", "loss_sync_ms")
    out = {}
    for path in sorted(root.glob("timings-*.jsonl")):
        recs = [json.loads(x) for x in path.read_text().splitlines() if x.startswith("{")]
        if not recs:
            continue
        rank = recs[0]["rank"]
        # A redone step writes its line again: the last one of each step counts.
        by_step = {r["step"]: r for r in recs}
        for name, pick in (("before", lambda s: s < lost_after),
                           ("degraded", lambda s: first_degraded is not None and s > first_degraded + 1)):
            sel = [r for s, r in by_step.items() if pick(s)]
            if sel:
                out.setdefault(f"rank{rank}", {})[name] = {
                    k: round(statistics.median(r[k] for r in sel), 1) for k in keys if k in sel[0]}
    return out


def median_after(steps: list, skip: int):
    xs = [d["step_s"] for d in steps[skip:]]
    return round(statistics.median(xs), 4) if xs else None


def run(cluster: nc.NetCluster, root: Path, doc: dict, args) -> dict:
    model = yaml.safe_load(Path(args.model).read_text()) if Path(args.model).is_file() else args.model
    job = nc.train_job("keep-going-mixed", model, args.global_batch, args.steps, mc.SEED, args.steps, root / "cloud",
                       plan=doc, replan="off", profiling={"mode": "off"})
    job.pop("checkpoint")
    # The coordinator splits the batch among the survivors by its own prices (profiling off:
    # the catalog's, in the job's precision); the bench prices the split it chose.
    job["run"] += f" --dtype fp32 --timings {shlex.quote(str(root.resolve() / 'timings-{rank}.jsonl'))}"
    victim = args.lose or default_victim(doc)
    steal0 = mc.steal_s()
    jid = cluster.submit(job)
    t0, killed = time.monotonic(), None
    while True:
        state = cluster.job(jid)
        lines = [d for d in nc.rank0_lines(cluster.tmp, jid, 1) if "step_s" in d]
        if killed is None and lines and lines[-1]["step"] + 1 >= args.lose_after:
            cluster.lose_node(victim)
            killed = (time.monotonic(), lines[-1]["step"])
            log(f"{victim} ({args.names.get(victim, victim)}) lost after step {killed[1]}")
        if state["state"] in ("succeeded", "failed", "cancelled"):
            break
        if time.monotonic() - t0 > args.timeout:
            raise mc.BenchError(f"the job did not end within {args.timeout} s\n{cluster.logs()}")
        time.sleep(0.2)
    if state["state"] != "succeeded" or killed is None:
        raise mc.BenchError(f"job {jid} ended {state['state']} (node lost: {killed is not None})\n{cluster.logs()}")
    events = cluster.events(jid)
    changed = [json.loads(e["message"]) for e in events if e["kind"] == "membership_changed"]
    if not changed:
        raise mc.BenchError(f"no membership_changed: {[e['kind'] for e in events]}")
    m = changed[0]
    priced = cluster.plan(jid)
    # The survivors as the coordinator split the batch among them, priced as given by the same
    # profiles and links as the whole plan (`motley plan --price`).
    degraded = survivors(doc, m["micro_batches"])
    (root / "plan-degraded.json").write_text(json.dumps(degraded, indent=1))
    deg_priced = mc.price(root, "degraded", args, root / "profiles.yaml")
    lines = [d for d in nc.rank0_lines(cluster.tmp, jid, state["generation"]) if "step_s" in d]
    before = [d for d in lines if d.get("epoch", 0) == 0 and d["step"] < killed[1]]
    after = [d for d in lines if d.get("epoch", 0) == m["epoch"]]
    share = m["throughput_share"]
    full_p, deg_p = doc["iteration_time_s"], deg_priced["iteration_time_s"]
    full_m, deg_m = median_after(before, args.warmup), median_after(after, 2)
    if full_m is None or deg_m is None:
        raise mc.BenchError(f"too few steps: {len(before)} before the loss, {len(after)} after; more --steps")
    row = {
        "plan": mc.shape(doc), "lost": args.names.get(victim, victim), "lost_after_step": killed[1],
        "state": state["state"], "generation": state["generation"], "epochs": [x["epoch"] for x in changed],
        "members": m["replicas"], "split": m["micro_batches"],
        "throughput_share_coordinator": round(share, 4), "coordinator_priced_full_s": round(priced["iteration_time_s"], 4),
        "throughput_share_predicted": round(full_p / deg_p, 4), "throughput_share_measured": round(full_m / deg_m, 4),
        "predicted_full_s": round(full_p, 4), "measured_full_s": full_m,
        "predicted_degraded_s": round(deg_p, 4) if deg_p else None, "measured_degraded_s": deg_m,
        "degraded_vs_predicted": round(deg_p / deg_m, 4) if deg_p else None,
        "full_vs_predicted": round(full_p / full_m, 4),
        "steps_before": len(before), "steps_degraded": len(after),
        # CPU time the hypervisor took from this machine during the job: what says a run was
        # disturbed from outside.
        "steal_s": round(mc.steal_s() - steal0, 2),
        "phases": phases(root, killed[1], after[0]["step"] if after else None),
    }
    row["degraded_vs_full_error"] = round(deg_m / deg_p - full_m / full_p, 4)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cluster", required=True, type=Path, help="cluster file; every node with emulate: {cpu: F}")
    p.add_argument("--model", required=True, help="model file (YAML) or a Hugging Face model directory")
    p.add_argument("--global-batch", type=int, default=16, help="sequences per iteration (default 16)")
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch (default 2)")
    p.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    p.add_argument("--lose-after", type=int, default=16, help="lose the node once this many steps ran (default 16)")
    p.add_argument("--lose", metavar="NODE", help="the node to lose, by the bench's name (n0, n1, ...; default: the "
                                                  "node of the last replica apart from rank 0's)")
    p.add_argument("--warmup", type=int, default=4, help="first steps left out of the median (default 4)")
    p.add_argument("--timeout", type=float, default=1200, help="seconds the job may take (default 1200)")
    p.add_argument("--keep", metavar="DIR", help="keep the run's files (logs, plans, profiles) here")
    p.add_argument("-o", "--output", choices=("table", "json"), default="table")
    args = p.parse_args()
    if not args.warmup < args.lose_after < args.steps - 4:
        raise SystemExit(f"keep_going_mixed: --lose-after {args.lose_after} must leave --warmup {args.warmup} steps "
                         f"before it and 4 or more of --steps {args.steps} after it")
    why = requirements()
    if why:
        raise SystemExit(f"keep_going_mixed: {why}")
    os.environ["PYTHONPATH"] = str(REPO / "python")
    try:
        c = mc.read_cluster(args.cluster)
    except mc.BenchError as e:
        raise SystemExit(f"keep_going_mixed: {e}")
    args.names = c["names"]
    if args.lose and args.lose not in c["entries"]:
        raise SystemExit(f"keep_going_mixed: --lose {args.lose}: the nodes are {', '.join(c['entries'])} "
                         f"({', '.join(f'{k}={v}' for k, v in c['names'].items())})")
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="motley-kg-mixed-"))
    root.mkdir(parents=True, exist_ok=True)
    if Path(args.model).is_file():
        args.model = str(Path(args.model).resolve())
    (root / "cluster.yaml").write_text(yaml.safe_dump(mc.cluster_doc(c)))
    net = Net(c["islands"], link_mbit=c["across_mbit"] if all(c["islands"].values()) else None)
    cluster = None
    try:
        cluster = nc.NetCluster(root, net, c["entries"], gpu_types=c["gpu_types"],
                                agent_args=["--probe-duty", "0", "--python", sys.executable])
        cluster.wait_live()
        shares = mc.LinkShares({n: float(e["emulate"]["cpu"]) for n, e in c["entries"].items()})
        try:
            links = mc.measured_links(net, c, shares)
        finally:
            shares.close()
        (root / "bandwidth.yaml").write_text(yaml.safe_dump({"pairs": links["pairs"]}))
        (root / "profiles.yaml").write_text(yaml.safe_dump(mc.profile_all(cluster, c, args.model, args.micro_batch,
                                                                           None, together=True)))
        doc = mc.plan(root, "motley", args, None)
        (root / "plan-motley.json").write_text(json.dumps(doc, indent=1))
        log(f"motley: predicted {doc['iteration_time_s']:.3f} s/iteration: {mc.shape(doc)}")
        row = run(cluster, root, doc, args)
    except mc.BenchError as e:
        raise SystemExit(f"keep_going_mixed: {e}")
    finally:
        if cluster is not None:
            cluster.close()
        net.close()
    row["command"] = " ".join(shlex.quote(a) for a in [sys.argv[0], *sys.argv[1:]])
    row["machine"] = {"nproc": os.cpu_count(), "uname": os.uname().release}
    if args.output == "json":
        print(json.dumps(row))
    else:
        for k, v in row.items():
            print(f"{k:<28} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
