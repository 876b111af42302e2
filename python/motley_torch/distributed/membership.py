"""A job's membership (docs/keep-going.md): which replicas train now, and how they split the
global batch.

A job of two or more replicas keeps going when one is lost: the coordinator opens a new epoch
whose members are the replicas with no rank on the lost node, re-splits the same global batch
among them with the planner's allocator, and its agents write the epoch's document where the
ranks look once per step (MOTLEY_MEMBERSHIP):

    {"epoch": 1, "replicas": [0, 2], "lost": [1], "micro_batches": {"0": 5, "2": 3},
     "store": {"host": "10.0.0.4", "port": 29503}, "leader": 0, "reason": "node b lost"}

`leader` is the first rank of a member replica that trains on (not `joining`; the lowest such as
a rule): it hosts the epoch's rendezvous store at `store` and prints the progress lines. `joining` (optional) names the
member replicas that come back: their ranks start afresh in the same launch and take their
layers' weights and optimizer state from the others' live state (`rejoin`). Epoch 0 is the plan
itself, met at MASTER_ADDR. This module is pure: the document, the members, the re-shared plan
and each epoch's groups' ranks; `keep_going` does the collectives.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from ..plan import Plan
from ..spec import PlanError

ENV = "MOTLEY_MEMBERSHIP"
# The most of a membership file a rank reads: a document for thousands of replicas fits.
LIMIT = 1 << 20


class MembershipError(PlanError):
    pass


@dataclass(frozen=True)
class Membership:
    epoch: int
    replicas: Tuple[int, ...]
    lost: Tuple[int, ...]
    micro_batches: Dict[int, int]
    store_host: Optional[str]
    store_port: Optional[int]
    leader: int
    reason: str = ""
    joining: Tuple[int, ...] = ()

    def to_doc(self) -> dict:
        """The document as the agent writes it (what `parse` reads): handed between ranks in an
        epoch's store, so that every member enters the same epoch whatever its own file holds."""
        doc = {"epoch": self.epoch, "replicas": list(self.replicas), "lost": list(self.lost),
               "micro_batches": {str(k): v for k, v in self.micro_batches.items()},
               "store": {"host": self.store_host, "port": self.store_port}, "leader": self.leader,
               "reason": self.reason}
        if self.joining:
            doc["joining"] = list(self.joining)
        return doc

    @staticmethod
    def initial(plan: Plan) -> "Membership":
        """Epoch 0: every replica, the plan's split, the job's own store."""
        return Membership(0, tuple(range(len(plan.replicas))), (), {r.index: r.micro_batches for r in plan.replicas},
                          None, None, 0)

    @staticmethod
    def parse(doc, plan: Plan, where: str) -> "Membership":
        """A membership document checked against the plan: every field named in the error."""
        if not isinstance(doc, dict):
            raise MembershipError(f"{where}: not a JSON object")

        def whole(key, minimum=0):
            v = doc.get(key)
            if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
                raise MembershipError(f"{where}.{key}: expected a whole number >= {minimum}, got {v!r}")
            return v

        epoch = whole("epoch", 1)
        n = len(plan.replicas)
        reps = doc.get("replicas")
        if not isinstance(reps, list) or not reps or not all(isinstance(r, int) and 0 <= r < n for r in reps):
            raise MembershipError(f"{where}.replicas: expected a non-empty list of the plan's replicas (0..{n - 1}), "
                                  f"got {reps!r}")
        lost = doc.get("lost", [])
        if not isinstance(lost, list) or not all(isinstance(r, int) and 0 <= r < n for r in lost):
            raise MembershipError(f"{where}.lost: expected a list of the plan's replicas, got {lost!r}")
        mbs = doc.get("micro_batches")
        if not isinstance(mbs, dict):
            raise MembershipError(f"{where}.micro_batches: expected an object of replica -> micro-batches")
        split: Dict[int, int] = {}
        for k, v in mbs.items():
            if not str(k).isdigit() or int(k) not in reps or isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise MembershipError(f"{where}.micro_batches.{k}: {v!r}; every member replica takes a whole "
                                      f"number >= 1 of micro-batches, and only members")
            split[int(k)] = v
        if sorted(split) != sorted(reps):
            raise MembershipError(f"{where}.micro_batches: names replicas {sorted(split)}, the members are "
                                  f"{sorted(reps)}")
        total = sum(split.values()) * plan.micro_batch
        if total != plan.global_batch:
            raise MembershipError(f"{where}.micro_batches: {total} samples, the plan's global_batch is "
                                  f"{plan.global_batch}: the members split the same global batch")
        store = doc.get("store")
        if not isinstance(store, dict) or not isinstance(store.get("host"), str) or not store["host"]:
            raise MembershipError(f"{where}.store.host: expected the host of the epoch's store")
        port = store.get("port")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise MembershipError(f"{where}.store.port: expected a port, got {port!r}")
        joining = doc.get("joining", [])
        if (not isinstance(joining, list) or not all(isinstance(r, int) and r in reps for r in joining)
                or len(set(joining)) == len(set(reps))):
            raise MembershipError(f"{where}.joining: expected a list of member replicas that come back, at least one "
                                  f"member training on; got {joining!r}")
        m = Membership(epoch, tuple(sorted(reps)), tuple(sorted(lost)), split, store["host"], port, whole("leader"),
                       str(doc.get("reason", "")), tuple(sorted(set(joining))))
        # The lowest rank of the members training on, as a rule; the coordinator passes over a
        # replica that was joining in the epoch before (it may hold no state yet), so any rank of
        # a member replica not joining may lead.
        leaders = {st.ranks[0] for r in m.replicas if r not in m.joining for st in plan.replicas[r].stages[:1]}
        if m.leader not in leaders:
            raise MembershipError(f"{where}.leader: {m.leader} is not the first rank of a member replica training on "
                                  f"(those are {sorted(leaders)})")
        return m


def read(path: Optional[str], plan: Plan) -> Optional[Membership]:
    """The membership file's document, or None while there is none (the plan's epoch 0)."""
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            raw = f.read(LIMIT + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise MembershipError(f"{ENV} ({path}): cannot read: {e.strerror}")
    if len(raw) > LIMIT:
        raise MembershipError(f"{ENV} ({path}): over {LIMIT} bytes; not a membership the agent wrote")
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise MembershipError(f"{ENV} ({path}): not JSON ({e})")
    return Membership.parse(doc, plan, f"{ENV} ({os.path.basename(path)})")


def members(plan: Plan, m: Membership) -> List[int]:
    """The global ranks of the member replicas, ascending."""
    return sorted(rk for r in m.replicas for st in plan.replicas[r].stages for rk in st.ranks)


def reshared(plan: Plan, m: Membership) -> Plan:
    """The plan with the members' split: each member replica's micro-batches as `m` says, every
    other replica none, the rows of the global batch handed out in replica order as the planner
    does (`Plan.rank_samples` reads them)."""
    doc = json.loads(json.dumps(plan.doc))
    for i, r in enumerate(doc["replicas"]):
        k = m.micro_batches.get(i, 0)
        r["micro_batches"], r["samples"] = k, k * plan.micro_batch
    return Plan(doc, plan.model, f"{plan.source} (epoch {m.epoch})")


@dataclass(frozen=True)
class EpochGroup:
    """A group of an epoch: `key` names it in the epoch's store, `ranks` its global members."""

    key: str
    kind: str
    ranks: Tuple[int, ...]
    layers: Tuple[int, int] = (0, 0)


def joiner_tp_groups(plan: Plan, replica: int) -> List[EpochGroup]:
    """The TP groups of a joining replica, which its ranks make among themselves from the
    epoch's store (a rank started afresh cannot meet the launch's default group, from which the
    plan's TP groups were made); every other member keeps its own."""
    out = []
    for s, st in enumerate(plan.replicas[replica].stages):
        for d in range(st.dp):
            ranks = tuple(st.tp_group_ranks(d))
            if len(ranks) > 1:
                out.append(EpochGroup(f"tp/{replica}/{s}/{d}", "tp", ranks, tuple(st.layers)))
    return out


def ring_key(layers, tp_rank: int) -> str:
    """The store name of an epoch's gradient ring of layer segment `layers` at TP rank `tp_rank`."""
    return f"dp/{layers[0]}-{layers[1]}/tp{tp_rank}"


def hop_key(replica: int, stage: int) -> str:
    """The store name of an epoch's pipeline hop from `stage` to `stage + 1` of `replica`."""
    return f"pp/{replica}/{stage}"


def epoch_groups(plan: Plan, m: Membership, tie_embeddings: bool) -> List[EpochGroup]:
    """Every group of epoch `m` but TP's, in the one order every rank creates them: the
    members' world, each layer segment's gradient ring at each TP rank among the members
    holding it, each member replica's pipeline hops, and the tied embedding/head matrix's
    members holding it (where the plan syncs it apart, `gradient_sync.tied_group`). TP groups
    are the plan's and outlive the epoch."""
    mine = set(members(plan, m))
    out = [EpochGroup("world", "world", tuple(sorted(mine)))]
    for seg in plan.segments():
        for t in range(plan.tp):
            holders = tuple(r for r in plan.segment_holders(seg, t) if r in mine)
            if len(holders) > 1:
                out.append(EpochGroup(ring_key(seg, t), "dp", holders, seg))
    # A member's pipeline hops too: a step given up mid-pipeline leaves sends in flight on the
    # old hop groups, which the new epoch's must not receive.
    for r in m.replicas:
        stages = plan.replicas[r].stages
        for s in range(len(stages) - 1):
            out.append(EpochGroup(hop_key(r, s), "pp", tuple(sorted(stages[s].ranks + stages[s + 1].ranks)),
                                  (stages[s].layers[1], stages[s].layers[1])))
    if tie_embeddings and any(len(r.stages) > 1 for r in plan.replicas):
        holders = sorted({rk for r in m.replicas for st in (plan.replicas[r].stages[0], plan.replicas[r].stages[-1])
                          for rk in st.ranks})
        out.append(EpochGroup("tied", "tied", tuple(holders)))
    return out
