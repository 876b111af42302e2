"""1F1B pipeline schedule over a plan's hops, and the gradient rings.

A replica with P stages runs its M micro-batches 1F1B: stage s does min(P-s-1, M) warm-up
forwards, then alternates one forward and one backward, then drains the backwards. Replicas
may have different P and M (uneven batch shares); nothing couples them until the gradient
rings.

A hop joins stage s (dp TP-groups) and stage s+1 (dp' TP-groups), whose dp may differ. For
every pair (sender slice d, receiver slice e) whose rows of the micro-batch overlap, TP rank j
of sender group d sends the overlapping rows to TP rank j of receiver group e over the hop's
pp group; gradients go back over the same pairs. Sends are non-blocking (kept until the step
ends); a forward or backward waits for its receives, which with the 1F1B order cannot deadlock.

Receives posted ahead (gloo): gloo moves a message only once its receive is posted (a send waits
for the peer's "ready to receive"), so a receive posted when the rank needs it exposes the whole
transfer on the rank's path. Over gloo the step posts each kind of receive (activations from the
previous stage, gradients from the next) `RECV_AHEAD` micro-batches ahead of its use, from the
step's start, so a hop's transfer runs while the rank computes. Over NCCL receives are posted
when needed: the host does not wait there (a wait orders the streams), and a receive posted
ahead of a send on the same pair's stream can deadlock the two ranks.

Loss scaling: a last-stage rank's loss is the sum of its tokens' cross-entropy over
(global_batch * seq_len), i.e. its local mean times its share of the samples; summing the
gradients of every rank holding a layer segment (SUM all-reduce over the segment's dp ring)
then gives exactly the gradient of the global mean loss, however unevenly the replicas share
the batch.

Timing (optional, the trainer's --timings): with `Pipeline.timings` set to a `StepTimings`,
every forward and backward records the wall and the thread-CPU milliseconds of its receive
wait, its compute and its send; unset (the default) the step runs no timing code at all.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .groups import RankView

# How many micro-batches ahead of its use a receive is posted over gloo (module docstring).
RECV_AHEAD = 2


def one_f_one_b(num_stages: int, stage: int, num_micro: int) -> List[Tuple[str, int]]:
    """The order in which `stage` runs forwards ("F", k) and backwards ("B", k)."""
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} outside [0, {num_stages})")
    warm = min(num_stages - stage - 1, num_micro)
    out = [("F", k) for k in range(warm)]
    for i in range(num_micro - warm):
        out.append(("F", warm + i))
        out.append(("B", i))
    out.extend(("B", k) for k in range(num_micro - warm, num_micro))
    return out


def clock() -> Tuple[float, float]:
    """(wall seconds, this thread's CPU seconds)."""
    return time.perf_counter(), time.thread_time()


class StepTimings:
    """Per-micro-batch timing of one rank's pipeline step. `ops` gets one dict per forward
    ("F") or backward ("B"): micro-batch `mb`, and for each phase (`recv`: blocking receives of
    activations or gradients, `compute`: the stage's forward (with the loss on the last stage)
    or backward, `send`: posting the non-blocking sends) its wall ms (`recv_ms`, ...) and the
    calling thread's CPU ms (`recv_cpu_ms`, ...)."""

    def __init__(self):
        self.ops: List[dict] = []

    def record(self, what: str, k: int, t0, t1, t2, t3):
        d = {"op": what, "mb": k}
        for name, a, b in (("recv", t0, t1), ("compute", t1, t2), ("send", t2, t3)):
            d[f"{name}_ms"] = (b[0] - a[0]) * 1e3
            d[f"{name}_cpu_ms"] = (b[1] - a[1]) * 1e3
        self.ops.append(d)


class Pipeline:
    """Runs one training step's forwards and backwards for one rank."""

    def __init__(self, view: RankView, model: torch.nn.Module, hidden: int, seq_len: int, dtype=torch.float32):
        self.v, self.model, self.hidden, self.seq_len, self.dtype = view, model, hidden, seq_len, dtype
        plan = view.plan
        rep = plan.replicas[view.replica]
        st = rep.stages[view.stage]
        j, d = view.tp_rank, view.stage_dp_rank
        lo, _ = plan.dp_slice(st, d)
        self.my_lo = lo
        # (peer global rank, rows [a, b) of the micro-batch) per neighbour, in row order.
        self.recv_from: List[Tuple[int, Tuple[int, int]]] = []
        self.send_to: List[Tuple[int, Tuple[int, int]]] = []
        if view.stage > 0:
            prev = rep.stages[view.stage - 1]
            for ds, e, rows in plan.hop_pairs(view.replica, view.stage - 1):
                if e == d:
                    self.recv_from.append((prev.ranks[ds * prev.tp + j], rows))
        if view.stage + 1 < len(rep.stages):
            nxt = rep.stages[view.stage + 1]
            for ds, e, rows in plan.hop_pairs(view.replica, view.stage):
                if ds == d:
                    self.send_to.append((nxt.ranks[e * nxt.tp + j], rows))
        self.pending = []
        self.recv_ahead = RECV_AHEAD if view.backend == "gloo" else 0
        # Receives posted and not yet taken, by (kind "F" activations | "B" gradients, micro-batch);
        # the next micro-batch of each kind to post. Reset at each step's start.
        self._posted: Dict[Tuple[str, int], list] = {}
        self._next_post = {"F": 0, "B": 0}
        self.timings: Optional[StepTimings] = None  # set to time the micro-batches
        # The forward passes run under it (precision.autocast: torch.autocast for bf16/fp16).
        self.autocast = contextlib.nullcontext

    def _pg(self, g):
        return g.pg if g is not None else None

    @staticmethod
    def _peer(group, rank: int) -> dict:
        """A peer named as torch needs it: by global rank in the plan's groups, by its place in
        an epoch's (made outside torch's registry: `keep_going`)."""
        if group is not None and group.index < 0:
            return {"group_peer": sorted(group.ranks).index(rank)}
        return {"rank": rank}

    def _send(self, t: torch.Tensor, dst: int, group):
        t = t.detach().to(self.dtype).contiguous()
        peer = self._peer(group, dst)
        if "group_peer" in peer:
            w = dist.isend(t, group=self._pg(group), group_dst=peer["group_peer"])
        else:
            w = dist.isend(t, dst=dst, group=self._pg(group))
        self.pending.append((w, t))

    def _post_recv(self, shape, src: int, group):
        t = torch.empty(shape, dtype=self.dtype, device=self.v.device)
        peer = self._peer(group, src)
        if "group_peer" in peer:
            w = dist.irecv(t, group=self._pg(group), group_src=peer["group_peer"])
        else:
            w = dist.irecv(t, src=src, group=self._pg(group))
        return w, t

    def _start_receives(self, num_micro: int, kinds=("F", "B")):
        """A step's start: nothing posted yet; over gloo, the first receives of each kind."""
        self._posted, self._next_post = {}, {"F": 0, "B": 0}
        for kind in kinds:
            self._post_until(kind, min(num_micro, self.recv_ahead) - 1)

    def _post_until(self, kind: str, last: int):
        """Post the receives of `kind` for every micro-batch up to `last`, in order (a pair's
        messages match in the order posted)."""
        peers, group = (self.recv_from, self.v.pp_prev_group) if kind == "F" else (self.send_to, self.v.pp_next_group)
        if not peers:
            return
        while self._next_post[kind] <= last:
            k = self._next_post[kind]
            self._posted[(kind, k)] = [self._post_recv((b - a, self.seq_len, self.hidden), src, group)
                                       for src, (a, b) in peers]
            self._next_post[kind] = k + 1

    def _receive(self, kind: str, k: int, num_micro: int) -> List[torch.Tensor]:
        """Micro-batch k's tensors of `kind`, one per peer in row order, once they are here;
        posts the receives `recv_ahead` micro-batches beyond it first."""
        self._post_until(kind, min(num_micro - 1, k + self.recv_ahead))
        out = []
        for w, t in self._posted.pop((kind, k)):
            # Waited for as the view says: under keep-going, in slices that give up when a newer
            # membership is out (a peer of this replica gave up on the step).
            self.v.wait(w)
            out.append(t)
        return out

    def step(self, micro: List[Tuple[torch.Tensor, torch.Tensor]], loss_scale: float) -> float:
        """Forward and backward every micro-batch (inputs, targets of this rank's rows; only
        the first stage reads inputs, only the last targets). Returns the sum of this rank's
        scaled losses, on the device, unread (0.0 unless last stage): the caller decides when
        the host waits for it.

        The whole step runs inside one disabled autocast context: autocast keeps its casts of
        the weights until the outermost context exits, so every micro-batch's forward reuses
        one half copy of each fp32 weight instead of each in-flight micro-batch's graph
        holding its own (the weights change only after the step); nothing outside the
        forwards runs under autocast."""
        with torch.autocast(device_type=self.v.device.type, enabled=False):
            return self._step(micro, loss_scale)

    def _step(self, micro: List[Tuple[torch.Tensor, torch.Tensor]], loss_scale: float) -> float:
        v = self.v
        order = one_f_one_b(v.pp_size, v.stage, len(micro))
        n = len(micro)
        self._start_receives(n)
        saved: Dict[int, tuple] = {}
        total: Optional[torch.Tensor] = None
        tm = self.timings
        for what, k in order:
            if tm is not None:
                t0 = clock()
            if what == "F":
                x_in = None
                if v.is_first_stage:
                    x = micro[k][0].to(v.device)
                else:
                    parts = self._receive("F", k, n)
                    x_in = torch.cat(parts) if len(parts) > 1 else parts[0]
                    x_in.requires_grad_()
                    x = x_in
                if tm is not None:
                    t1 = clock()
                if v.is_last_stage:
                    tgt = micro[k][1].to(v.device)
                    with self.autocast():
                        loss = self.model.loss(x, tgt, grad_scale=loss_scale)
                    out = loss * loss_scale
                    # Summed on the device: a float() here would make the host wait for every
                    # micro-batch's kernels before launching the next.
                    total = out.detach() if total is None else total + out.detach()
                    if tm is not None:
                        t2 = clock()
                else:
                    with self.autocast():
                        out = self.model(x)
                    if tm is not None:
                        t2 = clock()
                    for dst, (a, b) in self.send_to:
                        self._send(out[a - self.my_lo : b - self.my_lo], dst, v.pp_next_group)
                saved[k] = (x_in, out)
            else:
                x_in, out = saved.pop(k)
                if v.is_last_stage:
                    if tm is not None:
                        t1 = clock()
                    out.backward()
                else:
                    parts = self._receive("B", k, n)
                    if len(parts) == 1 and parts[0].shape == out.shape:
                        grad = parts[0]
                    else:
                        grad = torch.empty_like(out)
                        for t, (_, (a, b)) in zip(parts, self.send_to):
                            grad[a - self.my_lo : b - self.my_lo] = t
                    if tm is not None:
                        t1 = clock()
                    torch.autograd.backward(out, grad)
                if tm is not None:
                    t2 = clock()
                if x_in is not None:
                    off = self.my_lo
                    for src, (a, b) in self.recv_from:
                        self._send(x_in.grad[a - off : b - off], src, v.pp_prev_group)
            if tm is not None:
                tm.record(what, k, t0, t1, t2, clock())
        return total if total is not None else 0.0

    def evaluate(self, micro: List[Tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Forward only, every micro-batch in order (no 1F1B: nothing waits on a backward):
        returns this rank's summed token cross-entropy (0 unless last stage); targets of -100
        (padding) count for nothing."""
        v = self.v
        total = 0.0
        n = len(micro)
        self._start_receives(n, kinds=("F",))
        with torch.no_grad():
            for k, (inputs, targets) in enumerate(micro):
                if v.is_first_stage:
                    x = inputs.to(v.device)
                else:
                    parts = self._receive("F", k, n)
                    x = torch.cat(parts) if len(parts) > 1 else parts[0]
                if v.is_last_stage:
                    with self.autocast():
                        total += float(self.model.loss(x, targets.to(v.device)))
                else:
                    with self.autocast():
                        out = self.model(x)
                    for dst, (a, b) in self.send_to:
                        self._send(out[a - self.my_lo : b - self.my_lo], dst, v.pp_next_group)
        self.finish()
        return total

    def finish(self):
        for w, _ in self.pending:
            self.v.wait(w)
        self.pending = []


def segment_params(view: RankView, named_params, segment_of: Callable[[str], int]) -> Dict[int, List[torch.nn.Parameter]]:
    """The parameters of each of the rank's layer segments (index into view.segments), in the
    order given."""
    by_seg: Dict[int, List[torch.nn.Parameter]] = {}
    for name, p in named_params:
        layer = segment_of(name)
        for i, s in enumerate(view.segments):
            if s.layers[0] <= layer < s.layers[1]:
                by_seg.setdefault(i, []).append(p)
                break
        else:
            raise RuntimeError(f"parameter {name} (layer {layer}) is in none of the rank's segments")
    return by_seg


def allreduce_gradients(view: RankView, named_params, segment_of: Callable[[str], int]):
    """SUM each layer segment's gradients over its dp ring (one flat buffer per segment)."""
    for i, params in sorted(segment_params(view, named_params, segment_of).items()):
        seg = view.segments[i]
        if seg.group is None:
            continue
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        view.wait(dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=seg.group.pg, async_op=True))
        off = 0
        for p in params:
            n = p.numel()
            g = flat[off : off + n].view_as(p)
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
            off += n
