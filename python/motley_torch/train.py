"""The reference trainer: `python -m motley_torch.train`.

Run by every rank of a job (the job file's `run:`), it trains the plan's GPT on synthetic data
with the plan's pipeline, tensor and data parallelism; global rank 0 prints one JSON line per
step, {"step": i, "loss": x}, the global mean loss. With --single-process it trains the same
model on the same data in one process and prints the same lines (the two agree within 1e-4 in
fp32), which is how the distributed paths are checked.

    python -m motley_torch.train --steps 20 --seed 1                      # in a rank
    python -m motley_torch.train --single-process --model m.yaml \\
        --global-batch 8 --seq-len 16 --steps 20 --seed 1

--timings FILE (or $MOTLEY_TIMINGS) makes every rank append one JSON line per step to FILE with
`{rank}` replaced by its global rank (`.rank{N}` appended when FILE has no `{rank}`): the wall
and thread-CPU milliseconds of every micro-batch's receive, compute and send (see
`schedule.StepTimings`), of waiting for the step's sends, the gradient all-reduce, the optimizer
step and the loss all-reduce, and the step's wall time. Without it no timing code runs.

--ckpt-dir DIR --ckpt-every N (or $MOTLEY_CKPT_DIR, $MOTLEY_CKPT_EVERY) write a checkpoint after
every N-th step, and at the end of the step at which a preemption notice ($MOTLEY_CKPT_NOTICE,
written by the agent) is seen; --ckpt-restore LIST (or $MOTLEY_CKPT_RESTORE) resumes from exactly the
files listed (docs/checkpoint.md; motley_torch.checkpoint). A save stalls the step only for
copying the state to host memory; a background thread writes the files (--ckpt-sync or
$MOTLEY_CKPT_ASYNC=0: written in the step, as before). A failed write ends the run with exit 2
at the next checkpoint or at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

import torch
import torch.nn.functional as F

from .data import global_batch_tokens, rank_micro_batches
from .model import GPTStage
from .checkpoint import CheckpointError
from .plan import ModelSpec, PlanError, load_model

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m motley_torch.train",
        description="Motley's reference trainer: a GPT on synthetic data, run by every rank of a job "
                    "(the plan from $MOTLEY_PLAN) or, with --single-process, in one process.")
    p.add_argument("--plan", help="plan JSON (default: $MOTLEY_PLAN)")
    p.add_argument("--model", help="model YAML file or catalog name; default: the plan's model_spec")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    p.add_argument("--seed", type=int, default=0, help="seeds the initial parameters and the synthetic data")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay (default 0.01)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                   help="parameter and activation type; bf16/fp16 on CUDA only (fp16 without a loss scaler)")
    p.add_argument("--save-params", metavar="DIR",
                   help="write the final parameters, full (unsharded) tensors, to DIR/params.safetensors")
    p.add_argument("--single-process", action="store_true", help="train the whole model in this process")
    p.add_argument("--global-batch", type=int, help="--single-process: sequences per step")
    p.add_argument("--seq-len", type=int, help="--single-process: tokens per sequence (default: the model's)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a collective may wait")
    p.add_argument("--timings", metavar="FILE", default=os.environ.get("MOTLEY_TIMINGS") or None,
                   help="append per-step, per-micro-batch timings as JSON lines to FILE ({rank} is replaced by "
                        "the global rank, else .rank{N} is appended); default $MOTLEY_TIMINGS, off when unset")
    p.add_argument("--ckpt-dir", metavar="DIR", default=os.environ.get("MOTLEY_CKPT_DIR") or None,
                   help="write checkpoints (docs/checkpoint.md) under DIR/step-S; default $MOTLEY_CKPT_DIR")
    p.add_argument("--ckpt-every", metavar="N", type=int, default=None,
                   help="checkpoint after every N-th step; default $MOTLEY_CKPT_EVERY, 0 (never) when unset")
    p.add_argument("--ckpt-restore", metavar="LIST", default=os.environ.get("MOTLEY_CKPT_RESTORE") or None,
                   help="resume from exactly these files: a JSON list of absolute paths or a file holding one; "
                        "default $MOTLEY_CKPT_RESTORE")
    p.add_argument("--ckpt-sync", action="store_true",
                   help="write checkpoints in the training thread (the step waits for the files); default: "
                        "copy the state to memory and write it in the background, unless $MOTLEY_CKPT_ASYNC=0")
    return p.parse_args(argv)


def make_optimizer(params, args):
    return torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=args.weight_decay)


def emit(step: int, loss: float):
    print(json.dumps({"step": step, "loss": loss}), flush=True)


def save_file(tensors, path: str):
    from safetensors.torch import save_file as st_save

    tmp = path + ".tmp"
    st_save({k: v.contiguous() for k, v in tensors.items()}, tmp)
    os.replace(tmp, path)


def run_single(args) -> int:
    if not args.model:
        raise PlanError("--model: required with --single-process")
    if not args.global_batch or args.global_batch < 1:
        raise PlanError("--global-batch: required with --single-process (a positive integer)")
    spec = load_model(args.model)
    seq = args.seq_len or spec.seq_len
    dtype = DTYPES[args.dtype]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dtype != torch.float32 and device.type != "cuda":
        raise PlanError(f"--dtype: {args.dtype} needs CUDA; use fp32 on the CPU")
    model = GPTStage(spec, seq, (0, spec.layers))
    model.init_from_seed(args.seed)
    model.to(device=device, dtype=dtype)
    opt = make_optimizer(model.parameters(), args)
    for step in range(args.steps):
        tokens = global_batch_tokens(args.seed, step, args.global_batch, seq, spec.vocab).to(device)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, spec.vocab), tokens[:, 1:].reshape(-1), reduction="sum")
        loss = loss / (args.global_batch * seq)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        emit(step, float(loss.detach()))
    if args.save_params:
        os.makedirs(args.save_params, exist_ok=True)
        save_file({k: v.detach().float().cpu() for k, v in model.state_dict().items()},
                  os.path.join(args.save_params, "params.safetensors"))
    return 0


def _check_model(plan_model: ModelSpec, given: Optional[ModelSpec], ref: str):
    if given is None:
        return
    for k, v in plan_model.to_dict().items():
        if k != "name" and given.to_dict()[k] != v:
            raise PlanError(f"--model: {ref} has {k} {given.to_dict()[k]}, the plan's model_spec {v}")


def timings_path(pattern: str, rank: int) -> str:
    return pattern.replace("{rank}", str(rank)) if "{rank}" in pattern else f"{pattern}.rank{rank}"


def run_rank(args) -> int:
    import torch.distributed as dist

    from .dist import init
    from .schedule import Pipeline, StepTimings, allreduce_gradients, clock

    given = load_model(args.model) if args.model else None
    view = init(args.plan, model=given, timeout_s=args.timeout)
    plan = view.plan
    print("motley-view " + json.dumps(view.summary(), sort_keys=True), file=sys.stderr, flush=True)
    _check_model(plan.model, given, args.model)
    spec, seq = plan.model, plan.seq_len
    dtype = DTYPES[args.dtype]
    if dtype != torch.float32 and view.device.type != "cuda":
        raise PlanError(f"--dtype: {args.dtype} needs CUDA; use fp32 on the CPU")
    tp_pg = view.tp_group.pg if view.tp_group is not None else None
    model = GPTStage(spec, seq, view.layers, group=tp_pg, tp_rank=view.tp_rank, tp_size=view.tp_size)
    model.init_from_seed(args.seed)
    model.to(device=view.device, dtype=dtype)
    opt = make_optimizer(model.parameters(), args)
    pipe = Pipeline(view, model, spec.hidden, seq, dtype=dtype)
    scale = 1.0 / (plan.global_batch * seq)
    reports_loss = view.is_last_stage and view.tp_rank == 0
    start = 0
    if args.ckpt_restore:
        from . import checkpoint

        start = checkpoint.restore(view, model, opt, checkpoint.restore_list(args.ckpt_restore))
        print(f"motley-restore step {start}", file=sys.stderr, flush=True)
    # A preemption notice (the agent's MOTLEY_CKPT_NOTICE) makes every rank save at the end of
    # the step at which any of them saw it (one integer all-reduced per step).
    notice = None
    if args.ckpt_dir:
        from . import checkpoint

        notice = checkpoint.SaveNotice.from_env()
    tfile = None
    if args.timings:
        path = timings_path(args.timings, view.rank)
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        tfile = open(path, "a")
    for step in range(start, args.steps):
        if tfile is not None:
            pipe.timings = StepTimings()
            c0 = clock()
        tokens = global_batch_tokens(args.seed, step, plan.global_batch, seq, spec.vocab)
        local = pipe.step(rank_micro_batches(plan, view.rank, tokens), scale)
        if tfile is not None:
            c1 = clock()
        pipe.finish()
        if tfile is not None:
            c2 = clock()
        allreduce_gradients(view, model.named_parameters(), model.segment_of)
        if tfile is not None:
            c3 = clock()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if tfile is not None:
            c4 = clock()
        # The global mean loss: every sample's scaled loss is summed once (TP rank 0 of the
        # last stages), over the whole world, so rank 0 has it whatever stage it holds.
        t = torch.tensor([local if reports_loss else 0.0], dtype=torch.float64 if view.backend == "gloo" else torch.float32,
                         device=view.device)
        dist.all_reduce(t)
        if view.rank == 0:
            emit(step, float(t.item()))
        if tfile is not None:
            c5 = clock()
            rec = {"step": step, "rank": view.rank, "replica": view.replica, "stage": view.stage,
                   "pp_size": view.pp_size, "tp_rank": view.tp_rank, "layers": list(view.layers),
                   "start_s": c0[0], "end_s": c5[0], "step_ms": (c5[0] - c0[0]) * 1e3,
                   "step_cpu_ms": (c5[1] - c0[1]) * 1e3, "pipeline_ms": (c1[0] - c0[0]) * 1e3}
            for name, a, b in (("finish", c1, c2), ("grad_sync", c2, c3), ("optimizer", c3, c4),
                               ("loss_sync", c4, c5)):
                rec[f"{name}_ms"] = (b[0] - a[0]) * 1e3
                rec[f"{name}_cpu_ms"] = (b[1] - a[1]) * 1e3
            rec["ops"] = pipe.timings.ops
            tfile.write(json.dumps(rec) + "\n")
            tfile.flush()
            pipe.timings = None
        noticed = notice is not None and notice.due(view)
        if noticed:
            print(f"motley-notice {notice.handled}: saving step {step + 1}", file=sys.stderr, flush=True)
        if noticed or (args.ckpt_dir and args.ckpt_every > 0 and (step + 1) % args.ckpt_every == 0):
            from . import checkpoint

            checkpoint.save(view, model, opt, step + 1, args.ckpt_dir, seed=args.seed,
                            global_batch=plan.global_batch, lr=args.lr, asynchronous=args.ckpt_async)
    if args.ckpt_dir:
        from . import checkpoint

        # Wait for the last checkpoint's writer, agree that every rank's writes succeeded (else
        # CheckpointError: exit 2), write its manifest.json.
        checkpoint.finish(view)
    if tfile is not None:
        tfile.close()
    if args.save_params:
        save_params_distributed(view, model, args.save_params)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def save_params_distributed(view, model: GPTStage, out_dir: str):
    """Replica 0's first TP group of every stage gathers its stage's full tensors; TP rank 0
    writes DIR/params-stage{s}.safetensors; rank 0 then merges them into DIR/params.safetensors
    (when DIR is shared, as on one host; otherwise the stage files stay where they were written)."""
    import torch.distributed as dist

    os.makedirs(out_dir, exist_ok=True)
    if view.replica == 0 and view.stage_dp_rank == 0:
        tp_pg = view.tp_group.pg if view.tp_group is not None else None
        full = model.gather_full(tp_pg)
        if view.tp_rank == 0:
            save_file(full, os.path.join(out_dir, f"params-stage{view.stage}.safetensors"))
    dist.barrier()
    if view.rank == 0:
        from safetensors.torch import load_file

        parts = [os.path.join(out_dir, f"params-stage{s}.safetensors") for s in range(view.pp_size)]
        if all(os.path.exists(p) for p in parts):
            merged = {}
            for p in parts:
                merged.update(load_file(p))
            save_file(merged, os.path.join(out_dir, "params.safetensors"))
            for p in parts:
                os.remove(p)
        else:
            print(f"motley_torch.train: stage parameter files are not all in {out_dir} on this node; "
                  f"not merged", file=sys.stderr)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.steps < 0:
            raise PlanError("--steps: must be >= 0")
        if args.ckpt_every is None:
            env = os.environ.get("MOTLEY_CKPT_EVERY", "").strip() or "0"
            if not env.isdigit():
                raise PlanError(f"MOTLEY_CKPT_EVERY: {env!r} is not a whole number of steps (0: never)")
            args.ckpt_every = int(env)
        if args.ckpt_every < 0:
            raise PlanError("--ckpt-every: must be >= 0 (0: never)")
        if args.ckpt_every and not args.ckpt_dir:
            raise PlanError("--ckpt-every: needs --ckpt-dir or MOTLEY_CKPT_DIR (where to write)")
        from .checkpoint import async_default

        args.ckpt_async = False if args.ckpt_sync else async_default()
        if args.single_process and (args.ckpt_every or args.ckpt_restore):
            raise PlanError("--ckpt-every/--ckpt-restore: checkpoints are written and read by ranks, not --single-process")
        return run_single(args) if args.single_process else run_rank(args)
    except (PlanError, CheckpointError) as e:
        print(f"motley_torch.train: {e}", file=sys.stderr, flush=True)
        _release_process_group()
        return 2


def _release_process_group():
    """Tear the process group down before exiting on an error: left to the interpreter's exit,
    gloo's worker threads can be destroyed while still joinable, and the rank aborts (SIGABRT)
    instead of exiting with its code."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
