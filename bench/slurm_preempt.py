#!/usr/bin/env python3
"""What a Slurm preemption costs a Motley job (docs/slurm.md), on this machine as a one-node
Slurm cluster (python/tests/test_slurm.py's Slurm: munged, slurmctld and slurmd as root, the job
as nobody through deploy/slurm/motley.sbatch), side by side in one go:

  warned  Slurm's warning signal (`scancel --signal=USR1 --batch`, what `--signal=B:USR1@120`
          sends): the script drains the node with a deadline, the ranks save their next step,
          it reaches the cloud, the script exits 75 and Slurm requeues the job (RequeueExit).
  killed  no warning (a node lost, a preemption without GraceTime): `scancel --signal=KILL
          --full` takes the batch script and every step at once, then `scontrol requeue`; the
          next run's coordinator takes the job over and recovers it from its newest periodic
          step in the cloud.

The job: a 4-layer model of hidden HIDDEN (sequences of SEQ tokens, 8 a step) on one emulated
GPU, checkpointing every EVERY steps, the signal sent once rank 0 has reported AT steps (steps
of a few hundred ms on one core: a step of the tests' tiny model takes 7 ms, and the control
plane's half second would be 70 of them). Per run: steps_redone = the steps rank 0 had
finished when the allocation went (its last line) + 1 - the step the requeued run starts at
(work done twice), and redone_s = that times rank 0's median step time (the work in seconds:
these CPU steps take milliseconds, so a control plane's half second is many of them);
signal_to_requeued_s = the signal -> Slurm shows the job requeued;
requeued_to_step_s = the job running again -> the requeued run's first step line.

    python bench/slurm_preempt.py [--reps 2] [--every 10] [--at 15] [--hidden 256] [--seq 64] [-o json]

Needs root, Debian's slurm-wlm and munge, the motley binaries (MOTLEY_BIN, default
target/ci/motley) and the venv's torch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python" / "tests"))
sys.path.insert(0, str(ROOT / "python"))
os.environ.setdefault("MOTLEY_BIN", str(ROOT / "target" / "ci" / "motley"))

import test_slurm as ts  # noqa: E402

STEPS = 2000


def step_lines(work: Path, jid: int, generation: int) -> list:
    out = []
    for log in (ts.state_of(work, jid) / "agents").glob(f"*/jobs/*/{generation}/rank-0.log"):
        out += [json.loads(x) for x in log.read_text().splitlines() if x.startswith('{"step"')]
    return out


def one(slurm: ts.Slurm, name: str, mode: str, every: int, at: int, hidden: int, seq: int) -> dict:
    work = slurm.workdir(name)
    # A killed allocation's ranks are lost with their node: whichever budget the coordinator
    # charges, one is left.
    model = {"name": f"bench-{hidden}", "layers": 4, "hidden": hidden, "heads": 8, "seq_len": seq, "vocab": 512}
    jid = slurm.sbatch(work, slurm.job_file(work, STEPS, every=every, max_restarts=2, model=model))
    slurm.wait(lambda: len(ts.rank0_losses(work, jid, 1)) >= at, 300, f"{at} steps")
    sent = time.time()
    if mode == "warned":
        slurm.run("scancel", "--signal=USR1", "--batch", str(jid), check=True)
    else:
        slurm.run("scancel", "--signal=KILL", "--full", str(jid), check=True)
        slurm.wait(lambda: slurm.job(jid).get("JobState") not in ("RUNNING", "COMPLETING"), 60, "the job killed", every=0.1)
        slurm.run("scontrol", "requeue", str(jid), check=True)
    slurm.wait(lambda: slurm.job(jid).get("Restarts") == "1", 120, "the job requeued", every=0.1)
    requeued = time.time()
    last = ts.rank0_losses(work, jid, 1)[-1][0]
    slurm.wait(lambda: slurm.job(jid).get("JobState") == "RUNNING", 120, "the job running again", every=0.1)
    running = time.time()
    slurm.wait(lambda: ts.rank0_losses(work, jid, 2), 240, "the requeued run's first step", every=0.1)
    first_step_at = time.time()
    resumed = ts.rank0_losses(work, jid, 2)[0][0]
    step_s = statistics.median(x["step_s"] for x in step_lines(work, jid, 1)[1:])
    slurm.run("scancel", str(jid))
    slurm.wait(lambda: slurm.job(jid).get("JobState") not in ("RUNNING", "COMPLETING", "PENDING"), 60, "the job ended", every=0.2)
    return {
        "mode": mode,
        "every": every,
        "last_step_before": last,
        "resumed_at": resumed,
        "steps_redone": last + 1 - resumed,
        "redone_s": round((last + 1 - resumed) * step_s, 3),
        "signal_to_requeued_s": round(requeued - sent, 2),
        "requeued_to_step_s": round(first_step_at - running, 2),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--at", type=int, default=15)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("-o", "--output", choices=["table", "json"], default="table")
    a = p.parse_args()
    gone = ts.missing()
    if gone:
        print(f"slurm_preempt: needs {', '.join(gone)}", file=sys.stderr)
        return 2
    slurm = ts.Slurm()
    rows = []
    try:
        for r in range(a.reps):
            for mode in ("warned", "killed"):
                rows.append(one(slurm, f"{mode}-{r}", mode, a.every, a.at, a.hidden, a.seq))
                print(json.dumps(rows[-1]), file=sys.stderr)
    finally:
        slurm.close()
    if a.output == "json":
        print(json.dumps({"rows": rows}, indent=1))
        return 0
    for mode in ("warned", "killed"):
        mine = [x for x in rows if x["mode"] == mode]
        print(f"{mode:7s} steps redone {[x['steps_redone'] for x in mine]} ({[x['redone_s'] for x in mine]} s of work), "
              f"signal -> requeued {[x['signal_to_requeued_s'] for x in mine]} s, "
              f"running again -> first step {[x['requeued_to_step_s'] for x in mine]} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
