"""Gradient synchronisation overlapped with the backward pass (Espresso's eq. 8-9: only what
is left after the earlier stages' backward is exposed).

Each layer segment's gradients are SUM-reduced over the segment's dp ring (the ring holds every
GPU with the same layers and TP shard, `RankView.segments`), in buckets of at most `bucket_mb`
MiB. A parameter's gradient is final once the step's last micro-batch has gone backward
through it (`register_post_accumulate_grad_hook` counts the accumulations); a bucket is
launched (an asynchronous all-reduce, in fp32) as soon as every gradient in it is final, while
the backward of the earlier layers and micro-batches goes on. `finish()` waits for the buckets
and writes the sums back. Buckets are cut in reverse parameter order (the order the backward
pass finishes them), the same on every member of a ring, so every member launches the same
buckets in the same order. The sums are those of `schedule.allreduce_gradients` (the same
elements added), so the losses still equal the single process's.

Gradients as views of their bucket (fp32 parameters, the plain path's): each bucket keeps one
flat fp32 buffer, and every step starts with the buffer zeroed and each parameter's `.grad` a view
of its slice, so the backward pass accumulates straight into the buffer (autograd adds a
gradient into an existing `.grad` in place), the all-reduce runs on the buffer itself, and the
sums are the gradients: no copy into a bucket at launch and none back after it (torch DDP's
`gradient_as_bucket_view`). A bucket of other types (ZeRO-1's half weights) is copied as before.
On a CPU share those two copies of every gradient were most of what the gradient sync cost
beyond the ring itself (BENCHMARKS.md, "The gradient sync without copies").
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from .pipeline import segment_params


class _Bucket:
    def __init__(self, group, params: List[torch.nn.Parameter], owner: Optional[int] = None):
        self.group, self.params, self.owner = group, params, owner
        self.ready = 0
        self.work = None
        self.flat: Optional[torch.Tensor] = None
        # Gradients as views (module docstring): the flat buffer and each parameter's slice.
        self.buffer: Optional[torch.Tensor] = None
        self.views: List[torch.Tensor] = []

    def as_views(self):
        """Keep a flat fp32 buffer whose slices are the parameters' gradients."""
        p0 = self.params[0]
        self.buffer = torch.zeros(sum(p.numel() for p in self.params), dtype=torch.float32, device=p0.device)
        off = 0
        for p in self.params:
            self.views.append(self.buffer[off: off + p.numel()].view_as(p))
            off += p.numel()

    def attach(self):
        """A step's start: the buffer zeroed, every gradient its view."""
        self.buffer.zero_()
        for p, v in zip(self.params, self.views):
            p.grad = v

    def gather(self):
        """At launch: any gradient that is not its view (something replaced `.grad`) copied
        into it, so the buffer holds every gradient."""
        for p, v in zip(self.params, self.views):
            if p.grad is None:
                p.grad = v
            elif p.grad.data_ptr() != v.data_ptr():
                v.copy_(p.grad)
                p.grad = v


class HookedBuckets:
    """Buckets of parameters, each launched (`_launch`, the subclass's collective) from
    `register_post_accumulate_grad_hook` as soon as the step's last micro-batch has gone
    backward through every parameter in it. `start_step(0)` launches nothing from the hooks
    (the caller launches after the backward pass)."""

    def __init__(self):
        self.buckets: List[_Bucket] = []
        self.bucket_of: Dict[torch.nn.Parameter, _Bucket] = {}
        self.counts: Dict[torch.nn.Parameter, int] = {}
        self.expected = 0
        self.launched: List[_Bucket] = []
        self.handles: List[object] = []

    def _add(self, group, params, owner: Optional[int] = None):
        b = _Bucket(group, params, owner)
        self.buckets.append(b)
        for p in params:
            self.bucket_of[p] = b

    def _register_hooks(self, hook_on: Optional[Dict[torch.nn.Parameter, torch.nn.Parameter]] = None):
        """A hook on each parameter autograd accumulates into: the bucketed tensor itself, or
        the one `hook_on` names for it (a half weight, whose fp32 master the bucket holds)."""
        for p in self.bucket_of:
            target = hook_on.get(p, p) if hook_on else p
            self.handles.append(target.register_post_accumulate_grad_hook(lambda _, held=p: self._hook(held)))

    def close(self):
        """Remove the hooks: the buckets are done with (a new membership's replace them)."""
        for h in self.handles:
            h.remove()
        self.handles = []

    def start_step(self, micro_batches: int):
        """Before the step's first backward: each gradient is final after this many."""
        self.expected = micro_batches
        self.counts = {}
        self.launched = []
        for b in self.buckets:
            b.ready, b.work, b.flat = 0, None, None

    def _hook(self, p: torch.nn.Parameter):
        if not self.expected:
            return
        c = self.counts.get(p, 0) + 1
        self.counts[p] = c
        if c == self.expected:
            b = self.bucket_of[p]
            b.ready += 1
            if b.ready == len(b.params):
                self._launch(b)

    def _launch_rest(self):
        """Launch, in bucket order, what no hook did."""
        for b in self.buckets:
            if b.work is None:
                self._launch(b)

    def _launch(self, b: _Bucket):
        raise NotImplementedError


class _Failed:
    """A bucket's collective that could not be launched: its error, raised when waited for."""

    def __init__(self, error: BaseException):
        self.error = error

    def wait(self, *_):
        raise self.error


class OverlappedReducer(HookedBuckets):
    def __init__(self, view, named_params, segment_of: Callable[[str], int], bucket_mb: float,
                 hook_on: Optional[Dict[torch.nn.Parameter, torch.nn.Parameter]] = None):
        if bucket_mb <= 0:
            raise ValueError("bucket_mb must be positive")
        super().__init__()
        self.view = view
        limit = int(bucket_mb * 2**20)
        by_seg = segment_params(view, named_params, segment_of)
        for i, params in sorted(by_seg.items()):
            seg = view.segments[i]
            if seg.group is None:
                continue
            cur, size = [], 0
            for p in reversed(params):
                n = p.numel() * 4
                if cur and size + n > limit:
                    self._add(seg.group.pg, cur)
                    cur, size = [], 0
                cur.append(p)
                size += n
            if cur:
                self._add(seg.group.pg, cur)
        for b in self.buckets:
            if all(p.dtype == torch.float32 and p.device == b.params[0].device for p in b.params):
                b.as_views()
        self._register_hooks(hook_on)

    def start_step(self, micro_batches: int):
        super().start_step(micro_batches)
        for b in self.buckets:
            if b.buffer is not None:
                b.attach()

    def _launch(self, b: _Bucket):
        if b.buffer is not None:
            b.gather()
            b.flat = b.buffer
        else:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in b.params]
            b.flat = torch.cat([g.reshape(-1).float() for g in grads])
        try:
            b.work = dist.all_reduce(b.flat, op=dist.ReduceOp.SUM, group=b.group, async_op=True)
        except RuntimeError as e:
            # Raised in `finish`, after the pipeline: from a hook it would leave this stage's
            # pipeline peers waiting for sends that never come (a ring broken by a lost replica).
            b.work = _Failed(e)
        self.launched.append(b)

    def finish(self):
        """After the step's last backward: launch what no hook did (in bucket order), wait for
        every bucket, write the sums into the gradients."""
        self._launch_rest()
        for b in self.launched:
            self.view.wait(b.work)
            if b.buffer is not None:
                b.work, b.flat = None, None  # the sums are the gradients (views of the buffer)
                continue
            off = 0
            for p in b.params:
                n = p.numel()
                g = b.flat[off : off + n].view_as(p).to(p.dtype)
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
                off += n
            b.work, b.flat = None, None
