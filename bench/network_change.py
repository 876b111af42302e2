#!/usr/bin/env python3
"""Networks that change, through the real system (docs/network.md, "Tests and the benchmark").

Four nodes in network namespaces on two islands joined by one veth link, every link shaped with
htb to 50 Mbit/s and declared so (python/tests/netns.py, netcluster.py: the setting the tests
use); a real coordinator and one real motley-agent per node, each agent and its ranks in its
node's namespace, the reference trainer on every rank (CPU, gloo). One job, run three ways one
after the other on fresh namespaces:

  adaptive  the inter-island link drops 10x (50 -> 5 Mbit/s) when rank 0 reaches --drop-at of
            the steps; the job re-plans (`replan: {threshold: 0.3, hold: HOLD, cooldown: 10m}`)
  static    the same drop; `replan: off`
  oracle    the link is at 5 Mbit/s from the start, and the job runs the plan the planner makes
            for that network (`motley plan --bandwidth` with the slow link measured, submitted
            as the job's `plan:`)

Each reports the time from submission to `succeeded` (the coordinator's events), its plans
and generations, and rank 0's step times before and after the drop. The agents probe with
`--probe-duty 0.1` (--probe-duty; the agent's default is 0.01) in all three. Then the probes'
cost: the same job with no drop and `replan: off`, the agents probing at that duty and not
(`--probe-duty 0`), median step time side by side.

    bench/network_change.py                    # everything, a table (about 12 minutes here)
    bench/network_change.py --steps 400 --only adaptive,static -o json

Needs root and iproute2 (namespaces, veths, bridges, tc), target/ci/motley with
motley-coordinator and motley-agent beside it (or MOTLEY_BIN), and the project's venv
(~/.cache/motley/venv: torch; python/run-tests makes it). Everything it makes is removed when it
ends, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from project_venv import use_project_venv

REPO = Path(__file__).resolve().parent.parent
use_project_venv("network_change")

import yaml  # noqa: E402

sys.path.insert(0, str(REPO / "python" / "tests"))
sys.path.insert(0, str(REPO / "python"))
os.environ.setdefault("MOTLEY_BIN", str(REPO / "target" / "ci" / "motley"))

import netcluster as nc  # noqa: E402
from netns import Net, requirements  # noqa: E402

SEED = 5


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def event_at(events: list, kind: str, first: bool = True):
    hits = [e for e in events if e["kind"] == kind]
    if not hits:
        return None
    return (hits[0] if first else hits[-1])["at_ms"]


def step_times(lines: list) -> list:
    return [(d["step"], d["step_s"]) for d in lines if "step_s" in d]


def median(xs):
    return round(statistics.median(xs), 4) if xs else None


def oracle_plan(tmp: Path) -> dict:
    """The planner's plan for the islands with the inter-island link measured at DROP_MBIT."""
    cluster, model, bw = tmp / "islands.yaml", tmp / "model.yaml", tmp / "slow.yaml"
    cluster.write_text(yaml.safe_dump(nc.cluster_file()))
    model.write_text(yaml.safe_dump(nc.model()))
    bw.write_text(yaml.safe_dump(nc.bandwidth_file(nc.RATE_MBIT, nc.DROP_MBIT)))
    out = subprocess.run([os.environ["MOTLEY_BIN"], "plan", "--cluster", str(cluster), "--model", str(model),
                          "--global-batch", str(nc.GLOBAL_BATCH), "--bandwidth", str(bw), "-o", "json"],
                         capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise SystemExit(f"motley plan failed: {out.stderr}")
    return json.loads(out.stdout)


def run_one(mode: str, args, root: Path) -> dict:
    """One job on fresh islands; what it took."""
    tmp = root / mode
    tmp.mkdir(parents=True)
    link = nc.DROP_MBIT if mode == "oracle" else nc.RATE_MBIT
    agent_args = ["--probe-duty", "0" if mode == "probes-off" else str(args.probe_duty)]
    net = Net(nc.ISLANDS, node_mbit=nc.RATE_MBIT, link_mbit=link)
    c = None
    try:
        c = nc.NetCluster(tmp, net, nc.entries(), gpu_types=nc.gpu_types(), agent_args=agent_args)
        c.wait_live()
        extra = {"steps": args.steps, "max_preemptions": 2, "profiling": {"mode": "off"}}
        if mode == "static":
            extra["replan"] = "off"
        elif mode in ("adaptive", "oracle"):
            extra["replan"] = {"threshold": 0.3, "hold": args.hold, "cooldown": "10m"}
        else:
            extra["replan"] = "off"
        if mode == "oracle":
            extra["plan"] = oracle_plan(tmp)
        job = nc.train_job(f"net-{mode}", nc.model(), nc.GLOBAL_BATCH, args.steps, SEED, args.every,
                           tmp / "cloud", **extra)
        t0 = time.time()
        jid = c.submit(job)
        first_plan = None
        dropped_at = None
        drop_step = int(args.steps * args.drop_at)
        while True:
            state = c.job(jid)
            if first_plan is None and state["state"] == "running":
                first_plan = c.plan(jid)
            if state["state"] in ("succeeded", "failed", "cancelled"):
                break
            if mode in ("adaptive", "static") and dropped_at is None and state["generation"] == 1:
                done = nc.rank0_lines(tmp, jid, 1)
                if any(d.get("step", -1) >= drop_step for d in done):
                    net.shape_link(nc.DROP_MBIT)
                    dropped_at = time.time()
                    log(f"{mode}: dropped the inter-island link to {nc.DROP_MBIT} Mbit/s at step {drop_step}")
            if time.time() - t0 > args.timeout:
                raise SystemExit(f"{mode}: job {jid} did not finish within {args.timeout} s\n{c.logs()}")
            time.sleep(0.2)
        events = c.events(jid)
        if state["state"] != "succeeded":
            raise SystemExit(f"{mode}: job {jid} ended {state['state']}\n{[e['kind'] for e in events]}\n{c.logs()}")
        total = (event_at(events, "succeeded", first=False) - event_at(events, "submitted")) / 1000
        gens = {}
        for g in range(1, state["generation"] + 1):
            st = step_times(nc.rank0_lines(tmp, jid, g))
            gens[g] = st
        before, after = [], []
        for g, st in gens.items():
            for s, t in st:
                (before if (mode in ("adaptive", "static") and s < drop_step) else after).append(t)
        considered = [json.loads(e["message"]) for e in events if e["kind"] == "replan_considered"]
        out = {
            "mode": mode,
            "total_s": round(total, 1),
            "wall_s": round(time.time() - t0, 1),
            "generations": state["generation"],
            "plan_first": sorted(nc.plan_nodes(first_plan)) if first_plan else None,
            "plan_last": sorted(nc.plan_nodes(c.plan(jid))),
            "step_s_before_drop": median(before[3:]) if mode in ("adaptive", "static") else None,
            "step_s_after_drop": median(after[3:]),
            "switches": sum(1 for x in considered if x.get("decision") == "switch"),
            "network_changed": sum(1 for e in events if e["kind"] == "network_changed"),
        }
        if mode in ("adaptive", "static") and dropped_at is not None:
            rec = event_at(events, "recovering")
            out["drop_to_recovering_s"] = round(rec / 1000 - dropped_at, 1) if rec else None
        log(f"{mode}: {out}")
        return out
    finally:
        if c is not None:
            c.close()
        net.close()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=1000, help="training steps of the job (default 1000)")
    p.add_argument("--every", type=int, default=20, help="checkpoint every N steps (default 20)")
    p.add_argument("--drop-at", type=float, default=0.2, help="the drop, as the fraction of the steps done (0.2)")
    p.add_argument("--hold", default="5s", help="replan.hold (default 5s)")
    p.add_argument("--probe-duty", type=float, default=0.1,
                   help="the agents' --probe-duty in every run but probes-off (default 0.1; the agent's own is 0.01)")
    p.add_argument("--probe-steps", type=int, default=400, help="steps of each probe-cost run (default 400)")
    p.add_argument("--only", default="adaptive,static,oracle,probes",
                   help="which runs, comma-separated: adaptive, static, oracle, probes")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one run may take")
    p.add_argument("--keep", metavar="DIR", help="keep the runs' files (logs, work directories) here")
    p.add_argument("-o", "--output", choices=("table", "json"), default="table")
    args = p.parse_args()
    why = requirements()
    if why:
        raise SystemExit(f"network_change: {why}")
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="motley-netbench-"))
    root.mkdir(parents=True, exist_ok=True)
    only = [x.strip() for x in args.only.split(",") if x.strip()]
    results = {}
    for mode in ("adaptive", "static", "oracle"):
        if mode in only:
            results[mode] = run_one(mode, args, root)
    if "probes" in only:
        probe_args = argparse.Namespace(**vars(args))
        probe_args.steps = args.probe_steps
        for mode in ("probes-on", "probes-off"):
            results[mode] = run_one(mode, probe_args, root)
    summary = {}
    a, s, o = (results.get(k, {}).get("total_s") for k in ("adaptive", "static", "oracle"))
    if a and o:
        summary["adaptive_over_oracle"] = round(a / o, 3)
    if a and s:
        summary["static_over_adaptive"] = round(s / a, 3)
    on, off = (results.get(k, {}).get("step_s_after_drop") for k in ("probes-on", "probes-off"))
    if on and off:
        summary["probe_step_cost"] = round(on / off - 1, 4)
    doc = {"machine": {"nproc": os.cpu_count(), "uname": os.uname().release},
           "settings": {"steps": args.steps, "every": args.every, "drop_at": args.drop_at, "hold": args.hold,
                        "probe_duty": args.probe_duty, "probe_steps": args.probe_steps,
                        "rate_mbit": nc.RATE_MBIT, "drop_mbit": nc.DROP_MBIT, "global_batch": nc.GLOBAL_BATCH,
                        "model": nc.model()},
           "runs": results, "summary": summary}
    if args.output == "json":
        print(json.dumps(doc, indent=1))
        return
    print(f"{'run':<11} {'total s':>8} {'gens':>4} {'plan first':<16} {'plan last':<16} {'step s before':>13} {'step s after':>12} {'switches':>8}")
    for k, r in results.items():
        print(f"{k:<11} {r['total_s']:>8} {r['generations']:>4} {','.join(r['plan_first'] or []):<16} "
              f"{','.join(r['plan_last']):<16} {str(r['step_s_before_drop']):>13} {str(r['step_s_after_drop']):>12} "
              f"{r['switches']:>8}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
