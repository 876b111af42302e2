#!/usr/bin/env python3
"""A replica lost mid-run, through the real system (docs/keep-going.md): keeping going against
whole-job recovery, side by side in one go.

A coordinator (SQLite, 250 ms base interval) and three motley-agents on loopback; the job of
python/tests/test_keep_going.py (a three-replica plan: a two-stage pipeline on n0, one GPU on n1,
one on n2; the reference trainer on every rank, CPU, gloo), checkpointing every --every steps
into the agents' memory tier and a file:// cloud, run three ways one after the other:

  none         no failure (every step voted in the store, as a job that keeps going runs)
  none-off     no failure, `keep_going: false` (no vote: the vote's cost, beside `none`)
  keep-going   the rank on n1 (replica 1) killed with SIGKILL once --kill-at of the steps ran
               (its agent reports it lost at once): the other replicas keep going
               (`keep_going: true`, the default)
  whole        the same kill with `keep_going: false`: the job recovers whole from its newest
               checkpoint under the next generation (`max_restarts: 1`; the plan is pinned, so
               a recovery needs n1 back: its agent stays, only the rank is killed)

Each reports the time from submission to `succeeded`, the steps run (committed steps, and steps
recomputed after a restore), the time from the kill to the first step committed after the loss
was dealt with (the first progress line of a new membership epoch, or of the next generation;
a job that keeps going prints a step's line as it commits; with `keep_going: false` lines are
printed one step late, an upper bound by a step there), and the median step time
before and after the kill.

    bench/keep_going.py                        # all three, a table (about 2 minutes here)
    bench/keep_going.py --steps 400 --only keep-going,whole -o json
    bench/keep_going.py --kill node --heartbeat-ms 1000 --only keep-going
    bench/keep_going.py --kill node --back-after 5 --only keep-going     # and back to full strength
    bench/keep_going.py --kill node --period 20 --steps 2000 --only none,keep-going

`--back-after S` starts n1's agent again S seconds after the kill: the degraded job's lost
replica rejoins from the members' live state (docs/keep-going.md; `whole`: the job recovers
onto its whole plan), and `back_to_full_s` is the time from the return to the first step at
full strength (the first line of the epoch that took the replica back, or of the next
generation). `--period T` kills n1 every T seconds
(back T/2 later with --kill node) until the job ends, and `steps_per_hour` compares the runs.

`--kill node` kills n1's agent with its rank instead (a vanished node, seen when its lease
lapses: 3 base intervals, `--heartbeat-ms`); a pinned plan recovers whole only onto its own
nodes (the recovery waits for n1: docs/recovery.md), so `whole` takes that kill with
`--back-after` alone.

Needs target/ci/motley with motley-coordinator and motley-agent beside it (or MOTLEY_BIN) and
the project's venv (python/run-tests makes it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from project_venv import use_project_venv

REPO = Path(__file__).resolve().parent.parent
use_project_venv("keep_going")

sys.path.insert(0, str(REPO / "python" / "tests"))
sys.path.insert(0, str(REPO / "python"))
os.environ.setdefault("MOTLEY_BIN", str(REPO / "target" / "ci" / "motley"))

from test_keep_going import NODES, progress, three_node_job  # noqa: E402
from test_recovery import Cluster, kill_ranks  # noqa: E402

SEED = 5


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# Per rank log: the bytes read so far (whole lines only) and the progress lines in them. The
# bench looks every 50 ms; reading each log whole each time grew with the run (thousands of
# lines parsed 20 times a second on a 2-core machine, beside the ranks it measures).
_READ: dict = {}


def lines(work: Path, jid: int) -> list:
    """(generation, rank, line) of every progress line any rank of the job logged."""
    out = []
    for f in work.glob(f"agents/*/jobs/{jid}/*/rank-*.log"):
        gen, rank = int(f.parent.name), int(f.stem.split("-")[1])
        with open(f, "rb") as fh:
            ino = os.fstat(fh.fileno()).st_ino
            # A rank rejoining on its node starts a new log (the old one renamed): read it afresh.
            seen, pos, got = _READ.get(f, (ino, 0, []))
            if seen != ino:
                pos, got = 0, []
            fh.seek(pos)
            new = fh.read()
        whole = new.rfind(b"\n") + 1  # a last line half written is read again next time
        if whole:
            got = got + progress(new[:whole].decode(errors="replace"))
        _READ[f] = (ino, pos + whole, got)
        out.extend((gen, rank, d) for d in got)
    return out


def mark(got: list) -> tuple:
    """Where the job is: its newest generation with a line, and that generation's newest epoch."""
    gen = max((g for g, _, _ in got), default=1)
    return gen, max((d.get("epoch", 0) for g, _, d in got if g == gen), default=0)


def run_one(mode: str, args, root: Path) -> dict:
    tmp = root / mode
    tmp.mkdir(parents=True)
    c = Cluster(tmp, NODES, heartbeat_ms=args.heartbeat_ms)
    try:
        c.wait(lambda: sum(n["live"] for n in c.get("/api/v1/nodes")) == 3, 30)
        extra = {"checkpoint": {"every": args.every, "keep": 2, "cloud": f"file://{tmp / 'cloud'}"},
                 "max_restarts": 100 if args.period else 1, "max_preemptions": 100 if args.period else 1,
                 "keep_going": mode not in ("whole", "none-off")}
        t0 = time.monotonic()
        jid = c.submit(three_node_job(args.steps, SEED, **extra))
        kills = []  # per kill: when, after which step, where the job was, when n1 came back
        n1_up, first_line = True, None
        while True:
            now = time.monotonic()
            got = lines(tmp, jid)
            state = c.get(f"/api/v1/jobs/{jid}")["state"]
            if got and first_line is None:
                first_line = now
            if not mode.startswith("none") and got and n1_up:
                step = max(d["step"] for _, _, d in got)
                if args.period:
                    # A spot node every --period s, back --back-after s later; a kill is held while
                    # the job launches or restores (the cycle measured, not a failure mid-restore).
                    due = (now - (kills[-1]["at"] if kills else first_line) >= args.period
                           and state in ("running", "degraded"))
                else:
                    due = not kills and step + 1 >= args.steps * args.kill_at
                if due:
                    if args.kill == "node":
                        c.kill_node("n1")
                        n1_up = False
                    else:
                        kill_ranks("n1", c.tmp)
                    kills.append({"at": now, "after_step": step, "mark": mark(got), "back": None,
                                  "next_step_s": None, "full_s": None})
                    log(f"{mode}: n1 killed after step {step}")
            if kills and not n1_up and args.back_after is not None and now - kills[-1]["at"] >= args.back_after:
                c.start_agent("n1", dict(NODES)["n1"])
                n1_up = True
                kills[-1]["back"] = (now, mark(got))
                log(f"{mode}: n1's agent back")
            for k in kills:
                if k["next_step_s"] is None and mark(got) > k["mark"]:
                    # The first step committed after the loss was dealt with: under a new epoch,
                    # or by the next generation.
                    k["next_step_s"] = now - k["at"]
                if k["back"] is not None and k["full_s"] is None and mark(got) > k["back"][1]:
                    # Full strength: the first step of the epoch the replica rejoined in, or of a
                    # generation launched after the return (the whole pinned plan again).
                    k["full_s"] = now - k["back"][0]
            if state in ("succeeded", "failed", "cancelled"):
                break
            if now - t0 > args.timeout:
                raise SystemExit(f"{mode}: not done in {args.timeout} s\n{c.logs()}")
            time.sleep(0.05)
        wall = time.monotonic() - t0
        final = c.get(f"/api/v1/jobs/{jid}")
        events = c.events(jid)
        got = lines(tmp, jid)
        # Every step printed once per run of it: a restore prints the recomputed steps again.
        # A new leader's line marked "again" repeats the last committed step's (docs/keep-going.md).
        printed = [d["step"] for _, _, d in got if not d.get("again")]
        kill_step = kills[0]["after_step"] if kills else None
        times_before = [d["step_s"] for _, _, d in got if kill_step is None or d["step"] < kill_step]
        times_after = [d["step_s"] for _, _, d in got if kill_step is not None and d["step"] > kill_step + 2]
        changed = [json.loads(e["message"]) for e in events if e["kind"] == "membership_changed"]
        first = kills[0] if kills else {}
        return {
            "mode": mode, "kill": args.kill, "heartbeat_ms": args.heartbeat_ms, "period_s": args.period,
            "back_after_s": args.back_after, "state": final["state"], "generation": final["generation"],
            "wall_s": round(wall, 2), "steps": args.steps,
            "steps_per_hour": round(args.steps / wall * 3600) if final["state"] == "succeeded" else 0,
            "steps_run": len(printed), "recomputed": len(printed) - len(set(printed)),
            "kills": len(kills), "killed_after_step": kill_step,
            "kill_to_next_step_s": _round(first.get("next_step_s")),
            "back_to_full_s": _round(first.get("full_s")),
            "kill_to_next_step_s_each": [_round(k["next_step_s"]) for k in kills],
            "back_to_full_s_each": [_round(k["full_s"]) for k in kills if k["back"] is not None],
            "median_step_s_before": round(statistics.median(times_before), 4) if times_before else None,
            "median_step_s_after": round(statistics.median(times_after), 4) if times_after else None,
            "epochs": [m["epoch"] for m in changed], "kinds": sorted({e["kind"] for e in events} - {"rank"}),
        }
    finally:
        c.close()


def _round(x):
    return round(x, 3) if x is not None else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=50, help="checkpoint every N steps")
    ap.add_argument("--kill-at", type=float, default=0.4, help="kill n1 once this share of the steps ran")
    ap.add_argument("--only", default="none-off,none,keep-going,whole")
    ap.add_argument("--kill", choices=["rank", "node"], default="rank")
    ap.add_argument("--back-after", type=float, default=None, metavar="S",
                    help="--kill node: start n1's agent again S seconds after each kill")
    ap.add_argument("--period", type=float, default=None, metavar="T",
                    help="kill n1 every T seconds (from the first step line), not once; with --kill node, "
                         "back T/2 later unless --back-after says otherwise")
    ap.add_argument("--heartbeat-ms", type=int, default=250, help="the coordinator's base interval")
    ap.add_argument("--timeout", type=float, default=600, help="seconds each mode's job may take")
    ap.add_argument("--keep", help="run in this new directory and keep it (the logs)")
    ap.add_argument("-o", "--output", choices=["table", "json"], default="table")
    args = ap.parse_args()
    if args.period is not None and args.kill == "node" and args.back_after is None:
        args.back_after = args.period / 2
    if args.back_after is not None and args.kill != "node":
        ap.error("--back-after: only a killed node comes back (--kill node)")
    if args.kill == "node" and "whole" in args.only.split(",") and args.back_after is None:
        ap.error("--kill node: the pinned plan recovers whole only once n1 is back; add --back-after S, or use "
                 "--only none,keep-going")
    def each(root: Path) -> list:
        rows = []
        for m in args.only.split(","):
            rows.append(run_one(m, args, root))
            # Each mode's row as it ends: a later mode that fails leaves the earlier ones said.
            log(json.dumps(rows[-1]))
        return rows

    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=False)
        rows = each(Path(args.keep))
    else:
        with tempfile.TemporaryDirectory(prefix="motley-keep-going-") as d:
            os.chmod(d, 0o755)
            rows = each(Path(d))
    if args.output == "json":
        print(json.dumps(rows, indent=1))
        return
    cols = ["mode", "state", "generation", "wall_s", "steps_per_hour", "steps_run", "recomputed", "kills",
            "killed_after_step", "kill_to_next_step_s", "back_to_full_s", "median_step_s_before",
            "median_step_s_after"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[k]) for k in cols))


if __name__ == "__main__":
    main()
