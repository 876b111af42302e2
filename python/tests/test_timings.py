"""The trainer's --timings: every rank writes one JSON line per step with the micro-batches of
its 1F1B order (receive, compute, send; wall and thread-CPU ms) and the step's other phases,
rank 0's stdout stays the loss lines, and the losses are those of a run without timings."""

from __future__ import annotations

import json

import yaml

from launcher import DATA, check_ok, hand_plan, launch, losses

from motley_torch.distributed.pipeline import one_f_one_b

PHASES = ("recv", "compute", "send")
STEP_PHASES = ("finish", "grad_sync", "vote", "optimizer", "loss_sync")


def test_timings_file_has_every_micro_batch_of_every_step(tmp_path):
    spec = yaml.safe_load((DATA / "tiny4.yaml").read_text())
    # One replica of two stages (2 + 2 layers), 3 micro-batches of 2 rows.
    plan = hand_plan(spec, 6, 2, [dict(micro_batches=3, stages=[
        dict(layers=[0, 2], tp=1, dp=1, gpus=[("a", 0)]),
        dict(layers=[2, 4], tp=1, dp=1, gpus=[("b", 0)])])])
    steps = 2
    args = ["--steps", str(steps), "--seed", "3"]
    plain = launch(plan, args, tmp_path / "plain")
    check_ok(plain)
    timed = launch(plan, args + ["--timings", str(tmp_path / "t" / "rank{rank}.jsonl")], tmp_path / "timed")
    check_ok(timed)
    # The stdout contract is unchanged, and timing changes nothing in the training.
    docs = [json.loads(x) for x in timed[0].stdout.splitlines()]
    lines = [d for d in docs if "step" in d]
    assert len(lines) == steps and all(set(d) == {"step", "loss", "tokens_per_s", "step_s", "loss_scale", "skipped", "epoch"}
                                       for d in lines), timed[0].stdout
    assert [set(d["memory"]) for d in docs if "memory" in d] == [
        {"params_mb", "grads_mb", "optimizer_mb", "peak_mb", "device"}], timed[0].stdout
    assert losses(timed[0].stdout) == losses(plain[0].stdout)
    for r in range(2):
        recs = [json.loads(x) for x in (tmp_path / "t" / f"rank{r}.jsonl").read_text().splitlines()]
        assert [x["step"] for x in recs] == list(range(steps))
        for rec in recs:
            assert (rec["rank"], rec["replica"], rec["stage"], rec["pp_size"], rec["tp_rank"]) == (r, 0, r, 2, 0)
            assert rec["layers"] == [2 * r, 2 * r + 2]
            assert [(o["op"], o["mb"]) for o in rec["ops"]] == [tuple(x) for x in one_f_one_b(2, r, 3)]
            for o in rec["ops"]:
                for ph in PHASES:
                    assert o[f"{ph}_ms"] >= 0 and o[f"{ph}_cpu_ms"] >= 0, o
                assert o["compute_ms"] > 0, o
            for ph in STEP_PHASES:
                assert rec[f"{ph}_ms"] >= 0 and rec[f"{ph}_cpu_ms"] >= 0, rec
            assert rec["end_s"] > rec["start_s"]
            assert rec["data_wait_ms"] == 0.0, "synthetic batches are made in the step, nothing waited for"
            # Float64 sums of a few hundred times under 1e5 ms round by under 1e-8 ms: 1e-6 is
            # that with room, and far under any phase's real length.
            assert abs(rec["step_ms"] - 1e3 * (rec["end_s"] - rec["start_s"])) < 1e-6
            parts = rec["pipeline_ms"] + sum(rec[f"{ph}_ms"] for ph in STEP_PHASES)
            assert parts <= rec["step_ms"] + 1e-6
            assert sum(o[f"{ph}_ms"] for o in rec["ops"] for ph in PHASES) <= rec["pipeline_ms"] + 1e-6
        # A stage-0 rank never receives activations; the last stage never waits for gradients
        # (its backward starts from the loss): their receive phases are empty.
    r0 = [json.loads(x) for x in (tmp_path / "t" / "rank0.jsonl").read_text().splitlines()]
    assert all(o["recv_cpu_ms"] < 5 for rec in r0 for o in rec["ops"] if o["op"] == "F")
    # Without --timings (and without MOTLEY_TIMINGS) no file is written.
    assert not list((tmp_path / "plain").glob("*.jsonl"))
