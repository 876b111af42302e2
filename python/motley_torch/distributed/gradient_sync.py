"""The step's one gradient-synchronisation seam.

After a step's last backward, every gradient must be the sum over its layer segment's dp ring
(the per-layer rings of `RankView.segments`, Espresso's eq. 8-9), and a tied embedding/head
matrix the sum over every rank holding a copy; the optimizer then steps what the sync leaves
on this rank. The trainer (`trainer.Trainer`) calls only the four methods of `GradientSync`;
each way of synchronising is a class of its own, so a new one is a new class, not another
branch in the step:

- `AllReduce`: once the backward is over, one all-reduce per segment
  (`schedule.allreduce_gradients`) (`--no-overlap`).
- `Overlapped`: buckets all-reduced from the backward's hooks as soon as they are final,
  while the earlier layers still run backward (`grad_sync.OverlappedReducer`; the default).
- `ZeroOneSync`: each bucket reduced onto the rank that owns its blocks, which steps their fp32
  masters and broadcasts them back (`zero.ZeroOne`; `--zero1` or the plan's `zero1`).

With half weights (`half_weights.HalfWeights`, `--half-weights`) the first two reduce and step
the fp32 masters' gradients instead of the model's parameters', and cast the masters into the
half weights after the optimizer step.

Every way adds the same elements, so the losses equal the single process's.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..spec import PlanError


class TiedSync:
    """Sums the gradient of a tied embedding/head matrix over every rank that holds a copy (the
    first and last stages of every replica), with each TP group counted once (its TP ranks hold
    identical, replicated gradients), replacing the per-layer rings for those tensors. Used
    when a replica has more than one stage; with one stage the head is the embedding."""

    def __init__(self, group, params, names, contributes: bool, view=None):
        self.group, self.params, self.names, self.contributes = group, params, set(names), contributes
        self.view = view

    def sums(self) -> List[torch.Tensor]:
        """Each tied parameter's gradient summed over the holders, in fp32 like every other
        gradient (the rings reduce fp32 buckets): under ZeRO-1 with half weights the local
        gradients are bf16/fp16, whose sum in that type would round, or overflow in fp16
        (python/README.md, "ZeRO-1")."""
        out = []
        for p in self.params:
            if self.contributes and p.grad is not None:
                flat = p.grad.detach().to(torch.float32, copy=True)
            else:
                flat = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            if self.group is not None:
                work = dist.all_reduce(flat, group=self.group, async_op=True)
                self.view.wait(work) if self.view is not None else work.wait()
            out.append(flat)
        return out

    def sync(self):
        """The sums as the parameters' gradients (fp32 parameters: without ZeRO-1 they are)."""
        for p, g in zip(self.params, self.sums()):
            p.grad = g if g.dtype == p.dtype else g.to(p.dtype)


def tied_group(view, model) -> Optional[TiedSync]:
    """The tied-matrix group (every rank creates it, in the same order), or None. Under a
    membership after a lost replica (`view.epoch` > 0) the epoch made it among the members
    (`membership.epoch_groups`), and the plan's holders stay what decides whether there is one."""
    plan = view.plan
    if not plan.model.tie_embeddings or all(len(r.stages) == 1 for r in plan.replicas):
        return None
    holders = sorted({rk for r in plan.replicas for st in (r.stages[0], r.stages[-1]) for rk in st.ranks})
    if view.epoch > 0:
        group = view.tied_group
        if group is None:
            # The only member holding it: its gradient is already the sum.
            return TiedSync(None, model.tied_weights(), _tied_names(model), contributes=True,
                            view=view) if view.rank in holders else None
    else:
        group = dist.new_group(holders)
    if view.rank not in holders:
        return None
    return TiedSync(group, model.tied_weights(), _tied_names(model), contributes=view.tp_rank == 0, view=view)


def _tied_names(model) -> List[str]:
    params = model.tied_weights()
    return [n for n, p in model.named_parameters() if any(p is q for q in params)]


class GradientSync:
    """One way to make a step's gradients global. `optimizer` steps `stepped()`; `zero` is the
    ZeRO-1 state a checkpoint saves and restores (None unless sharded)."""

    zero = None

    def __init__(self, optimizer, tied: Optional[TiedSync]):
        self.optimizer, self.tied = optimizer, tied

    def start_step(self, micro_batches: int):
        """Before the step's first backward, which runs over this many micro-batches."""

    def finish(self):
        """After the step's last backward (and the pipeline's last send): every gradient this
        rank steps is the global sum."""
        self._sync_segments()
        if self.tied is not None:
            self.tied.sync()

    def _sync_segments(self):
        raise NotImplementedError

    def stepped(self) -> Sequence[torch.nn.Parameter]:
        """What the loss scaler checks and the optimizer steps."""
        raise NotImplementedError

    def masters(self) -> Sequence[torch.nn.Parameter]:
        """Tensors held beside the model's parameters (the memory line counts them)."""
        return ()

    def end_step(self, skipped: bool):
        """After the optimizer (or after an overflow skipped it)."""

    def close(self):
        """Done with: a new membership's sync replaces it (hooks on the parameters removed)."""


class AllReduce(GradientSync):
    """`synced`: (name, what holds the gradient): the model's parameter, or its fp32 master
    where `half` keeps the parameters in half precision."""

    def __init__(self, view, model, synced, optimizer, tied: Optional[TiedSync], half=None):
        super().__init__(optimizer, tied)
        self.view, self.model, self.synced, self.half = view, model, synced, half

    def _sync_segments(self):
        from .pipeline import allreduce_gradients

        allreduce_gradients(self.view, self.synced, self.model.segment_of)

    def stepped(self):
        return self.model.parameters() if self.half is None else self.half.masters()

    def masters(self):
        return () if self.half is None else self.half.masters()

    def end_step(self, skipped: bool):
        if self.half is not None and not skipped:
            self.half.refresh()


class Overlapped(AllReduce):
    def __init__(self, view, model, synced, optimizer, tied: Optional[TiedSync], bucket_mb: float, half=None):
        super().__init__(view, model, synced, optimizer, tied, half)
        from .overlap import OverlappedReducer

        # The hooks go on the parameters autograd accumulates into (the half weights'), the
        # buckets hold the gradients' holders (their masters).
        hook_on = {m: p for p, m in half.master.items()} if half is not None else None
        self.reducer = OverlappedReducer(view, synced, model.segment_of, bucket_mb, hook_on=hook_on)

    def start_step(self, micro_batches: int):
        self.reducer.start_step(micro_batches)

    def _sync_segments(self):
        self.reducer.finish()

    def close(self):
        self.reducer.close()


class ZeroOneSync(GradientSync):
    def __init__(self, zero, tied: Optional[TiedSync]):
        super().__init__(zero.optimizer, tied)
        self.zero = zero

    def start_step(self, micro_batches: int):
        self.zero.start_step(micro_batches)

    def _sync_segments(self):
        self.zero.finish_gradients()

    def finish(self):
        self._sync_segments()
        if self.tied is not None:
            # Outside ZeRO: every holder steps its own master of the tied matrix, which takes
            # the fp32 sum as it is (never rounded to the half weights' type).
            self.zero.tied_gradients(self.tied.params, self.tied.sums())

    def stepped(self):
        return self.zero.masters()

    def masters(self):
        return self.zero.masters()

    def end_step(self, skipped: bool):
        self.zero.finish_step(skipped)


SAVE_GRADS_ZERO1 = ("--save-grads: not with ZeRO-1 (--zero1 or the plan's zero1): each gradient lives only on its "
                    "owner; drop one of them")


SAVE_GRADS_HALF = ("--save-grads: not with --half-weights (the gradients are summed into the fp32 masters as "
                   "they come); drop one of them")


def gradient_sync(view, model, *, zero1: bool, overlap: bool, bucket_mb: float, half: Optional[torch.dtype],
                  make_optimizer: Callable[[object], object], save_grads: bool = False,
                  optimizer=None, half_weights=None) -> GradientSync:
    """The plan's and flags' way for this rank. Every rank calls it in the same order: the tied
    group is a new process group. `optimizer`: the one to keep (a new membership's sync, over
    the same parameters and their state) instead of a new one. `half_weights`: the model's
    `HalfWeights` (not with ZeRO-1, which keeps half weights its own way)."""
    tied = tied_group(view, model)
    synced = [(n, p) for n, p in model.named_parameters() if tied is None or n not in tied.names]
    if half_weights is not None and not zero1:
        if save_grads:
            raise PlanError(SAVE_GRADS_HALF)
        synced = [(n, half_weights.master[p]) for n, p in synced]
        if tied is not None:
            # The tied matrix's sum in fp32 (`TiedSync.sums`) goes to the masters as it is.
            tied.params = [half_weights.master[p] for p in tied.params]
        if optimizer is None:
            optimizer = make_optimizer(half_weights.masters())
        if overlap:
            return Overlapped(view, model, synced, optimizer, tied, bucket_mb, half=half_weights)
        return AllReduce(view, model, synced, optimizer, tied, half=half_weights)
    if zero1:
        from .zero import ZeroOne

        if save_grads:
            raise PlanError(SAVE_GRADS_ZERO1)
        tied_params: List[torch.nn.Parameter] = tied.params if tied is not None else []
        zero = ZeroOne(view, model, synced, tied_params, half, make_optimizer, bucket_mb, overlap=overlap)
        return ZeroOneSync(zero, tied)
    if optimizer is None:
        optimizer = make_optimizer(model.parameters())
    if overlap:
        return Overlapped(view, model, synced, optimizer, tied, bucket_mb)
    return AllReduce(view, model, synced, optimizer, tied)
