"""A lost replica rejoins from its peers' live state (docs/keep-going.md, "Back to full
strength").

When a lost replica's node is back, the coordinator opens an epoch whose members include the
replica again, named in the membership's `joining`, and the agent starts the replica's ranks
afresh in the same launch. Such a rank cannot meet the launch's default process group (the
others formed it at launch and never meet in it again), so everything it uses comes from the
epoch's store: its TP groups at start (`join_view`), then the epoch's groups like every member's
(`keep_going.KeepGoing.move`). Before its first step each of its layer segments' weights and
AdamW state is copied over the segment's gradient ring from the ring's lowest rank that holds
the job's state (`copy_live_state`), the tied embedding/head matrix over its own group; the
trainer's scalars (the step, the loss scale) come through the store. Nobody else stops or
restores: the members move to the epoch at a step boundary and go on at full strength.

A copy is one all-reduce per ring in which only the source adds its values (every other rank
adds zeros): exact, and the same call on every backend and group this package already makes.
"""

from __future__ import annotations

import datetime
import os
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist

from ..plan import Plan
from .membership import ENV, Membership, joiner_tp_groups, read


def joining(plan: Plan, rank: int) -> Optional[Membership]:
    """The membership this rank joins, when the agent started it to rejoin: keep-going on
    (MOTLEY_KEEP_GOING=1), a membership file there already, and its replica among `joining`.
    None for a rank of the launch's start."""
    if os.environ.get("MOTLEY_KEEP_GOING") != "1" or not os.environ.get(ENV):
        return None
    m = read(os.environ[ENV], plan)
    if m is None or plan.ranks[rank].replica not in m.joining:
        return None
    return m


def join_view(plan: Plan, m: Membership, timeout_s: float):
    """The rank's view before it joins epoch `m`: the plan's place, its TP groups made among its
    replica's ranks from the epoch's store, every other group still to come from the epoch
    (`KeepGoing.move`). Returns (view, the store's client)."""
    from .groups import Group, _check_env_against_plan, _env_int, _view, RankEnvError, group_on_store

    rank = _env_int("RANK")
    place = plan.ranks[rank]
    _check_env_against_plan(plan, place)
    cuda = torch.cuda.is_available()
    if cuda:
        device = torch.device("cuda", 0 if torch.cuda.device_count() == 1 else place.gpu)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = "nccl" if cuda else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    tcp = dist.TCPStore(m.store_host, m.store_port, None, False, timeout, wait_for_workers=False)
    # The plan's groups, none made: the view finds its places in them.
    groups = [Group(g.index, g.kind, list(g.ranks), g.layers, g.replica, g.stage) for g in plan.comm_groups]
    view = _view(plan, place, rank, plan.world_size, device, backend, groups)
    store = dist.PrefixStore(f"motley/keep-going/{m.epoch}/join", tcp)
    for g in joiner_tp_groups(plan, place.replica):
        if rank not in g.ranks:
            continue
        pg = group_on_store(store, g.key, g.ranks.index(rank), len(g.ranks), backend, timeout)
        view.tp_group = Group(-1, "tp", list(g.ranks), g.layers, place.replica, place.stage, pg=pg)
    if len(view.tp_ranks) > 1 and (view.tp_group is None or view.tp_group.pg is None):
        raise RankEnvError(f"rank {rank}: no TP group of its replica to join in epoch {m.epoch}")
    view.epoch, view.leader = m.epoch - 1, m.leader
    return view, tcp


def _state_of(optimizer, p) -> Dict[str, torch.Tensor]:
    st = optimizer.state.get(p)
    if not st:
        raise RuntimeError("rejoin: a parameter without AdamW state (the trainer makes it at start)")
    return st


def _copy(params: Sequence[torch.nn.Parameter], optimizer, pg, source: bool, receive: bool, view) -> int:
    """One flat buffer of `params`' values, AdamW moments and steps, all-reduced over `pg` with
    only the source's values in it. Returns the bytes this rank took."""
    parts: List[torch.Tensor] = []
    for p in params:
        st = _state_of(optimizer, p)
        for t in (p.detach(), st["exp_avg"], st["exp_avg_sq"], st["step"].reshape(1)):
            parts.append(t.reshape(-1).to(device=view.device, dtype=torch.float32))
    flat = torch.cat(parts) if source else torch.zeros(sum(t.numel() for t in parts), dtype=torch.float32,
                                                        device=view.device)
    view.wait(dist.all_reduce(flat, group=pg, async_op=True))
    if not receive:
        return 0
    off = 0
    with torch.no_grad():
        for p in params:
            st = _state_of(optimizer, p)
            for t in (p.data, st["exp_avg"], st["exp_avg_sq"], st["step"]):
                n = t.numel()
                t.copy_(flat[off:off + n].view(t.shape).to(t.dtype))
                off += n
    return flat.numel() * flat.element_size()


def copy_live_state(view, named_params, segment_of, optimizer, joiners: Set[int],
                    tied: Optional[Tuple[object, List[int], Sequence[torch.nn.Parameter]]]) -> int:
    """Every layer segment's weights and AdamW state from the lowest rank of its ring that is
    not joining to the joining ranks of the ring (`named_params`: what the rings sum, in the
    order every holder lists them); then the tied matrix (`tied`: its group, its holders, this
    rank's copies) the same way. Collective over every ring holding a joining rank. Returns the
    bytes this rank took."""
    from .pipeline import segment_params

    taken = 0
    mine = view.rank in joiners
    for i, params in sorted(segment_params(view, named_params, segment_of).items()):
        seg = view.segments[i]
        if seg.group is None or not joiners.intersection(seg.ranks):
            continue
        source = min(r for r in seg.ranks if r not in joiners)
        taken += _copy(params, optimizer, seg.group.pg, view.rank == source, mine, view)
    if tied is not None:
        pg, holders, params = tied
        if pg is not None and joiners.intersection(holders):
            source = min(r for r in holders if r not in joiners)
            taken += _copy(params, optimizer, pg, view.rank == source, mine, view)
    return taken


REJOINED_ENV = "MOTLEY_REJOINED"


def tell_rejoined(record: dict) -> None:
    """Say what this joining rank copied: a `motley-rejoined` line in its log, and the file its
    agent reads and reports (MOTLEY_REJOINED, `rank-R.rejoined`: epoch, bytes, seconds,
    copy_seconds), whose report lets the coordinator call the job whole again and record its
    `rejoined` event (docs/keep-going.md). Written whole or not at all."""
    import json
    import sys

    print("motley-rejoined " + json.dumps(record, sort_keys=True), file=sys.stderr, flush=True)
    path = os.environ.get(REJOINED_ENV)
    if not path:
        return
    from ..components.checkpoint import write_atomic

    told = {k: record[k] for k in ("epoch", "bytes", "seconds", "copy_seconds")}
    write_atomic(path, json.dumps(told).encode())
