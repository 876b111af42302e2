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
files listed (docs/checkpoint.md; motley_torch.components.checkpoint). A save stalls the step only for
copying the state to host memory; a background thread writes the files (--ckpt-sync or
$MOTLEY_CKPT_ASYNC=0: written in the step, as before). A failed write ends the run with exit 2
at the next checkpoint or at the end.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from .components.checkpoint import CheckpointError
from .components.cpu_share import CpuShareError, enter_share
from .components.rank_exit import end_rank
from .components.progress import emit, emit_eval, log_samples, memory_line
from .spec import PlanError
from .components.stage_files import hf_names
from .components.mfu import device_peak, train_flops_per_token
from .components.stage_init import build_stage, compile_stage, init_weights, make_optimizer, resolve_spec, save_file


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
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="torch.compile every transformer block and the loss: auto (default) on CUDA, off on the CPU")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="also capture the compiled blocks with CUDA graphs (torch.compile mode reduce-overhead); "
                        "pays where a step is launch-bound (small hidden sizes on fast GPUs)")
    p.add_argument("--torch-profile", metavar="DIR",
                   help="torch.profiler over steps 3 and 4 after the start: DIR/kernels.rank{R}.txt (operators and "
                        "kernels by device time) and DIR/trace.rank{R}.json.gz (Chrome trace)")
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
    p.add_argument("--half-weights", action="store_true",
                   help="bf16/fp16: keep the model's parameters in the compute type and fp32 masters beside them "
                        "for the optimizer, cast once per step after the optimizer step, instead of autocast "
                        "casting every weight on every micro-batch (gradients still summed in fp32); no --save-grads, "
                        "and a job with it recovers whole rather than keep going without a lost replica")
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


def run_single(args) -> int:
    import time

    from .components.feed import StepSource, due_evals, eval_chunks, eval_set, split_inputs_targets

    if not args.global_batch or args.global_batch < 1:
        raise PlanError("--global-batch: required with --single-process (a positive integer)")
    spec = resolve_spec(args)
    seq = args.seq_len or spec.seq_len
    from .components.precision import LossScaler, autocast, resolve

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = resolve(args.dtype, None, device)
    amp = autocast(precision, device)
    scaler = LossScaler(precision == "fp16", args.initial_loss_scale, args.loss_scale_window)
    model = build_stage(args, spec, seq, (0, spec.layers))
    init_weights(model, args)
    model.to(device=device)
    model.recompute = args.recompute
    compile_stage(model, args, device)
    opt = make_optimizer(model.parameters(), args)
    flops = train_flops_per_token(spec, seq)
    peak = device_peak(device, precision)
    source = StepSource(args, spec.vocab, seq, args.global_batch)
    evals = eval_set(args, spec.vocab, seq)
    due = set(due_evals(0, args.steps, args.eval_every)) if evals is not None else set()

    def evaluate(step):
        total = 0.0
        with torch.no_grad():
            for chunk in eval_chunks(evals, args.global_batch):
                inputs, targets = split_inputs_targets(chunk)
                with amp():
                    total += float(model.loss(inputs.to(device), targets.to(device)))
        emit_eval(step, total / (evals.shape[0] * seq))

    if 0 in due:
        evaluate(0)
    try:
        for step in range(args.steps):
            t0 = time.perf_counter()
            if args.cuda_graphs:
                torch.compiler.cudagraph_mark_step_begin()  # see Trainer.step
            tokens = source.tokens(step).to(device)
            log_samples(args.sample_log, step, source.ids)
            used = scaler.factor()
            with amp():
                loss = model.loss(tokens[:, :-1], tokens[:, 1:], grad_scale=used / (args.global_batch * seq))
            loss = loss / (args.global_batch * seq)
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
            emit(step, value, args.global_batch * seq, time.perf_counter() - t0, used, skipped, flops, peak)
            if step + 1 in due:
                evaluate(step + 1)
    finally:
        source.close()
    if args.save_params:
        os.makedirs(args.save_params, exist_ok=True)
        save_file({k: v.detach().float().cpu() for k, v in model.state_dict().items()},
                  os.path.join(args.save_params, "params.safetensors"))
    if args.save_hf:
        from .models import hf_out
        from .models.hf import write_hf

        state = model.state_dict()
        names = hf_names(spec, state)
        hf_out.prepare(args)
        write_hf(args.save_hf, spec, ((n, state[n].detach().float().cpu()) for n in names))
        hf_out.finish(args)
    return 0


def main(argv=None) -> int:
    # SIGUSR1 prints every thread's stack to stderr (the rank's log): where a stuck rank waits.
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)
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
        from .components.checkpoint import async_default

        args.ckpt_async = False if args.ckpt_sync else async_default()
        if args.single_process and (args.ckpt_every or args.ckpt_restore):
            raise PlanError("--ckpt-every/--ckpt-restore: checkpoints are written and read by ranks, not --single-process")
        if args.single_process and args.half_weights:
            raise PlanError("--half-weights: the ranks' runtime keeps half weights; --single-process is the fp32-weights "
                            "reference: drop one of them")
        from .models import hf_out

        hf_out.check_args(args)
        if args.single_process:
            return run_single(args)
        from .trainer import run_rank

        # Loaded: the emulated device's share starts with the work it emulates.
        enter_share()
        code = run_rank(args)
    except (PlanError, CheckpointError, CpuShareError) as e:
        print(f"motley_torch.train: {e}", file=sys.stderr, flush=True)
        _end_rank_on_error(2)
        return 2
    # Over: its groups destroyed, its files closed, its checkpoint's manifest written.
    end_rank(code)
    return code


def _end_rank_on_error(code: int):
    """A rank with a process group ends here, with `code`, at once. Its peers end on the same
    error at nearly the same moment, so gloo's worker threads meet closed connections: torn down
    by `destroy_process_group` or by the interpreter's exit, they can abort the process (SIGABRT,
    exit -6) instead of letting it exit with its code. Nothing is left to finish on this path: a
    checkpoint file still being written was never renamed into place, so it is never taken for a
    whole one (docs/checkpoint.md)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        end_rank(code)


if __name__ == "__main__":
    sys.exit(main())
