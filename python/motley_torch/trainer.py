"""A rank's training run under a plan (`python -m motley_torch.train` in a rank; `train.py`
parses the flags): the plan's stage of the model, its pipeline, its one gradient-sync seam
(`gradient_sync`), loss scaling, evaluation, checkpoints, preemption notices and per-step
timings. `Trainer.step` is one step:

    pipeline forward/backward over the rank's micro-batches -> the pipeline's last sends
    -> gradient sync (the plan's way) -> loss scaler -> optimizer -> the global loss's sum started

The host reads a step's global loss, and prints its line, once the next step's work is
launched (before any evaluation, checkpoint or the run's end, and at once under --timings):
reading it at once would make the host wait for the GPU at every step, which then idles while
the next step's first kernels are launched. A line's `step_s` is then the time from its step's
start to the next step's (the last step's: to its loss being read).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist

from .components.data import device_micro_batches, rank_micro_batches
from .distributed import keep_going
from .distributed.gradient_sync import SAVE_GRADS_HALF, SAVE_GRADS_ZERO1, gradient_sync
from .model_source import load_model
from .components.progress import emit, emit_eval, log_samples, memory_line
from .spec import ModelSpec, PlanError
from .components.stage_files import save_hf_distributed, save_params_distributed
from .components.mfu import device_peak, train_flops_per_token
from .components.stage_init import build_stage, compile_stage, init_weights, make_optimizer


def check_flags_against_plan(args):
    """--seq-len and --global-batch are --single-process's; under a plan (--plan, $MOTLEY_PLAN)
    the plan's are what every rank runs, so a flag may only repeat them. Checked before the
    ranks meet: a contradiction is refused naming both values, never silently replaced. So is
    --save-grads under the plan's ZeRO-1: a rank that left once the groups were made would
    leave a peer still making them to fail on a reset connection, not on the flags."""
    if args.save_grads and args.half_weights:
        raise PlanError(SAVE_GRADS_HALF)
    if args.seq_len is None and args.global_batch is None and not args.save_grads:
        return
    path = args.plan or os.environ.get("MOTLEY_PLAN")
    try:
        with open(path) as f:
            doc = json.load(f)
    except (TypeError, OSError, ValueError):
        return  # no plan to read: joining the job names the problem
    if not isinstance(doc, dict):
        return
    if args.save_grads and (args.zero1 or doc.get("zero1") is True):
        raise PlanError(SAVE_GRADS_ZERO1)
    for flag, key, given in (("--seq-len", "seq_len", args.seq_len), ("--global-batch", "global_batch", args.global_batch)):
        if given is not None and doc.get(key) != given:
            raise PlanError(f"{flag}: {given}, but the plan ({path}) has {key} {doc.get(key)}; every rank runs the "
                            f"plan's: drop {flag} or plan for {given}")


def half_weights(args, precision: str, zero1: bool, model):
    """`--half-weights`: the model's parameters cast to the compute type, fp32 masters beside
    them (`distributed.half_weights`); None without it, and under ZeRO-1, which keeps half
    weights its own way."""
    if not args.half_weights or zero1:
        return None
    from .components.precision import HALF
    from .distributed.half_weights import HalfWeights

    if precision not in HALF:
        raise PlanError(f"--half-weights: the compute type is {precision} (--dtype {args.dtype}), which has no half "
                        f"weights to keep; give --dtype bf16 or fp16, or drop --half-weights")
    print(f"motley-half-weights on: {precision} weights, fp32 masters, one cast per step", file=sys.stderr,
          flush=True)
    return HalfWeights(model, HALF[precision])


def check_model(plan_model: ModelSpec, given: Optional[ModelSpec], ref: str):
    if given is None:
        return
    # max_position_embeddings bounds the sequence, it shapes nothing: a plan made from a model
    # file that does not say it runs the Hugging Face weights alike.
    for k, v in plan_model.to_dict().items():
        if k not in ("name", "max_position_embeddings") and given.to_dict()[k] != v:
            raise PlanError(f"--model: {ref} has {k} {given.to_dict()[k]}, the plan's model_spec {v}")


def timings_path(pattern: str, rank: int) -> str:
    return pattern.replace("{rank}", str(rank)) if "{rank}" in pattern else f"{pattern}.rank{rank}"


def agree_any(flag: bool, view) -> bool:
    """True on every rank when it is True on any (one all-reduce MAX over the world: the
    members' under a membership after a lost replica)."""
    t = torch.tensor([1.0 if flag else 0.0], device=view.device)
    view.wait(dist.all_reduce(t, op=dist.ReduceOp.MAX, group=view.world_group, async_op=True))
    return bool(t.item() > 0)


def collective_failed(e: BaseException) -> bool:
    """A collective or the store failed under it (a peer's process is gone), not the step's own
    maths: torch's distributed errors, and gloo's, which come as RuntimeError naming gloo."""
    text = str(e)
    return isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and any(
        w in text for w in ("gloo", "Connection", "NCCL", "pair closure", "timed out", "Timed out")))


class Trainer:
    """One rank's run: built from the flags and the plan (joining the job's process groups),
    then `run()` trains from the restored step (or 0) to --steps."""

    def __init__(self, args):
        from .distributed.groups import init
        from .components.feed import StepSource, due_evals, eval_set
        from .components.precision import HALF, LossScaler, autocast, resolve
        from .distributed.pipeline import Pipeline

        self.args = args
        check_flags_against_plan(args)
        given = load_model(args.model) if args.model else None
        hf_spec = load_model(args.init_from_hf) if args.init_from_hf else None
        # A rank the agent started to rejoin a job that kept going takes its groups from the
        # epoch's store and its state from the members' (distributed/rejoin.py).
        self.began = time.monotonic()
        self.joining = _joining(args, given or hf_spec)
        if self.joining is not None:
            from .distributed.rejoin import join_view

            view, join_tcp = join_view(self.joining[0], self.joining[1], args.timeout)
            self.view = view
        else:
            view = self.view = init(args.plan, model=given or hf_spec, timeout_s=args.timeout)
        plan = self.plan = view.plan
        print("motley-view " + json.dumps(view.summary(), sort_keys=True), file=sys.stderr, flush=True)
        check_model(plan.model, given, args.model)
        check_model(plan.model, hf_spec, f"--init-from-hf {args.init_from_hf}")
        spec, seq = plan.model, plan.seq_len
        self.seq = seq
        precision = resolve(args.dtype, plan.precision, view.device)
        print(f"motley-precision {precision} (asked {args.dtype}, plan {plan.precision})", file=sys.stderr, flush=True)
        self.scaler = LossScaler(precision == "fp16", args.initial_loss_scale, args.loss_scale_window)
        tp_pg = view.tp_group.pg if view.tp_group is not None else None
        model = self.model = build_stage(args, spec, seq, view.layers, group=tp_pg, tp_rank=view.tp_rank,
                                         tp_size=view.tp_size)
        init_weights(model, args)
        model.to(device=view.device)
        model.recompute = args.recompute or plan.recompute
        if model.recompute:
            print("motley-recompute on", file=sys.stderr, flush=True)
        if not compile_stage(model, args, view.device) and view.device.type == "cuda" and plan.compiled:
            print("motley-compile warning: the plan was priced for compiled blocks (its compiled: true), and eager "
                  "blocks save about 1.5x the activations it priced: plan with `motley plan --eager` to run "
                  "--compile off", file=sys.stderr, flush=True)
        zero1 = args.zero1 or plan.zero1
        self.half = half_weights(args, precision, zero1, model)
        self._make_sync = lambda v, optimizer=None: gradient_sync(
            v, model, zero1=zero1, overlap=not args.no_overlap, bucket_mb=args.bucket_mb, half=HALF.get(precision),
            make_optimizer=lambda ps: make_optimizer(ps, args), save_grads=bool(args.save_grads), optimizer=optimizer,
            half_weights=self.half)
        self.sync = self._make_sync(view)
        if self.sync.zero is not None:
            print(f"motley-zero1 on: {len(self.sync.zero.master)} of {len(list(model.parameters()))} parameters "
                  f"stepped here", file=sys.stderr, flush=True)
        # Activations cross stages in fp32 (the residual stream's type under autocast).
        self.pipe = Pipeline(view, model, spec.hidden, seq, dtype=torch.float32)
        self.pipe.autocast = autocast(precision, view.device)
        self.scale = 1.0 / (plan.global_batch * seq)
        self.flops_per_token = train_flops_per_token(spec, seq)
        self.device_peak = device_peak(view.device, precision)
        # A joining rank meets the world only in its epoch (`_move`).
        self.peak_tflops = self._world_peak(self.device_peak) if self.joining is None else None
        self.keep = None
        if self.joining is not None:
            self.keep = keep_going.KeepGoing(view, args.timeout, joining=self.joining[1], tcp=join_tcp)
            print(f"motley-keep-going on: rank {view.rank} rejoins in epoch {self.joining[1].epoch} from the "
                  f"members' live state (docs/keep-going.md)", file=sys.stderr, flush=True)
        elif keep_going.enabled(view, zero1, self.half is not None):
            tied = self.sync.tied.group if self.sync.tied is not None else None
            self.keep = keep_going.KeepGoing(view, args.timeout, tied)
            print("motley-keep-going on: a lost replica's share goes to the others (docs/keep-going.md)",
                  file=sys.stderr, flush=True)
        if self.keep is not None and args.ckpt_dir:
            from .components import checkpoint

            self.keep.carry = checkpoint.pending_label  # compared where the members meet (`_settle_saves`)
        self.reports_loss = view.is_last_stage and view.tp_rank == 0
        self.pending = None  # the last step's loss line, its sum still in flight
        self.last_line = None  # the last line flushed (every rank: `_next_epoch`)
        self.start = 0
        position = {"samples": 0}
        if args.ckpt_dir or args.ckpt_restore:
            from .components import checkpoint

            checkpoint.require_modules()
        if args.ckpt_restore and self.joining is None:
            self.start = checkpoint.restore(view, model, self.sync.optimizer,
                                            checkpoint.restore_list(args.ckpt_restore), position=position,
                                            zero=self.sync.zero, masters=self._masters())
            self.scaler.load(position.get("scaler"), "MOTLEY_CKPT_RESTORE")
            print(f"motley-restore step {self.start} samples {position['samples']}", file=sys.stderr, flush=True)
        self.source = StepSource(args, spec.vocab, seq, plan.global_batch, samples_consumed=position["samples"])
        self.evals = eval_set(args, spec.vocab, seq)
        self.due = set(due_evals(self.start, args.steps, args.eval_every)) if self.evals is not None else set()
        # A preemption notice (the agent's MOTLEY_CKPT_NOTICE) makes every rank save at the end
        # of the step at which any of them saw it (one integer all-reduced per step).
        self.notice = None
        if args.ckpt_dir:
            from .components.save_notice import SaveNotice

            self.notice = SaveNotice.from_env()
        self.profiler = None
        if getattr(args, "torch_profile", None):
            from .components.torch_profile import StepProfiler

            self.profiler = StepProfiler(args.torch_profile, self.start, view.rank, view.device)
        self.tfile = None
        if args.timings:
            path = timings_path(args.timings, view.rank)
            if os.path.dirname(path):
                os.makedirs(os.path.dirname(path), exist_ok=True)
            self.tfile = open(path, "a")

    def _masters(self):
        """Parameter -> fp32 master where the weights are kept in half precision (`HalfWeights`)."""
        return self.half.master if self.half is not None else None

    def _exporter(self):
        """What `--save-params` / `--save-hf` take the fp32 masters from (ZeRO-1's or the half
        weights'), or None where the parameters are the masters."""
        return self.sync.zero if self.sync.zero is not None else self.half

    def _world_peak(self, mine):
        """The summed peak TFLOPS of every GPU of the job (the MFU's denominator: a mixed
        cluster's GPUs each count their own), or None when any rank's is unknown."""
        t = torch.tensor([mine or 0.0, 0.0 if mine else 1.0], dtype=torch.float64 if self.view.backend == "gloo"
                         else torch.float32, device=self.view.device)
        # Waited as every cross-replica collective (`RankView.wait`): after a new epoch's making,
        # a member lost just then must not hold the others for the group's whole timeout.
        self.view.wait(dist.all_reduce(t, group=self.view.world_group, async_op=True))
        return float(t[0]) if float(t[1]) == 0 else None

    def _start_loss_sum(self, local) -> tuple:
        """The world's sum of the step's loss (this rank's on the device, or 0.0), started."""
        view = self.view
        dtype = torch.float64 if view.backend == "gloo" else torch.float32
        if self.reports_loss and torch.is_tensor(local):
            t = local.detach().reshape(1).to(dtype)
        else:
            t = torch.tensor([local if self.reports_loss else 0.0], dtype=dtype, device=view.device)
        return t, dist.all_reduce(t, async_op=True, group=view.world_group)

    def flush_loss(self, next_start: Optional[float] = None):
        """Print the pending step's loss line (rank 0), waiting for its sum."""
        if self.pending is None:
            return
        step, total, t_step, used, skipped, epoch = self.pending
        self.pending = None
        if isinstance(total, float):
            loss = total  # the votes' sum (`keep_going`)
        else:
            t, work = total
            work.wait()
            loss = float(t.item())
        end = next_start if next_start is not None else time.perf_counter()
        # Every member keeps the line: a new leader prints it again when the old one was lost
        # (`_next_epoch`).
        self.last_line = (step, loss, end - t_step, used, skipped, epoch)
        if self.view.rank == self.view.leader:
            self._emit(self.last_line)

    def _emit(self, line: tuple, again: bool = False):
        step, loss, step_s, used, skipped, epoch = line
        emit(step, loss, self.plan.global_batch * self.seq, step_s, used, skipped,
             self.flops_per_token, self.peak_tflops, epoch=epoch, again=again)

    def _global_sum(self, value: float) -> float:
        t, work = self._start_loss_sum(value)
        self.view.wait(work)  # as every cross-replica collective: a member lost must not hold it
        return float(t.item())

    def evaluate(self, at: int):
        from .components.feed import eval_chunks

        total = 0.0
        for chunk in eval_chunks(self.evals, self.plan.global_batch):
            micro = rank_micro_batches(self.plan, self.view.rank, chunk)
            micro = [(x.clamp(min=0), y) for x, y in micro]
            total += self.pipe.evaluate(micro)
        total = self._global_sum(total)
        if self.view.rank == self.view.leader:
            emit_eval(at, total / (self.evals.shape[0] * self.seq))

    def step(self, step: int):
        """One step, and its timings line under --timings."""
        from .distributed.pipeline import StepTimings, clock

        view, plan, pipe, sync, scaler = self.view, self.plan, self.pipe, self.sync, self.scaler
        timed = self.tfile is not None
        marks = []

        def mark():
            if timed:
                marks.append(clock())

        t_step = time.perf_counter()
        if self.args.cuda_graphs:
            # CUDA graphs reuse their output buffers: a new step's graphs may overwrite the
            # last step's, never this step's (torch.compile's cudagraph trees).
            torch.compiler.cudagraph_mark_step_begin()
        if timed:
            pipe.timings = StepTimings()
        mark()
        tokens = self.source.tokens(step)
        if view.rank == view.leader:
            log_samples(self.args.sample_log, step, self.source.ids)
        micro = device_micro_batches(plan, view.rank, tokens, view.device)
        used = scaler.factor()
        sync.start_step(len(micro))
        local = pipe.step(micro, self.scale * used) / used
        mark()
        pipe.finish()
        mark()
        sync.finish()
        skipped = scaler.step(sync.stepped(), agree=lambda flag: agree_any(flag, view))
        mark()
        voted = None
        if self.keep is not None:
            # The step commits on every member or on none (`keep_going`); the loss's sum is the votes'.
            mine = float(local) if self.reports_loss else None
            self.held = (step, t_step, used, skipped)
            voted = self.keep.vote(step, mine)
        mark()
        if self.args.save_grads and step == self.start:
            save_params_distributed(view, self.model, self.args.save_grads, grads=True)
        if not skipped:
            sync.optimizer.step()
        if step == self.start:
            print(memory_line(self.model, sync.optimizer, view.device, sync.masters()), flush=True)
        sync.optimizer.zero_grad(set_to_none=True)
        sync.end_step(skipped)
        mark()
        # The global mean loss: every sample's scaled loss is summed once (TP rank 0 of the
        # last stages), over the whole world, so rank 0 has it whatever stage it holds; read
        # once the next step is launched (the module's docstring).
        total = voted if voted is not None else self._start_loss_sum(local)
        self.flush_loss(next_start=t_step)
        self.pending = (step, total, t_step, used, skipped, view.epoch)
        if timed or voted is not None:
            # A voted step's sum is in hand: its line goes out as it commits, so a leader lost
            # during the next step leaves no committed step unprinted (`_next_epoch`).
            self.flush_loss()
        mark()
        if timed:
            self._write_timings(step, marks)

    def _write_timings(self, step: int, marks):
        view = self.view
        c0, c1, c2, c3, c4, c5, c6 = marks
        rec = {"step": step, "rank": view.rank, "replica": view.replica, "stage": view.stage,
               "pp_size": view.pp_size, "tp_rank": view.tp_rank, "layers": list(view.layers),
               "start_s": c0[0], "end_s": c6[0], "step_ms": (c6[0] - c0[0]) * 1e3,
               "step_cpu_ms": (c6[1] - c0[1]) * 1e3, "pipeline_ms": (c1[0] - c0[0]) * 1e3}
        # `vote`: keep going's commit of the step across the members (a store round), apart from
        # the gradient sync the cost model prices; nothing runs there without keep going.
        for name, a, b in (("finish", c1, c2), ("grad_sync", c2, c3), ("vote", c3, c4), ("optimizer", c4, c5),
                           ("loss_sync", c5, c6)):
            rec[f"{name}_ms"] = (b[0] - a[0]) * 1e3
            rec[f"{name}_cpu_ms"] = (b[1] - a[1]) * 1e3
        rec["ops"] = self.pipe.timings.ops
        rec["data_wait_ms"] = self.source.wait_s * 1e3
        self.tfile.write(json.dumps(rec) + "\n")
        self.tfile.flush()
        self.pipe.timings = None

    def save(self, step: int):
        from .components import checkpoint

        args = self.args
        # While the job goes on without a replica, the members save the step whole: the leader's
        # replica writes every unit, the leader the lost ranks' rank files (docs/keep-going.md).
        members = set(self.keep.epoch.members) if self.keep is not None else None
        lost = [r for r in range(self.view.world_size) if members is not None and r not in members]
        checkpoint.save(self.view, self.model, self.sync.optimizer, step, args.ckpt_dir, seed=args.seed,
                        global_batch=self.plan.global_batch, lr=args.lr, asynchronous=args.ckpt_async,
                        scaler=self.scaler.state() if self.scaler.enabled else None, zero=self.sync.zero,
                        masters=self._masters(),
                        hf_source=os.path.abspath(args.init_from_hf) if args.init_from_hf else None,
                        lost_ranks=lost)

    def run(self) -> int:
        args, view = self.args, self.view
        if self.joining is not None:
            self.keep.ready()
            step = self._move(None)  # or raises: the members it was to join are gone
        else:
            if self.start in self.due:
                self.evaluate(self.start)
            step = self.start
        while step < args.steps:
            if self.keep is not None and self.keep.move_due is not None:
                # Every member moves to the epoch the last committed step's votes named, here, at
                # the same step boundary (a replica comes back: `_move`).
                try:
                    step = self._move(step)
                except Exception as e:
                    step = self._next_epoch(step, e)  # or raises: not a lost replica's doing
                    continue
            # A newer membership is acted on only where every member sees the step fail (a
            # collective with a lost member, or the vote): never at a step's start, where a
            # peer of the same replica may already wait in the pipeline for this rank.
            try:
                if self.profiler is not None:
                    self.profiler.before(step)
                self.step(step)
            except Exception as e:
                step = self._next_epoch(step, e)  # or raises: not a lost replica's doing
                continue
            if self.profiler is not None:
                self.profiler.after(step)
            step = self._between_steps(step + 1)
        view = self.view
        self.source.close()
        if args.ckpt_dir:
            from .components import checkpoint

            # Wait for the last checkpoint's writer, agree that every rank's writes succeeded
            # (else CheckpointError: exit 2), write its manifest.json.
            checkpoint.finish(view)
        if self.tfile is not None:
            self.tfile.close()
        if args.save_params:
            save_params_distributed(view, self.model, args.save_params, zero=self._exporter())
        if args.save_hf:
            save_hf_distributed(view, self.model, args, zero=self._exporter())
        dist.barrier(group=view.world_group)
        if dist.is_initialized():  # a rank that rejoined never had the launch's default group
            dist.destroy_process_group()
        return 0

    def _between_steps(self, step: int) -> int:
        """What the ranks do before `step` (the last one committed): a preemption notice's
        look, the save, the evaluation. A member lost meanwhile (the step committed everywhere:
        no roll forward) gives up the rest on this rank, as a member that rolled that step
        forward after the loss does all of it: the saves they then hold are settled where they
        meet (`_settle_saves`), and the next ones are whole (docs/keep-going.md). The save comes
        before the evaluation, so a loss during the evaluation finds it made. Returns the step to
        run next: `step`, or the one the meeting names."""
        args = self.args

        def given_up(what: str, e: BaseException) -> int:
            to_run = self._next_epoch(step, e)  # or raises: not a lost replica's doing
            print(f"motley-{what} before step {step} given up: a member was lost meanwhile; the job goes on under "
                  f"epoch {self.view.epoch}", file=sys.stderr, flush=True)
            return to_run

        try:
            noticed = self.notice is not None and self.notice.due(self.view)
        except Exception as e:
            return given_up("notice", e)  # seen again at the next step's look (its number is not handled)
        if noticed:
            print(f"motley-notice {self.notice.handled}: saving step {step}", file=sys.stderr, flush=True)
        due_save = noticed or (args.ckpt_dir and args.ckpt_every > 0 and step % args.ckpt_every == 0)
        if step in self.due or due_save or step == args.steps:
            self.flush_loss()
        if due_save:
            try:
                self.save(step)
            except Exception as e:
                # A member lost while the ranks agreed on the last save: every member gives this
                # save up; the next one is whole.
                return given_up("checkpoint", e)
        if step in self.due:
            try:
                self.evaluate(step)
            except Exception as e:
                return given_up("eval", e)
        return step

    def _next_epoch(self, step: int, cause: BaseException) -> int:
        """Step `step` did not commit here because a replica was lost: move to the membership
        the coordinator opened (its groups, the members' split) and return the step to run
        there: `step` again, or the next one where the others committed it (this rank then
        commits it too, with the gradients it holds: `KeepGoing.next_epoch`). Re-raises
        `cause` when it is not a lost replica's doing or the job does not keep going. Another
        loss while moving (the epoch's groups being made, its first collectives) moves on to
        the epoch after it, from where this rank then is."""
        while True:
            if self.keep is None or not (isinstance(cause, keep_going.StepAborted) or collective_failed(cause)):
                raise cause
            try:
                return self._next_epoch_once(step, cause)
            except _Moved as moved:
                step, cause = moved.step, moved.cause
            except Exception as e:
                cause = e

    def _next_epoch_once(self, step: int, cause: BaseException) -> int:
        view = self.view
        old_leader = view.leader
        roll = self.keep.next_epoch(step, cause, keep_going.make_gloo_or_nccl(view, self.keep.timeout))
        self._take_epoch_view()
        self._settle_saves()
        view = self.view
        # Every committed step's line went out as it committed; a step rolled forward here is
        # printed below by the new leader (the old one went before reading its decision).
        self.flush_loss()
        if (view.rank == view.leader != old_leader and roll is None and self.last_line is not None
                and self.last_line[0] == step - 1):
            # The old leader may have gone between a step's commit and its line: the new one
            # prints the last committed step's line again, marked (the same loss; readers keep
            # one line per step, docs/keep-going.md).
            self._emit(self.last_line, again=True)
        if roll is not None:
            held_step, t_step, used, skipped = self.held
            if not skipped:
                self.sync.optimizer.step()
            self.sync.end_step(skipped)
            self.pending = (held_step, roll, t_step, used, skipped, self.keep.committed_epoch)
            step += 1
        self.sync.optimizer.zero_grad(set_to_none=True)
        try:
            self._new_sync()
            self._rejoin()
            self.peak_tflops = self._world_peak(self.device_peak)
        except Exception as e:
            # The step (rolled forward or not) stands: the next epoch is met from it.
            raise _Moved(step, e) from e
        return step

    def _settle_saves(self):
        """After a meeting: every member must agree on the same save in flight at its next save
        (`checkpoint.finish`, one all-reduce on a rank that holds one). A member that rolled a
        step forward skipped what the others did between that step and the next, a save among
        it (or their agreement on the one before, given up when the lost replica broke it), so
        where the members hold different saves each gives its own up: one all-reduce more on
        some of them deadlocked the next save (docs/keep-going.md)."""
        if self.keep is None or not self.args.ckpt_dir or len(set(self.keep.carried.values())) < 2:
            return
        from .components import checkpoint

        step = checkpoint.give_up()
        if step is not None:
            print(f"motley-checkpoint step {step} not saved: the members met holding different saves "
                  f"({self.keep.carried}); the next save is under epoch {self.view.epoch}", file=sys.stderr, flush=True)

    def _take_epoch_view(self):
        self.view = self.keep.view
        self.plan = self.view.plan

    def _new_sync(self):
        """The gradient sync of the epoch's groups (the optimizer and its state kept)."""
        self.sync.close()
        self.sync = self._make_sync(self.view, optimizer=self.sync.optimizer)
        # Sends of a given-up step stay on the old hop groups (aborted): the new ones start clean.
        self.pipe.v, self.pipe.pending = self.view, []

    def _move(self, step: Optional[int]) -> int:
        """Move to the epoch `keep.move_due` names at the boundary before `step` (a joining rank:
        None, its first step is the members'): meet its members, make its groups, and hand the
        joining ranks their state. Returns the step to run."""
        if self.keep.loaded and self.args.ckpt_dir:
            from .components import checkpoint

            # A save's agreement is the next save's first collective (`checkpoint.finish`); a
            # joining rank has none to agree on: the members agree on theirs among themselves,
            # here, before the epoch's world includes it.
            checkpoint.finish(self.view)
        _, step = self.keep.move(step, keep_going.make_gloo_or_nccl(self.view, self.keep.timeout))
        self._take_epoch_view()
        self._settle_saves()
        self._new_sync()
        if not self.keep.loaded:
            self._start_at(step)
        self._rejoin()
        self.peak_tflops = self._world_peak(self.device_peak)
        return step

    def _start_at(self, step: int):
        """A joining rank's run from the members' step: its data from there, its scalars theirs."""
        from .components.feed import StepSource, due_evals

        args = self.args
        self.start = step
        self.source.close()
        self.source = StepSource(args, self.plan.model.vocab, self.seq, self.plan.global_batch,
                                 samples_consumed=step * self.plan.global_batch)
        self.due = set(due_evals(step, args.steps, args.eval_every)) - {step} if self.evals is not None else set()

    def _rejoin(self):
        """Where the epoch has joining ranks: each layer's weights and AdamW state from the
        members' live state (`rejoin.copy_live_state`), the trainer's scalars through the store."""
        joiners = set(self.keep.joiners)
        if not joiners:
            return
        from .distributed.membership import epoch_groups
        from .distributed.rejoin import copy_live_state, tell_rejoined

        view, sync = self.view, self.sync
        began = time.monotonic()
        tied = None
        if sync.tied is not None:
            holders = [g for g in epoch_groups(self.keep.full_plan, self.keep.epoch.m, True) if g.key == "tied"]
            tied = (sync.tied.group, list(holders[0].ranks) if holders else [view.rank], sync.tied.params)
        synced = [(n, p) for n, p in self.model.named_parameters() if sync.tied is None or n not in sync.tied.names]
        taken = copy_live_state(view, synced, self.model.segment_of, sync.optimizer, joiners, tied)
        state = self.keep.share({"scaler": self.scaler.state() if self.scaler.enabled else None,
                                 "notice": self.notice.handled if self.notice is not None else 0})
        if not self.keep.loaded:
            if state.get("scaler") is not None:
                self.scaler.load(state["scaler"], "the members' loss scale")
            if self.notice is not None:
                self.notice.handled = int(state.get("notice") or 0)
            self.keep.loaded = True
            tell_rejoined({
                "epoch": view.epoch, "replica": view.replica, "rank": view.rank, "step": self.start, "bytes": taken,
                "seconds": round(time.monotonic() - self.began, 3),
                "copy_seconds": round(time.monotonic() - began, 3)})


class _Moved(Exception):
    """A move to a new epoch that failed after its step was settled (`Trainer._next_epoch`)."""

    def __init__(self, step: int, cause: BaseException):
        super().__init__(str(cause))
        self.step, self.cause = step, cause


def _joining(args, model):
    """(plan, membership) when this rank was started to rejoin (distributed/rejoin.py), else None."""
    if os.environ.get("MOTLEY_KEEP_GOING") != "1":
        return None
    from .distributed.membership import ENV
    from .distributed.rejoin import joining
    from .plan import Plan

    # Only a rank started to rejoin finds a membership there at its start (its agent writes it
    # first): every other rank is spared reading the plan here.
    if not os.path.exists(os.environ.get(ENV, "")):
        return None
    path = args.plan or os.environ.get("MOTLEY_PLAN")
    rank = os.environ.get("RANK", "")
    if not path or not rank.isdigit():
        return None  # joining the job names what is missing
    plan = Plan.load(path, model)
    if int(rank) >= len(plan.ranks):
        return None
    m = joining(plan, int(rank))
    return (plan, m) if m is not None else None


def run_rank(args) -> int:
    return Trainer(args).run()
