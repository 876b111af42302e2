"""ZeRO-1 (`--zero1`, or the plan's `zero1`): the fp32 master weights and AdamW state of each
layer segment are sharded over the segment's dp ring (`RankView.segments`: every GPU holding
those layers at this TP rank, in every replica), as the cost model prices it
(`solver/src/cost.rs`, bytes per parameter).

The shard is a run of whole checkpoint blocks (the embedding, each layer, the head): the ring's
blocks, in model order, are cut into one contiguous run per member so that the largest run is
as small as it can be (`partition`). Whole blocks keep the checkpoint layer-wise: the owner of
a block writes its model and optimizer units from its fp32 master, nobody gathers anything,
and a restore onto another dp simply re-cuts the runs and each rank reads the optimizer units
of the blocks it now owns (docs/checkpoint.md, "ZeRO-1").

One step:
- the backward pass accumulates each parameter's gradient as usual (in the compute type when
  the model is stored in half precision, below);
- buckets of at most `bucket_mb`, each holding parameters of one owner, are SUM-reduced in
  fp32 onto their owner (`dist.reduce`, the reduce-scatter at block granularity), launched from
  the post-accumulate hooks as soon as their last gradient is final, during the backward pass;
  the local gradients are dropped at launch;
- the owner steps AdamW on its fp32 masters;
- each bucket's updated parameters are broadcast from their owner (the all-gather at block
  granularity).
reduce + broadcast move as many bytes as the all-reduce they replace (ZeRO, Rajbhandari et al.
2020, sec. 7), and each element is summed over the same members, so the losses equal the
unsharded run's.

With `--dtype bf16|fp16` the model's own parameters are stored in that type (the forward runs
on them under autocast) and only the owner keeps an fp32 master, so a rank holds 2 bytes of
weights per parameter, its gradients, and 12/dp of master and optimizer state. With fp32 the
master is the parameter itself. A tied embedding/head held by two stages
(`gradient_sync.TiedSync`, summed in fp32) is outside ZeRO: every holder keeps its master and
optimizer state. On a one-stage replica the tied head is the embedding, and its block goes to the
embedding's owner. `--save-params` / `--save-hf` export the masters (`export_masters`).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..components.checkpoint import block_of
from .overlap import HookedBuckets, _Bucket


def block_order(block) -> tuple:
    """Model order: the embedding, the layers, the head."""
    if block == "embed":
        return (0, 0)
    if block == "head":
        return (2, 0)
    return (1, block)


def partition(sizes: Sequence[int], parts: int) -> List[int]:
    """The part (0..parts-1) of each item: contiguous runs, in order, whose largest total is as
    small as it can be (binary search on that total; each run packed greedily). Runs may be
    empty at the end when there are fewer items than parts."""
    if parts < 1:
        raise ValueError("parts must be at least 1")
    if not sizes:
        return []

    def pack(cap: int) -> Optional[List[int]]:
        out, part, used = [], 0, 0
        for s in sizes:
            if used + s > cap and used > 0:
                part, used = part + 1, 0
            if part >= parts:
                return None
            out.append(part)
            used += s
        return out

    lo, hi = max(sizes), sum(sizes)
    while lo < hi:
        mid = (lo + hi) // 2
        if pack(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    return pack(lo)


class ZeroOne(HookedBuckets):
    """The rank's side of ZeRO-1. `sharded`: (name, parameter) synchronised over the segment
    rings; `tied`: parameters outside ZeRO (every holder keeps their state)."""

    def __init__(self, view, model, sharded, tied: Sequence[torch.nn.Parameter], half: Optional[torch.dtype],
                 make_optimizer, bucket_mb: float, overlap: bool = True):
        if bucket_mb <= 0:
            raise ValueError("bucket_mb must be positive")
        super().__init__()
        self.view, self.model, self.overlap, self.half = view, model, overlap, half
        limit = int(bucket_mb * 2**20)
        tied_ids = {id(p) for p in tied}
        # Blocks of each segment (all of the rank's parameters, tied ones too, so that every
        # block has an owner who writes it), and their sharded sizes.
        seg_blocks: Dict[int, Dict[object, int]] = {}
        name_block = {}
        for name, p in model.named_parameters():
            seg = self._segment(model.segment_of(name))
            b = block_of(name)
            name_block[name] = (seg, b)
            sizes = seg_blocks.setdefault(seg, {})
            sizes[b] = sizes.get(b, 0) + (0 if id(p) in tied_ids else p.numel())
        self.block_owner: Dict[object, int] = {}  # block -> owning global rank (in its ring)
        self.ring_of: Dict[object, tuple] = {}  # block -> (ring size, owner's index in the ring)
        # A tied head on the embedding's stage is the embedding (`GPTStage.tied_here`): its `head`
        # unit holds `embed.weight` (docs/checkpoint.md), written from the embedding's master, so
        # the head block goes with the embedding to the embedding's owner. Only when the
        # embedding is sharded, i.e. every replica has one stage (else it is tied, outside ZeRO),
        # so every member of the ring cuts its blocks alike.
        with_embed = (getattr(model, "tied_here", False) and id(model.embed.weight) not in tied_ids
                      and name_block["embed.weight"][0] == self._segment(model.segment_of("head.weight")))
        for seg, sizes in seg_blocks.items():
            members = view.segments[seg].ranks if view.segments[seg].group is not None else [view.rank]
            merged = with_embed and seg == name_block["embed.weight"][0]
            blocks = sorted((b for b in sizes if not (merged and b == "head")), key=block_order)
            cut = [sizes[b] + (sizes["head"] if merged and b == "embed" else 0) for b in blocks]
            for b, part in zip(blocks, partition(cut, len(members))):
                self.block_owner[b] = members[part]
                self.ring_of[b] = (len(members), part)
            if merged:
                self.block_owner["head"], self.ring_of["head"] = self.block_owner["embed"], self.ring_of["embed"]
        # fp32 masters of what this rank updates: its blocks' sharded parameters and the tied ones.
        self.master: Dict[torch.nn.Parameter, torch.nn.Parameter] = {}
        self.local: List[torch.nn.Parameter] = []  # sharded, but the rank is its ring alone
        by_seg: Dict[int, List[tuple]] = {}
        for name, p in sharded:
            by_seg.setdefault(name_block[name][0], []).append((name, p))
        for seg, named in sorted(by_seg.items()):
            group = view.segments[seg].group
            if group is None:
                self.local.extend(p for _, p in named)
                continue
            cur, size, owner = [], 0, None
            for name, p in reversed(named):  # the order the backward pass finishes them
                o = self.block_owner[name_block[name][1]]
                n = p.numel() * 4
                if cur and (o != owner or size + n > limit):
                    self._add(group.pg, cur, owner)
                    cur, size = [], 0
                cur.append(p)
                owner = o
                size += n
            if cur:
                self._add(group.pg, cur, owner)
        for name, p in model.named_parameters():
            if id(p) in tied_ids or self.block_owner[name_block[name][1]] == view.rank:
                self.master[p] = p if half is None else torch.nn.Parameter(p.detach().float().clone())
        if half is not None:
            with torch.no_grad():
                for p in model.parameters():
                    p.data = p.data.to(half)
        self.optimizer = make_optimizer(list(self.master.values()))
        self._register_hooks()

    def _segment(self, layer: int) -> int:
        for i, s in enumerate(self.view.segments):
            if s.layers[0] <= layer < s.layers[1]:
                return i
        raise RuntimeError(f"layer {layer} is in none of the rank's segments")

    # ---- what the checkpoint needs ----------------------------------------------------------

    def owns(self, block) -> bool:
        """This rank writes the block's units (its model and optimizer state)."""
        return self.block_owner.get(block) == self.view.rank

    def sharding(self, block) -> dict:
        size, index = self.ring_of[block]
        return {"kind": "zero1", "dp": size, "dp_rank": index}

    # ---- one step ---------------------------------------------------------------------------

    def start_step(self, micro_batches: int):
        """Before the step's first backward (with --no-overlap the hooks launch nothing)."""
        super().start_step(micro_batches if self.overlap else 0)

    def _launch(self, b: _Bucket):
        b.flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                            for p in b.params])
        for p in b.params:
            p.grad = None
        b.work = dist.reduce(b.flat, dst=b.owner, op=dist.ReduceOp.SUM, group=b.group, async_op=True)
        self.launched.append(b)

    def finish_gradients(self):
        """After the step's last backward: launch what no hook did, wait for every bucket; the
        owner's masters get the fp32 sums, everyone else's copies are dropped."""
        self._launch_rest()
        me = self.view.rank
        for b in self.launched:
            b.work.wait()
            if b.owner == me:
                off = 0
                for p in b.params:
                    n = p.numel()
                    self.master[p].grad = b.flat[off:off + n].view(p.shape)
                    off += n
            b.work, b.flat = None, None
        for p in self.local:
            self._to_master(p)

    def tied_gradients(self, params: Sequence[torch.nn.Parameter], sums: Sequence[torch.Tensor]):
        """After the tied matrix's own sum (`TiedSync.sums`, fp32): the sums to the masters."""
        for p, g in zip(params, sums):
            self.master[p].grad = g
            if self.master[p] is not p:
                p.grad = None

    def _to_master(self, p: torch.nn.Parameter):
        m = self.master[p]
        if m is not p:
            m.grad = p.grad.float() if p.grad is not None else None
            p.grad = None

    def masters(self) -> List[torch.nn.Parameter]:
        return list(self.master.values())

    def finish_step(self, skipped: bool):
        """After the optimizer step (or its skip, the same on every rank): the model's
        parameters take the owners' updated masters."""
        for p in self.model.parameters():
            p.grad = None
        for m in self.master.values():
            m.grad = None
        if skipped:
            return
        with torch.no_grad():
            for p, m in self.master.items():
                if m is not p:
                    p.copy_(m)
        me = self.view.rank
        works = []
        for b in self.buckets:
            if b.owner == me:
                flat = torch.cat([p.detach().reshape(-1) for p in b.params])
            else:
                flat = torch.empty(sum(p.numel() for p in b.params), dtype=b.params[0].dtype,
                                   device=b.params[0].device)
            works.append((b, flat, dist.broadcast(flat, src=b.owner, group=b.group, async_op=True)))
        with torch.no_grad():
            for b, flat, w in works:
                w.wait()
                if b.owner != me:
                    off = 0
                    for p in b.params:
                        n = p.numel()
                        p.copy_(flat[off:off + n].view(p.shape))
                        off += n

    def export_masters(self, writes: bool) -> Optional[Dict[str, torch.Tensor]]:
        """Collective over every ring (every rank calls it, after the last step): the fp32
        masters, by parameter name, on the CPU of a rank that `writes` the stage's full tensors
        (`--save-params`, `--save-hf`), so the export is the masters, not the half weights
        (python/README.md, "ZeRO-1"); None elsewhere, and with fp32 weights, which are the
        masters. Each bucket's owner broadcasts its masters over the ring, one bucket at a time."""
        if self.half is None:
            return None
        names = {p: n for n, p in self.model.named_parameters()}
        out: Dict[str, torch.Tensor] = {}
        me = self.view.rank
        for b in self.buckets:
            if b.owner == me:
                flat = torch.cat([self.master[p].detach().reshape(-1) for p in b.params])
            else:
                flat = torch.empty(sum(p.numel() for p in b.params), dtype=torch.float32, device=b.params[0].device)
            dist.broadcast(flat, src=b.owner, group=b.group)
            if writes:
                off = 0
                for p in b.params:
                    out[names[p]] = flat[off:off + p.numel()].view(p.shape).cpu()
                    off += p.numel()
        if not writes:
            return None
        # The rest: masters kept here (rings of one member, the tied matrix's holders).
        for p, m in self.master.items():
            out.setdefault(names[p], m.detach().cpu())
        return out

    def memory(self) -> dict:
        """Bytes of masters kept beside the model's parameters, and of master gradients."""
        sep = [m for p, m in self.master.items() if m is not p]
        return {"masters": sum(m.numel() * m.element_size() for m in sep)}
