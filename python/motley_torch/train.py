"""The reference trainer: `python -m motley_torch.train`.

Run by every rank of a job (the job file's `run:`), it trains the plan's GPT on synthetic data
with the plan's pipeline, tensor and data parallelism; global rank 0 prints one JSON line per
step, {"step": i, "loss": x}, the global mean loss. With --single-process it trains the same
model on the same data in one process and prints the same lines (in fp32 the two agree within
the rounding their order of sums explains), which is how the distributed paths are checked.

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

from .data import rank_micro_batches
from .model import GPTStage
from .checkpoint import CheckpointError
from .plan import ModelSpec, PlanError, load_model



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
    p.add_argument("--dtype", choices=("auto", "bf16", "fp16", "fp32"), default="auto",
                   help="compute type: fp32 master weights and AdamW state, forward under autocast in bf16/fp16 "
                        "(fp16 with one dynamic loss scale for the job); auto (default): the plan's precision on "
                        "CUDA, fp32 on the CPU")
    p.add_argument("--initial-loss-scale", type=float, default=2.0 ** 16, help="fp16: the first loss scale (2^16)")
    p.add_argument("--loss-scale-window", type=int, default=2000,
                   help="fp16: clean steps in a row after which the scale doubles (2000)")
    p.add_argument("--bucket-mb", type=float, default=25.0,
                   help="gradients are reduced over their rings in buckets of at most this many MiB, each launched "
                        "during the backward pass once its gradients are final (default 25)")
    p.add_argument("--recompute", action="store_true",
                   help="recompute every block's activations in the backward pass (also when the plan says so)")
    p.add_argument("--zero1", action="store_true",
                   help="shard the fp32 master weights and AdamW state over each layer segment's dp ring "
                        "(ZeRO-1; also on when the plan's zero1 is)")
    p.add_argument("--no-overlap", action="store_true",
                   help="reduce the gradients after the step's pipeline instead, one buffer per layer segment")
    p.add_argument("--save-params", metavar="DIR",
                   help="write the final parameters, full (unsharded) tensors, to DIR/params.safetensors")
    p.add_argument("--init-from-hf", metavar="DIR",
                   help="start from a Hugging Face model directory's weights (each rank reads only its layers "
                        "and TP slices); its config.json is the model when neither --model nor a plan says one")
    p.add_argument("--save-hf", metavar="DIR",
                   help="after the last step, write the model as a Hugging Face directory (config.json, "
                        "safetensors shards of at most 5 GB, the index, the tokenizer and generation_config.json "
                        "of --tokenizer-from); DIR must be new or empty unless --replace")
    p.add_argument("--tokenizer-from", metavar="DIR",
                   help="--save-hf: copy the tokenizer files and generation_config.json from DIR (default: "
                        "--init-from-hf's directory)")
    p.add_argument("--replace", action="store_true",
                   help="--save-hf: replace the files of a non-empty DIR (default: refuse it)")
    p.add_argument("--data", metavar="PATH",
                   help="train on a tokenized dataset: a Megatron PREFIX (.bin + .idx) or a flat FILE.bin; "
                        "default: synthetic sequences")
    p.add_argument("--data-dtype", choices=("uint16", "uint32"), default=None,
                   help="token type of a flat FILE.bin (default uint16; uint32 for vocabularies over 65,536)")
    p.add_argument("--eval-data", metavar="PATH", help="evaluate on this dataset (same formats as --data)")
    p.add_argument("--eval-samples", metavar="N", type=int, default=64,
                   help="evaluate on the first N samples of --eval-data (default 64)")
    p.add_argument("--eval-every", metavar="K", type=int, default=0,
                   help="print the eval loss at step 0, every K steps and after the last (default 0: "
                        "at the start and the end only)")
    p.add_argument("--save-grads", metavar="DIR",
                   help="write the first step's gradients (after their synchronisation), full tensors, to "
                        "DIR/grads.safetensors: how the tests compare gradients with transformers'")
    p.add_argument("--sample-log", metavar="FILE", default=os.environ.get("MOTLEY_SAMPLE_LOG") or None,
                   help="with --data, rank 0 appends {\"step\", \"samples\": [ids]} per step to FILE, the global "
                        "sample ids of the step's batch (default $MOTLEY_SAMPLE_LOG)")
    p.add_argument("--single-process", action="store_true", help="train the whole model in this process")
    p.add_argument("--global-batch", type=int,
                   help="--single-process: sequences per step; under a plan, refused unless it is the plan's")
    p.add_argument("--seq-len", type=int,
                   help="--single-process: tokens per sequence (default: the model's); under a plan, refused "
                        "unless it is the plan's")
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
    """AdamW with its state made at once (zeros, as its first step would make them): the first
    step's peak memory is then every later step's (the memory line and the cost model compare
    it), and a stage that does not fit fails before training rather than after a step."""
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=args.weight_decay)
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state[p]
            if not st:
                st["step"] = torch.tensor(0.0)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return opt


def emit(step: int, loss: float, tokens: int = 0, step_s: float = 0.0, loss_scale: float = 1.0,
         skipped: bool = False):
    """One progress line: the global mean loss, tokens per second, the step's wall seconds, the
    loss scale the step ran with and whether an overflow skipped its update."""
    print(json.dumps({"step": step, "loss": loss, "tokens_per_s": round(tokens / step_s, 3) if step_s > 0 else 0.0,
                      "step_s": round(step_s, 6), "loss_scale": loss_scale, "skipped": skipped}), flush=True)


def memory_line(model, opt, device, masters=()) -> str:
    """{"memory": {...}}, MB: what the rank's parameters (with ZeRO-1's fp32 masters kept beside
    half-precision parameters), gradients and optimizer state hold and its peak (CUDA:
    max_memory_allocated; CPU: the process's peak RSS)."""
    import resource

    def mb(ts):
        return round(sum(t.numel() * t.element_size() for t in ts) / 2**20, 3)

    params = list(model.parameters())
    params += [m for m in masters if not any(m is p for p in params)]
    state = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    peak = (torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return json.dumps({"memory": {"params_mb": mb(params), "grads_mb": mb([p.grad for p in params if p.grad is not None]),
                                  "optimizer_mb": mb(state), "peak_mb": round(peak, 3), "device": device.type}})


def emit_eval(step: int, loss: float):
    print(json.dumps({"step": step, "eval_loss": loss}), flush=True)


def log_samples(path: Optional[str], step: int, ids):
    if path and ids:
        with open(path, "a") as f:
            f.write(json.dumps({"step": step, "samples": list(ids)}) + "\n")


def resolve_spec(args) -> ModelSpec:
    """--model, else --init-from-hf's config.json."""
    if args.model:
        return load_model(args.model)
    if args.init_from_hf:
        return load_model(args.init_from_hf)
    raise PlanError("--model: required with --single-process (or --init-from-hf DIR, whose config.json is the model)")


def build_stage(args, *a, **kw) -> GPTStage:
    """The stage, its parameters allocated but not initialised when --init-from-hf will write
    every byte (random init of a large model costs more than loading it)."""
    if args.init_from_hf:
        with torch.device("meta"):
            model = GPTStage(*a, **kw)
        return model.to_empty(device="cpu")
    return GPTStage(*a, **kw)


def init_weights(model: GPTStage, args):
    if args.init_from_hf:
        from .hf import is_hf_model

        if not is_hf_model(args.init_from_hf) or not os.path.isdir(args.init_from_hf):
            raise PlanError(f"--init-from-hf: {args.init_from_hf} is not a Hugging Face model directory "
                            f"(config.json and safetensors weights)")
        model.load_hf(args.init_from_hf)
    else:
        model.init_from_seed(args.seed)


def save_file(tensors, path: str):
    from safetensors.torch import save_file as st_save

    tmp = path + ".tmp"
    st_save({k: v.contiguous() for k, v in tensors.items()}, tmp)
    os.replace(tmp, path)


def run_single(args) -> int:
    import time

    from .feed import StepSource, due_evals, eval_chunks, eval_set, split_inputs_targets

    if not args.global_batch or args.global_batch < 1:
        raise PlanError("--global-batch: required with --single-process (a positive integer)")
    spec = resolve_spec(args)
    seq = args.seq_len or spec.seq_len
    from .precision import LossScaler, autocast, resolve

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = resolve(args.dtype, None, device)
    amp = autocast(precision, device)
    scaler = LossScaler(precision == "fp16", args.initial_loss_scale, args.loss_scale_window)
    model = build_stage(args, spec, seq, (0, spec.layers))
    init_weights(model, args)
    model.to(device=device)
    model.recompute = args.recompute
    opt = make_optimizer(model.parameters(), args)
    source = StepSource(args, spec.vocab, seq, args.global_batch)
    evals = eval_set(args, spec.vocab, seq)
    due = set(due_evals(0, args.steps, args.eval_every)) if evals is not None else set()

    def evaluate(step):
        total = 0.0
        with torch.no_grad():
            for chunk in eval_chunks(evals, args.global_batch):
                inputs, targets = split_inputs_targets(chunk)
                with amp():
                    logits = model(inputs.to(device))
                total += float(F.cross_entropy(logits.float().reshape(-1, spec.vocab), targets.to(device).reshape(-1),
                                               reduction="sum", ignore_index=-100))
        emit_eval(step, total / (evals.shape[0] * seq))

    if 0 in due:
        evaluate(0)
    try:
        for step in range(args.steps):
            t0 = time.perf_counter()
            tokens = source.tokens(step).to(device)
            log_samples(args.sample_log, step, source.ids)
            with amp():
                logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, spec.vocab), tokens[:, 1:].reshape(-1), reduction="sum")
            loss = loss / (args.global_batch * seq)
            used = scaler.factor()
            (loss * used).backward()
            skipped = scaler.step(model.parameters())
            if args.save_grads and step == 0:
                os.makedirs(args.save_grads, exist_ok=True)
                save_file({n: p.grad.detach().float().cpu() for n, p in model.named_parameters()},
                          os.path.join(args.save_grads, "grads.safetensors"))
            if not skipped:
                opt.step()
            if step == 0:
                print(memory_line(model, opt, device), flush=True)
            opt.zero_grad(set_to_none=True)
            value = float(loss.detach())
            emit(step, value, args.global_batch * seq, time.perf_counter() - t0, used, skipped)
            if step + 1 in due:
                evaluate(step + 1)
    finally:
        source.close()
    if args.save_params:
        os.makedirs(args.save_params, exist_ok=True)
        save_file({k: v.detach().float().cpu() for k, v in model.state_dict().items()},
                  os.path.join(args.save_params, "params.safetensors"))
    if args.save_hf:
        from . import hf_out
        from .hf import write_hf

        state = model.state_dict()
        names = _hf_names(spec, state)
        hf_out.prepare(args)
        write_hf(args.save_hf, spec, ((n, state[n].detach().float().cpu()) for n in names))
        hf_out.finish(args)
    return 0


def _hf_names(spec: ModelSpec, state) -> list:
    from .hf import motley_order

    names = motley_order(spec)
    missing = [n for n in names if n not in state]
    if missing:
        raise PlanError(f"--save-hf: the model has no {missing[0]}")
    return names


def check_flags_against_plan(args):
    """--seq-len and --global-batch are --single-process's; under a plan (--plan, $MOTLEY_PLAN)
    the plan's are what every rank runs, so a flag may only repeat them. Checked before the
    ranks meet: a contradiction is refused naming both values, never silently replaced."""
    if args.seq_len is None and args.global_batch is None:
        return
    path = args.plan or os.environ.get("MOTLEY_PLAN")
    try:
        with open(path) as f:
            doc = json.load(f)
    except (TypeError, OSError, ValueError):
        return  # no plan to read: joining the job names the problem
    if not isinstance(doc, dict):
        return
    for flag, key, given in (("--seq-len", "seq_len", args.seq_len), ("--global-batch", "global_batch", args.global_batch)):
        if given is not None and doc.get(key) != given:
            raise PlanError(f"{flag}: {given}, but the plan ({path}) has {key} {doc.get(key)}; every rank runs the "
                            f"plan's: drop {flag} or plan for {given}")


def _check_model(plan_model: ModelSpec, given: Optional[ModelSpec], ref: str):
    if given is None:
        return
    # max_position_embeddings bounds the sequence, it shapes nothing: a plan made from a model
    # file that does not say it runs the Hugging Face weights alike.
    for k, v in plan_model.to_dict().items():
        if k not in ("name", "max_position_embeddings") and given.to_dict()[k] != v:
            raise PlanError(f"--model: {ref} has {k} {given.to_dict()[k]}, the plan's model_spec {v}")


def timings_path(pattern: str, rank: int) -> str:
    return pattern.replace("{rank}", str(rank)) if "{rank}" in pattern else f"{pattern}.rank{rank}"


def run_rank(args) -> int:
    import torch.distributed as dist

    from .dist import init
    from .schedule import Pipeline, StepTimings, allreduce_gradients, clock

    import time

    from .feed import StepSource, due_evals, eval_chunks, eval_set

    check_flags_against_plan(args)
    given = load_model(args.model) if args.model else None
    hf_spec = load_model(args.init_from_hf) if args.init_from_hf else None
    view = init(args.plan, model=given or hf_spec, timeout_s=args.timeout)
    plan = view.plan
    print("motley-view " + json.dumps(view.summary(), sort_keys=True), file=sys.stderr, flush=True)
    _check_model(plan.model, given, args.model)
    _check_model(plan.model, hf_spec, f"--init-from-hf {args.init_from_hf}")
    spec, seq = plan.model, plan.seq_len
    from .grad_sync import OverlappedReducer
    from .precision import LossScaler, autocast, resolve

    precision = resolve(args.dtype, plan.precision, view.device)
    print(f"motley-precision {precision} (asked {args.dtype}, plan {plan.precision})", file=sys.stderr, flush=True)
    scaler = LossScaler(precision == "fp16", args.initial_loss_scale, args.loss_scale_window)
    tp_pg = view.tp_group.pg if view.tp_group is not None else None
    model = build_stage(args, spec, seq, view.layers, group=tp_pg, tp_rank=view.tp_rank, tp_size=view.tp_size)
    init_weights(model, args)
    model.to(device=view.device)
    model.recompute = args.recompute or plan.recompute
    if model.recompute:
        print("motley-recompute on", file=sys.stderr, flush=True)
    tied = tied_group(view, model)
    zero1 = args.zero1 or plan.zero1
    synced = [(n, p) for n, p in model.named_parameters() if tied is None or n not in tied.names]
    zero = None
    if zero1:
        from .precision import HALF
        from .zero import ZeroOne

        if args.save_grads:
            raise PlanError("--save-grads: not with ZeRO-1 (--zero1 or the plan's zero1): each gradient lives "
                            "only on its owner; drop one of them")
        zero = ZeroOne(view, model, synced, tied.params if tied is not None else [], HALF.get(precision),
                       lambda ps: make_optimizer(ps, args), args.bucket_mb, overlap=not args.no_overlap)
        opt = zero.optimizer
        print(f"motley-zero1 on: {len(zero.master)} of {len(list(model.parameters()))} parameters stepped here",
              file=sys.stderr, flush=True)
    else:
        opt = make_optimizer(model.parameters(), args)
    # Activations cross stages in fp32 (the residual stream's type under autocast).
    pipe = Pipeline(view, model, spec.hidden, seq, dtype=torch.float32)
    pipe.autocast = autocast(precision, view.device)
    reducer = None if args.no_overlap or zero else OverlappedReducer(view, synced, model.segment_of, args.bucket_mb)
    scale = 1.0 / (plan.global_batch * seq)
    reports_loss = view.is_last_stage and view.tp_rank == 0
    start = 0
    position = {"samples": 0}
    if args.ckpt_restore:
        from . import checkpoint

        start = checkpoint.restore(view, model, opt, checkpoint.restore_list(args.ckpt_restore), position=position,
                                   zero=zero)
        scaler.load(position.get("scaler"), "MOTLEY_CKPT_RESTORE")
        print(f"motley-restore step {start} samples {position['samples']}", file=sys.stderr, flush=True)
    source = StepSource(args, spec.vocab, seq, plan.global_batch, samples_consumed=position["samples"])
    evals = eval_set(args, spec.vocab, seq)
    due = set(due_evals(start, args.steps, args.eval_every)) if evals is not None else set()

    def evaluate(at: int):
        total = 0.0
        for chunk in eval_chunks(evals, plan.global_batch):
            micro = rank_micro_batches(plan, view.rank, chunk)
            micro = [(x.clamp(min=0), y) for x, y in micro]
            total += pipe.evaluate(micro)
        t = torch.tensor([total if reports_loss else 0.0],
                         dtype=torch.float64 if view.backend == "gloo" else torch.float32, device=view.device)
        dist.all_reduce(t)
        if view.rank == 0:
            emit_eval(at, float(t.item()) / (evals.shape[0] * seq))

    if start in due:
        evaluate(start)
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
        t_step = time.perf_counter()
        if tfile is not None:
            pipe.timings = StepTimings()
            c0 = clock()
        tokens = source.tokens(step)
        if view.rank == 0:
            log_samples(args.sample_log, step, source.ids)
        micro = rank_micro_batches(plan, view.rank, tokens)
        used = scaler.factor()
        if zero is not None:
            zero.start_step(len(micro))
        elif reducer is not None:
            reducer.start_step(len(micro))
        local = pipe.step(micro, scale * used) / used
        if tfile is not None:
            c1 = clock()
        pipe.finish()
        if tfile is not None:
            c2 = clock()
        if zero is not None:
            zero.finish_gradients()
        elif reducer is not None:
            reducer.finish()
        else:
            allreduce_gradients(view, synced, model.segment_of)
        if tied is not None:
            tied.sync()
            if zero is not None:
                zero.tied_gradients(tied.params)
        stepped = zero.masters() if zero is not None else model.parameters()
        skipped = scaler.step(stepped, agree=lambda flag: agree_any(flag, view))
        if args.save_grads and step == start:
            save_params_distributed(view, model, args.save_grads, grads=True)
        if tfile is not None:
            c3 = clock()
        if not skipped:
            opt.step()
        if step == start:
            print(memory_line(model, opt, view.device, zero.masters() if zero is not None else ()), flush=True)
        opt.zero_grad(set_to_none=True)
        if zero is not None:
            zero.finish_step(skipped)
        if tfile is not None:
            c4 = clock()
        # The global mean loss: every sample's scaled loss is summed once (TP rank 0 of the
        # last stages), over the whole world, so rank 0 has it whatever stage it holds.
        t = torch.tensor([local if reports_loss else 0.0], dtype=torch.float64 if view.backend == "gloo" else torch.float32,
                         device=view.device)
        dist.all_reduce(t)
        if view.rank == 0:
            emit(step, float(t.item()), plan.global_batch * seq, time.perf_counter() - t_step, used, skipped)
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
            rec["data_wait_ms"] = source.wait_s * 1e3
            tfile.write(json.dumps(rec) + "\n")
            tfile.flush()
            pipe.timings = None
        noticed = notice is not None and notice.due(view)
        if noticed:
            print(f"motley-notice {notice.handled}: saving step {step + 1}", file=sys.stderr, flush=True)
        if step + 1 in due:
            evaluate(step + 1)
        if noticed or (args.ckpt_dir and args.ckpt_every > 0 and (step + 1) % args.ckpt_every == 0):
            from . import checkpoint

            checkpoint.save(view, model, opt, step + 1, args.ckpt_dir, seed=args.seed,
                            global_batch=plan.global_batch, lr=args.lr, asynchronous=args.ckpt_async,
                            scaler=scaler.state() if scaler.enabled else None, zero=zero,
                            hf_source=os.path.abspath(args.init_from_hf) if args.init_from_hf else None)
    source.close()
    if args.ckpt_dir:
        from . import checkpoint

        # Wait for the last checkpoint's writer, agree that every rank's writes succeeded (else
        # CheckpointError: exit 2), write its manifest.json.
        checkpoint.finish(view)
    if tfile is not None:
        tfile.close()
    if args.save_params:
        save_params_distributed(view, model, args.save_params)
    if args.save_hf:
        save_hf_distributed(view, model, args)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def agree_any(flag: bool, view) -> bool:
    """True on every rank when it is True on any (one all-reduce MAX over the world)."""
    import torch.distributed as dist

    t = torch.tensor([1.0 if flag else 0.0], device=view.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


class TiedSync:
    """Sums the gradient of a tied embedding/head matrix over every rank that holds a copy (the
    first and last stages of every replica), with each TP group counted once (its TP ranks hold
    identical, replicated gradients), replacing the per-layer rings for those tensors. Used
    when a replica has more than one stage; with one stage the head is the embedding."""

    def __init__(self, group, params, names, contributes: bool):
        self.group, self.params, self.names, self.contributes = group, params, set(names), contributes

    def sync(self):
        import torch.distributed as dist

        for p in self.params:
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            flat = g.clone() if self.contributes else torch.zeros_like(g)
            dist.all_reduce(flat, group=self.group)
            p.grad = flat


def tied_group(view, model: GPTStage) -> Optional[TiedSync]:
    """The tied-matrix group (every rank creates it, in the same order), or None."""
    import torch.distributed as dist

    plan = view.plan
    if not plan.model.tie_embeddings or all(len(r.stages) == 1 for r in plan.replicas):
        return None
    holders = sorted({rk for r in plan.replicas for st in (r.stages[0], r.stages[-1]) for rk in st.ranks})
    group = dist.new_group(holders)
    if view.rank not in holders:
        return None
    params = model.tied_weights()
    names = [n for n, p in model.named_parameters() if any(p is q for q in params)]
    return TiedSync(group, params, names, contributes=view.tp_rank == 0)


def save_hf_distributed(view, model: GPTStage, args):
    """The stages' full tensors go to staging files in DIR (write_stage_files); rank 0 then
    streams them into the Hugging Face directory (shards of at most 5 GB) and removes the
    staging files. DIR must be one directory for all stages (one host or a shared file system);
    otherwise this fails naming the missing stage file."""
    from . import hf_out

    out_dir = args.save_hf
    staging = write_stage_files(view, model, out_dir, ".motley-stage{s}.safetensors")
    if view.rank == 0:
        hf_out.prepare(args, keep={os.path.basename(p) for p in staging})
        from safetensors import safe_open

        from .hf import motley_order, write_hf

        missing = [p for p in staging if not os.path.exists(p)]
        if missing:
            raise PlanError(f"--save-hf: {missing[0]} was written on another node; give a directory all nodes share")
        where = {}
        for p in staging:
            with safe_open(p, framework="pt") as f:
                for k in f.keys():
                    where[k] = p

        def tensors():
            for name in motley_order(view.plan.model):
                if name not in where:
                    raise PlanError(f"--save-hf: no stage holds {name}")
                with safe_open(where[name], framework="pt") as f:
                    yield name, f.get_tensor(name)

        write_hf(out_dir, view.plan.model, tensors())
        for p in staging:
            os.remove(p)
        hf_out.finish(args)


def write_stage_files(view, model: GPTStage, out_dir: str, pattern: str, grads: bool = False) -> list:
    """Every rank calls this: replica 0's first TP group of every stage gathers its stage's full
    tensors (or gradients) and its TP rank 0 writes them to DIR/pattern ({s}: the stage); after
    a barrier, returns the paths of all stages' files (on this node only when DIR is not
    shared)."""
    import torch.distributed as dist

    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, pattern.format(s=s)) for s in range(view.pp_size)]
    if view.replica == 0 and view.stage_dp_rank == 0:
        tp_pg = view.tp_group.pg if view.tp_group is not None else None
        full = model.gather_full(tp_pg, grads=grads)
        if view.tp_rank == 0:
            save_file(full, paths[view.stage])
        del full
    dist.barrier()
    return paths


def save_params_distributed(view, model: GPTStage, out_dir: str, grads: bool = False):
    """The stages' full tensors (write_stage_files: DIR/params-stage{s}.safetensors); rank 0
    then merges them into DIR/params.safetensors (when DIR is shared, as on one host;
    otherwise the stage files stay where they were written)."""
    stem = "grads" if grads else "params"
    parts = write_stage_files(view, model, out_dir, stem + "-stage{s}.safetensors", grads=grads)
    if view.rank == 0:
        from safetensors.torch import load_file

        if all(os.path.exists(p) for p in parts):
            merged = {}
            for p in parts:
                merged.update(load_file(p))
            save_file(merged, os.path.join(out_dir, f"{stem}.safetensors"))
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
        from . import hf_out

        hf_out.check_args(args)
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
