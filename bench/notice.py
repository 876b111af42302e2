#!/usr/bin/env python3
"""Preemption notices (docs/recovery.md "Preemption notices"): what a notice costs
when none comes, and what it saves when one does.

1. Overhead. The reference trainer (python -m motley_torch.train) on 4 ranks (2 stages x TP 2
   of the tiny4 model, gloo on the CPU), --steps N, twice: without MOTLEY_CKPT_NOTICE (no
   notice polling) and with it set to a file that never appears (one stat and one int64
   all-reduce per step). period_ms: the median time between consecutive steps' starts on
   rank 0 (`--timings`), which includes everything a step does, the notice check too.

2. Steps lost. A coordinator and 3 agents as processes (python/tests/test_recovery.py's
   Cluster), the tiny-dev model, 300 steps. The last stage's node is drained at step >= 25:
   (a) without a deadline, the job checkpointing every 20 steps: the job recovers at once from
   its newest complete step; (b) with `--deadline 60s`, the job checkpointing every 100000
   steps (never, by itself): the ranks save on notice. lost_steps = the newest step rank 0
   had reported at the drain minus the step the recovery restored (work redone);
   to_recovering_s = drain -> the `recovering` event; recovered_s = drain -> `recovery_done`.

    python bench/notice.py [--steps 300] [--reps 3] [-o json]

Needs the motley binaries (MOTLEY_BIN, default target/ci/motley) and the venv's torch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python" / "tests"))
sys.path.insert(0, str(ROOT / "python"))

import yaml  # noqa: E402

from launcher import DATA, check_ok, hand_plan, launch  # noqa: E402
import test_recovery as rec  # noqa: E402


def four_rank_plan() -> dict:
    spec = yaml.safe_load((DATA / "tiny4.yaml").read_text())
    stages = [dict(layers=[0, 2], tp=2, dp=1, gpus=[("a", 0), ("a", 1)]),
              dict(layers=[2, 4], tp=2, dp=1, gpus=[("b", 0), ("b", 1)])]
    return hand_plan(spec, 4, 2, [dict(micro_batches=2, stages=stages)])


def period_ms(work: Path, steps: int, notice: bool) -> float:
    env = {"MOTLEY_CKPT_DIR": str(work / "ckpt")}
    if notice:
        env["MOTLEY_CKPT_NOTICE"] = str(work / "notice.json")  # never written
    check_ok(launch(four_rank_plan(), ["--steps", str(steps), "--seed", "3", "--timings", str(work / "t")], work,
                    extra_env=env))
    starts = [json.loads(x)["start_s"] for x in (work / "t.rank0").read_text().splitlines()]
    gaps = [(b - a) * 1e3 for a, b in zip(starts[5:], starts[6:])]  # past the warm-up
    assert not list((work / "ckpt").glob("step-*")), "no notice came: nothing may be saved"
    return statistics.median(gaps)


def overhead(steps: int, reps: int) -> dict:
    runs = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as d:
        for i in range(reps):
            for mode in ("off", "on"):  # interleaved: drift hits both
                runs[mode].append(period_ms(Path(d) / f"{mode}-{i}", steps, mode == "on"))
    off, on = statistics.median(runs["off"]), statistics.median(runs["on"])
    return {"bench": "notice_overhead", "steps": steps, "period_ms_without": off, "period_ms_with": on,
            "overhead_ms": on - off, "runs": runs}


def lost(tmp: Path, with_notice: bool, steps: int) -> dict:
    c = rec.Cluster(tmp, [(f"n{i}", rec.node_entry()) for i in range(3)])
    try:
        job = rec.tiny_job(tmp, steps=steps)
        job["checkpoint"]["every"] = 100_000 if with_notice else 20
        c.wait(lambda: sum(n["live"] for n in c.get("/api/v1/nodes")) == 3, 30)
        jid = c.submit(job)
        c.wait(lambda: c.get(f"/api/v1/jobs/{jid}")["state"] == "running", 60)
        plan = c.get(f"/api/v1/jobs/{jid}/plan")["plan"]
        victim = plan["replicas"][0]["stages"][-1]["gpus"][0]["node"]
        c.wait(lambda: len(rec.rank0_losses(tmp, jid, 1)) >= 26, 180, every=0.05)
        cmd = [c.b["motley"], "node", "drain", victim, "--coordinator", c.rest]
        if with_notice:
            cmd += ["--deadline", "60s"]
        at_drain = rec.rank0_losses(tmp, jid, 1)[-1][0] + 1  # steps taken
        t0 = time.time()
        subprocess.run(cmd, check=True, capture_output=True, env=rec.clean_env(), timeout=30)
        c.wait(lambda: any(e["kind"] == "recovery_done" for e in c.events(jid)), 240, every=0.1)
        events = c.events(jid)
        at = {e["kind"]: e["at_ms"] / 1e3 for e in reversed(events)}  # first of each kind
        done = json.loads(next(e["message"] for e in events if e["kind"] == "recovery_done"))
        restored = done["step"] or 0
        return {"bench": "notice_lost_steps", "drain": "deadline 60s" if with_notice else "plain",
                "every": job["checkpoint"]["every"], "steps_at_drain": at_drain, "restored_step": restored,
                "lost_steps": at_drain - restored, "to_recovering_s": at["recovering"] - t0,
                "recovered_s": at["recovery_done"] - t0, "transfer_s": done["transfer_s"]}
    finally:
        c.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("-o", dest="output", choices=["table", "json"], default="table")
    a = p.parse_args()
    rows = [overhead(a.steps, a.reps)]
    for with_notice in (False, True):
        with tempfile.TemporaryDirectory() as d:
            rows.append(lost(Path(d), with_notice, a.steps))
    for r in rows:
        if a.output == "json":
            print(json.dumps(r))
        elif r["bench"] == "notice_overhead":
            print(f"notice polling: step period {r['period_ms_without']:.2f} ms without, {r['period_ms_with']:.2f} ms "
                  f"with ({r['overhead_ms']:+.2f} ms), median of {a.reps} runs of {a.steps} steps")
        else:
            print(f"{r['drain']:>13} (every {r['every']}): drained after step {r['steps_at_drain']}, restored step "
                  f"{r['restored_step']}, lost {r['lost_steps']} steps; recovering after {r['to_recovering_s']:.2f} s, "
                  f"recovered after {r['recovered_s']:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
