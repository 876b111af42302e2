"""Healthy replicas keep training through a lost one (docs/keep-going.md): a rank's side.

Every step is a transaction. After the step's gradient sync each member rank votes in the
epoch's store (`s{step}/v/{rank}`, its share of the loss or "-") and waits for every member's
vote; the first rank to decide writes the step's decision (`compare_set`, so every rank reads
the same one): `commit` once every vote is in, `abort` once a newer membership is out. Only a
committed step runs the optimizer, so a step in flight when a replica is lost is discarded
everywhere and redone under the new membership, over the same samples: the survivors' steps
stay the single process's. The loss line's global sum is the sum of the votes.

A collective that fails (a member's process is gone: gloo's connection closes) aborts the step
the same way: the rank aborts the epoch's cross-replica groups at once (a peer blocked in them
is released), waits for the newer membership the coordinator opens, and meets the other
members in its store (`KeepGoing.next_epoch`). TP groups are kept: a member replica lost none
of its ranks.

A membership that loses no member (a lost replica coming back: `joining`) aborts nothing. Each
vote carries the newest epoch its rank has seen; once a step commits, every member has read the
same votes, so every member moves to that epoch at the same step boundary (`KeepGoing.move`),
where the joining ranks, started afresh, meet them and take their layers' live state
(`rejoin`).
"""

from __future__ import annotations

import datetime
import json
import os
import queue
import sys
import threading
import time
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist

from ..components.rank_exit import end_rank
from .membership import (ENV, EpochGroup, Membership, MembershipError, epoch_groups, hop_key, members, read, reshared,
                         ring_key)

# What a joining rank publishes in an epoch's store where the others publish their step: it
# holds no state yet and takes it from them (`rejoin`).
JOINING = "join"

# The exit code of a rank whose replica a newer membership left out (its agent stops it too).
LEFT_OUT_EXIT = 3
_PREFIX = "motley/keep-going"
# The longest a rank waits on the store before it reads its membership file again: how late a
# vote that cannot complete (a member is gone) is aborted once the newer membership is there.
WAIT_SLICE_S = 0.5


class StepAborted(Exception):
    """The step did not commit: its gradients are discarded and it runs again."""


class _GaveUp(Exception):
    pass


class GlooWaiter:
    """A thread that waits for gloo works one at a time, while the rank's own thread waits for
    it in slices and reads the membership file between them. A timed wait on gloo's work is no
    harmless slice: when a send's or a receive's wait times out, gloo closes every pair of the
    group's context ("Application timeout caused pair closure"), so a pipeline hop whose peer
    took longer than a slice (a slow first step) broke the step on every rank of the replica.
    The thread's wait has no timeout but the group's own."""

    def __init__(self):
        self.q: "queue.SimpleQueue" = queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True, name="motley-gloo-wait").start()

    def _run(self):
        while True:
            item = self.q.get()
            if item is None:
                return
            work, failed, done = item
            try:
                work.wait()
            except BaseException as e:  # handed to the rank's thread, which raises it
                failed.append(e)
            done.set()

    def wait(self, work, gave_up) -> bool:
        """`work` done (or its error raised); _GaveUp once `gave_up()` says so between slices."""
        failed, done = [], threading.Event()
        self.q.put((work, failed, done))
        _waited_in_slices(done, failed, gave_up)
        return True

    def retire(self):
        """The thread ends once its current wait does (the group's timeout, at the latest)."""
        self.q.put(None)


def _waited_in_slices(done: threading.Event, failed: list, gave_up) -> None:
    """Wait for another thread's `done` in slices, asking `gave_up()` between them (_GaveUp);
    raise what that thread put in `failed`."""
    while not done.wait(WAIT_SLICE_S):
        if gave_up():
            raise _GaveUp()
    if failed:
        raise failed[0]


def _held_for_test(step: int, timeout_s: float) -> None:
    """A test's hold on one rank between its vote on a step and its reading of the decision
    (MOTLEY_TEST_HOLD_AFTER_VOTE="STEP:PATH" in that rank's environment: until PATH exists, or
    the timeout): the window in which the store's host can go after the step committed for the
    other members, which a test cannot otherwise hit at will (python/tests/test_keep_going.py)."""
    held = os.environ.get("MOTLEY_TEST_HOLD_AFTER_VOTE")
    if not held:
        return
    s, path = held.split(":", 1)
    until = time.monotonic() + timeout_s
    if int(s) == step:
        while not os.path.exists(path) and time.monotonic() < until:
            time.sleep(0.02)


def enabled(view, zero1: bool, half_weights: bool = False) -> bool:
    """Keep going where the coordinator asked for it (MOTLEY_KEEP_GOING=1, a membership file to
    watch) and the plan has replicas to lose; ZeRO-1 shards optimizer state across replicas, so
    a lost one takes shards with it: its jobs recover whole (docs/keep-going.md). So do jobs
    with half weights (`--half-weights`): a returning replica's copy of the live state
    (`rejoin`) does not carry fp32 masters."""
    return (os.environ.get("MOTLEY_KEEP_GOING") == "1" and bool(os.environ.get(ENV))
            and len(view.plan.replicas) > 1 and not zero1 and not half_weights)


def superseded(m: Membership, n: Membership) -> bool:
    """Whether newer membership `n` ends epoch `m`'s groups: it leaves out one of `m`'s replicas,
    or names one of them joining (the coordinator opens a rejoin only after the loss that left
    it out: its ranks in `m` are gone, whoever runs them now). One that only adds replicas does
    not: the members move to it at a step boundary."""
    return any(r not in n.replicas for r in m.replicas) or any(r in m.replicas for r in n.joining)


def _poll(store, keys: List[str], until: float, newer) -> bool:
    """Wait for `keys` in `store`: True once all are set, False when `newer()` says a newer
    membership is out. The store's own wait wakes at once when the last key is set (no polling
    latency on the step's path); it is cut into slices of at most WAIT_SLICE_S, between which
    the membership file is read. Raises MembershipError at `until`."""
    if store.check(keys):
        return True
    while True:
        if newer():
            return False
        left = until - time.monotonic()
        if left <= 0:
            raise MembershipError(f"no word from every member within the timeout ({len(keys)} keys, e.g. {keys[0]}), "
                                  f"and no newer membership in {os.environ.get(ENV)}")
        try:
            store.wait(keys, datetime.timedelta(seconds=min(WAIT_SLICE_S, left)))
            return True
        except dist.DistStoreError:
            pass  # the slice ended: look at the membership file, then wait again


class _Reaper:
    """Holds each aborted epoch's process groups for twice their collectives' timeout, then drops
    them on a thread of its own. A gloo group's destructor waits for its work queue to drain:
    one dropped on the rank's thread (the last reference going with the old view, or with the
    traceback of the step that failed) while a collective with a lost peer was still in its
    queue held that thread until the collective timed out, a minute (the stalls of a node lost
    every 20 s or every minute: BENCHMARKS.md). Held here, no other reference is the last one
    while that wait can last."""

    def __init__(self):
        self.q: "queue.SimpleQueue" = queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True, name="motley-group-reaper").start()

    def hold(self, groups: list, seconds: float):
        self.q.put((time.monotonic() + seconds, groups))

    def _run(self):
        while True:
            until, groups = self.q.get()
            time.sleep(max(0.0, until - time.monotonic()))
            del groups  # the destructors run here, if these were the last references


_REAPER: Optional[_Reaper] = None


def _reaper() -> _Reaper:
    global _REAPER
    if _REAPER is None:
        _REAPER = _Reaper()
    return _REAPER


class Epoch:
    """One epoch's store and cross-replica groups, and the view of the rank under it."""

    def __init__(self, m: Membership, address, tcp, store, view, groups: Dict[str, object]):
        self.m, self.address, self.tcp, self.store, self.view, self.groups = m, address, tcp, store, view, groups
        self.members = members(view.plan, m)

    def abort(self, timeout_s: float):
        """Abort this epoch's cross-replica groups: a peer blocked in one of them is released.
        They are dropped by the reaper once their collectives have timed out (`_Reaper`)."""
        for pg in self.groups.values():
            try:
                pg.abort()
            except Exception:  # an aborted or broken group may refuse again; it is dropped anyway
                pass
        _reaper().hold(list(self.groups.values()), 2 * timeout_s)
        self.groups = {}


class KeepGoing:
    """The transaction around each step and the move from one epoch to the next."""

    def __init__(self, view, timeout_s: float, tied_pg=None, joining: Optional[Membership] = None, tcp=None):
        self.path = os.environ[ENV]
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.full_plan = view.plan
        # The epoch every member moves to at the next step boundary (a newer one some member saw
        # by a committed step's votes), and whether this rank holds the job's state: a joining
        # rank does not until it has taken it (`rejoin`).
        self.move_due: Optional[int] = None
        self.move_to: Optional[Membership] = None
        self.loaded = joining is None
        self.joiners: List[int] = []
        # What the trainer hands each meeting beside its step (`carry()`, a short string without
        # "|": its checkpoint save still to be agreed on), and what the members holding the
        # job's state handed at the last meeting (`carried`, by rank): state a member's roll
        # forward skipped (the others' work between two steps) shows there as a difference.
        self.carry = lambda: ""
        self.carried: Dict[int, str] = {}
        self._newest: Optional[Membership] = None
        self.voted: Optional[int] = None
        self.committed: Optional[tuple] = None
        self.committed_epoch = 0
        view.wait_work = self.wait_work
        self.waiter = GlooWaiter() if view.backend == "gloo" else None
        if joining is not None:
            # Before its first epoch a joining rank is a member of none: the epoch before the one
            # it joins, with no groups, its store the one it joins at.
            before = Membership(joining.epoch - 1, (), (), {}, joining.store_host, joining.store_port, -1)
            self.epoch = Epoch(before, (joining.store_host, joining.store_port), tcp, None, view, {})
            self.move_due = joining.epoch
            return
        # The launch's TCPStore itself, not torch's "default_pg" prefix over it: a rank that
        # rejoins connects to the same address with a client of its own (`rejoin`), and its keys
        # must be these.
        tcp = dist.distributed_c10d._get_default_store()
        while isinstance(tcp, dist.PrefixStore):
            tcp = tcp.underlying_store
        address = (os.environ.get("MASTER_ADDR"), int(os.environ.get("MASTER_PORT", "0")))
        # Epoch 0's groups across replicas are the plan's: its world, the segment rings, the
        # tied matrix's group (aborted like any epoch's when a member is lost).
        groups = {f"dp/{i}": seg.group.pg for i, seg in enumerate(view.segments) if seg.group is not None}
        for key, hop in (("pp/prev", view.pp_prev_group), ("pp/next", view.pp_next_group)):
            if hop is not None:
                groups[key] = hop.pg
        groups["world"] = dist.group.WORLD
        if tied_pg is not None:
            groups["tied"] = tied_pg
        self.epoch = Epoch(Membership.initial(view.plan), address, tcp, dist.PrefixStore(f"{_PREFIX}/0", tcp), view,
                           groups)
        # `voted`: the last step whose gradients this rank holds whole (it voted); `committed`:
        # the last step it committed, with that step's loss sum: what a new epoch's members compare.

    @property
    def view(self):
        return self.epoch.view

    def wait_work(self, work):
        """Wait for a cross-replica collective in slices, reading the membership file between
        them: a member that gave up on the step (it saw a newer membership, or a collective of
        its own failed) may still hold its end of this one open, and gloo's abort does not
        close it, so the wait would last the group's whole timeout. Over gloo the wait itself
        runs on `GlooWaiter`'s thread (a timed gloo wait breaks the group)."""
        if self.waiter is not None:
            try:
                return self.waiter.wait(work, self.gave_up)
            except _GaveUp:
                # Its thread stays in the given-up wait until the group is torn down.
                self.waiter.retire()
                self.waiter = GlooWaiter()
                raise StepAborted("a newer membership is out while waiting in a collective") from None
        slice_ = datetime.timedelta(seconds=WAIT_SLICE_S)
        while True:
            began = time.monotonic()
            try:
                return work.wait(slice_)
            except RuntimeError as e:
                # A slice that ended early is the collective's own error, not the slice's.
                if "timed out" not in str(e).lower() or time.monotonic() - began < WAIT_SLICE_S * 0.9:
                    raise
            if self.gave_up():
                raise StepAborted("a newer membership is out while waiting in a collective")

    def newer(self, fresh: bool = False) -> Optional[Membership]:
        """A membership newer than the current epoch's, if the agent wrote one. Read again while
        none is newer, and whenever `fresh` (once a step, and while waiting to move): the file
        holds the newest only, and a newer one may replace the one read."""
        if fresh or self._newest is None or self._newest.epoch <= self.epoch.m.epoch:
            m = read(self.path, self.full_plan)
            self._newest = m
        m = self._newest
        return m if m is not None and m.epoch > self.epoch.m.epoch else None

    def _seen(self) -> int:
        """The newest epoch this rank would move to after this step: a newer membership's, once
        the ranks it names joining have said they are ready (`ready`), so the members train on
        while a joining rank starts (its interpreter, its model) rather than wait for it."""
        m = self.newer(fresh=True)
        if m is None:
            return self.epoch.m.epoch
        if m.joining and (m.store_host, m.store_port) == self.epoch.address and self.epoch.tcp is not None:
            ranks = [rk for r in m.joining for st in self.full_plan.replicas[r].stages for rk in st.ranks]
            if not self.epoch.tcp.check([f"{_PREFIX}/{m.epoch}/ready/{rk}" for rk in ranks]):
                return self.epoch.m.epoch
        return m.epoch

    def ready(self):
        """A joining rank, built and waiting for its state: the members may move now (`_seen`)."""
        dist.PrefixStore(f"{_PREFIX}/{self.move_due}", self.epoch.tcp).set(f"ready/{self.view.rank}", "1")

    def gave_up(self) -> bool:
        """Whether a newer membership ends this epoch (`superseded`): the step in flight cannot
        commit then."""
        m = self.newer(fresh=True)
        return m is not None and superseded(self.epoch.m, m)

    def vote(self, step: int, loss: Optional[float]) -> Optional[float]:
        """This rank's vote on `step`; returns the global loss sum (the votes') if the step
        commits, raises StepAborted if it does not."""
        ep, rank = self.epoch, self.view.rank
        store = ep.store
        self.voted = step
        seen = self._seen()
        try:
            if seen > ep.m.epoch:
                # The epoch's document beside the vote: every member moves to the newest any of
                # them saw, and enters it from here, whatever its own file holds by then.
                store.set(f"doc/{seen}", json.dumps(self._newest.to_doc()))
            store.set(f"s{step}/v/{rank}", ("-" if loss is None else repr(float(loss))) + f"@{seen}")
            _held_for_test(step, self.timeout.total_seconds())
            keys = [f"s{step}/v/{r}" for r in ep.members]
            all_in = _poll(store, keys, time.monotonic() + self.timeout.total_seconds(), self.gave_up)
            want = b"commit" if all_in else b"abort"
            decided = store.compare_set(f"s{step}/decision", "", want.decode())
            if decided != b"commit":
                raise StepAborted(f"step {step} aborted: a newer membership is out")
            votes = store.multi_get(keys)
        except (RuntimeError, dist.DistError) as e:
            # The store went with its host (the epoch's leader): the step did not commit here,
            # and may have elsewhere (`next_epoch` rolls this rank forward then).
            raise StepAborted(f"step {step}: the epoch's store failed ({str(e)[:200]})") from e
        parts = [v.decode().split("@") for v in votes]
        total = sum(float(loss) for loss, _ in parts if loss != "-")
        self.committed = (step, total)
        # Every member read these votes: the newest epoch any of them saw is where they all move
        # before the next step.
        newest_seen = max(int(e) for _, e in parts)
        if newest_seen > ep.m.epoch:
            self.move_due = newest_seen
            self.move_to = Membership.parse(json.loads(store.get(f"doc/{newest_seen}")), self.full_plan,
                                            f"the epoch's store (doc/{newest_seen})")
        return total

    def next_epoch(self, step: int, cause: BaseException, make_groups) -> Optional[float]:
        """After a failed collective or an aborted vote at `step`: abort this epoch's groups,
        wait for the newer membership, meet its members in its store and make its groups
        (`make_groups(epoch_groups, store)` -> {key: process group}). Exits LEFT_OUT_EXIT when
        this rank's replica is not a member.

        The members compare where they are. A step commits only once every member voted, and a
        rank votes only once its gradient sync is done, so when the old store's host went
        between the decision and some members' reading it, those members hold that step's
        whole gradients: they commit it now (returned: its loss sum, which a member that read
        the decision hands over). Returns None when every member is at `step`."""
        self.epoch.abort(self.timeout.total_seconds())
        m = self._wait_newer(self.epoch.m.epoch + 1, f"step {step} failed ({str(cause)[:200]})", cause)
        return self._enter(m, step, cause, make_groups)[0]

    def move(self, step: Optional[int], make_groups) -> Tuple[Optional[float], int]:
        """At a step boundary (before `step`; a joining rank: None), move to the epoch the last
        committed step's votes named (`move_due`), or a newer one: the same meeting as after a
        failed step, with nothing aborted mid-step. Returns (a rolled-forward step's loss sum or
        None, the step the members run next)."""
        due, self.move_due = self.move_due, None
        if self.loaded:
            m = self.move_to  # the document the votes named, from the store
        else:
            m = self._wait_newer(due, "joining the job", None)
        self.epoch.abort(self.timeout.total_seconds())
        return self._enter(m, step, None, make_groups)

    def _wait_newer(self, epoch: int, why: str, cause) -> Membership:
        """The membership of `epoch` or newer, once the agent has written it (within the timeout)."""
        until = time.monotonic() + self.timeout.total_seconds()
        m = self.newer(fresh=True)
        while m is None or m.epoch < epoch:
            if time.monotonic() > until:
                raise MembershipError(f"{why}, and no membership of epoch {epoch} or newer came in "
                                      f"{self.timeout.total_seconds():.0f} s ({ENV})") from cause
            time.sleep(0.02)
            m = self.newer(fresh=True)
        return m

    def _enter(self, m: Membership, step: Optional[int], cause, make_groups=None) -> Tuple[Optional[float], int]:
        """Meet epoch `m`'s members in its store, compare where they are, make the epoch's groups
        and take its view. A rank that holds the job's state publishes its step, a joining one
        `JOINING` (it runs from the others' step, `joiners` then names it)."""
        make_groups = make_groups or self._make_groups
        view = self.view
        if view.replica not in m.replicas:
            print(f"motley-membership epoch {m.epoch}: replica {view.replica} is not a member ({m.reason}); "
                  f"rank {view.rank} stops", file=sys.stderr, flush=True)
            end_rank(LEFT_OUT_EXIT)
        plan = reshared(self.full_plan, m)
        mine = members(self.full_plan, m)
        until = time.monotonic() + self.timeout.total_seconds()
        # The coordinator keeps the store where it was while its host leads, and moves it to
        # the new leader's node, on the other of the launch's two ports, when it does not.
        address = (m.store_host, m.store_port)
        if address == self.epoch.address and self.epoch.tcp is not None:
            tcp = self.epoch.tcp
        else:
            tcp = dist.TCPStore(m.store_host, m.store_port, None, view.rank == m.leader, self.timeout,
                                wait_for_workers=False)
        store = dist.PrefixStore(f"{_PREFIX}/{m.epoch}", tcp)
        # Every member redoes the same step: one that committed a step the others did not (its
        # decision read just before the old store's host went) cannot be made whole here.
        if step is not None and self.committed is not None and self.committed[0] == step - 1:
            store.set(f"loss/{step - 1}", repr(self.committed[1]))
        store.set(f"joined/{view.rank}", (str(step) if self.loaded else JOINING) + "|" + self.carry())
        # One decision per epoch's meeting, the first rank's (`compare_set`), which every member
        # follows: meet here once every member is in, or go on to a newer epoch one of them
        # read while some were missing (its document left in this store). A member never
        # enters an epoch the others left.
        keys = [f"joined/{r}" for r in mine]
        later = {}

        def newer_one() -> bool:
            n = self.newer(fresh=True)
            if n is None or n.epoch <= m.epoch:
                return False
            later["m"] = n
            return True

        if _poll(store, keys, until + self.timeout.total_seconds(), newer_one):
            want = "enter"
        else:
            store.set(f"doc/{later['m'].epoch}", json.dumps(later["m"].to_doc()))
            want = f"leave:{later['m'].epoch}"
        decided = store.compare_set("meeting", "", want).decode()
        if decided.startswith("leave:"):
            e = int(decided.split(":", 1)[1])
            n = Membership.parse(json.loads(store.get(f"doc/{e}")), self.full_plan, f"the epoch's store (doc/{e})")
            print(f"motley-membership epoch {m.epoch}: not met (epoch {e} is out); moving on to it",
                  file=sys.stderr, flush=True)
            self.epoch = Epoch(m, address, tcp, store, view, {})
            return self._enter(n, step, cause, make_groups)
        said = dict(zip(mine, (v.decode().split("|", 1) for v in store.multi_get([f"joined/{r}" for r in mine]))))
        self.joiners = sorted(r for r, (v, _) in said.items() if v == JOINING)
        self.carried = {r: c for r, (v, c) in said.items() if v != JOINING}
        steps = {int(v) for v, _ in said.values() if v != JOINING}
        if not steps:
            raise MembershipError(f"epoch {m.epoch}: every member is joining; none holds the job's state")
        roll = None
        if not self.loaded:
            step = max(steps)  # where the members that hold the state go on (after any roll forward)
        elif steps == {step, step + 1} and self.voted == step:
            roll = float(store.get(f"loss/{step}"))
            self.committed = (step, roll)
            self.committed_epoch = self.epoch.m.epoch  # the others committed it in the old epoch
            step += 1
        elif steps not in ({step}, {step - 1, step}):
            raise MembershipError(f"epoch {m.epoch}: the members are at steps {sorted(steps)}, this rank at {step} "
                                  f"(its last vote: step {self.voted}); the job recovers whole from its checkpoint")
        mine_groups = {g.key: g for g in epoch_groups(self.full_plan, m, plan.model.tie_embeddings)
                       if view.rank in g.ranks}
        # The groups are made over a store client of their own: a TCPStore client runs one
        # operation at a time, and a rendezvous given up (`_sliced`: a member lost meanwhile)
        # waits in it until the groups' timeout; on the rank's own client that wait held every
        # later vote and meeting of this rank for a minute (BENCHMARKS.md, the node lost every
        # minute).
        own = dist.TCPStore(m.store_host, m.store_port, None, False, self.timeout, wait_for_workers=False)
        group_store = dist.PrefixStore(f"{_PREFIX}/{m.epoch}", own)
        groups = self._sliced(lambda: make_groups(list(mine_groups.values()), group_store), m)
        new_view = _epoch_view(view, plan, m, groups, mine_groups)
        self.epoch = Epoch(m, address, tcp, store, new_view, groups)
        if cause is not None:
            what = f"committing step {step - 1} as the others did" if roll is not None else f"redoing step {step}"
            here = f"; here: {type(cause).__name__}: {str(cause)[:160]}"
        else:
            what = f"from step {step}" + (f", ranks {self.joiners} joining" if self.joiners else "")
            here = ""
        print(f"motley-membership epoch {m.epoch} replicas {list(m.replicas)} lost {list(m.lost)} leader {m.leader}: "
              f"{what} ({m.reason}{here})", file=sys.stderr, flush=True)
        return roll, step

    def _sliced(self, make, m: Membership):
        """`make()` (the epoch's groups: gloo's rendezvous waits for every member, and cannot be
        waited in slices itself) on a thread of its own, waited in slices; StepAborted once a
        membership newer than `m` leaves one of its replicas out (a member lost while the groups
        were made: the others would wait out the groups' timeout). The given-up thread ends at
        that timeout."""
        out: list = []
        failed: list = []
        done = threading.Event()

        def run():
            try:
                out.append(make())
            except BaseException as e:  # raised on the rank's thread
                failed.append(e)
            done.set()

        threading.Thread(target=run, daemon=True, name="motley-epoch-groups").start()
        newer: list = []

        def gave_up() -> bool:
            n = self.newer(fresh=True)
            if n is not None and n.epoch > m.epoch and superseded(m, n):
                newer.append(n)
            return bool(newer)

        try:
            _waited_in_slices(done, failed, gave_up)
        except _GaveUp:
            raise StepAborted(f"epoch {newer[0].epoch} is out while epoch {m.epoch}'s groups were made") from None
        return out[0]

    def share(self, state: dict) -> dict:
        """The trainer's state beside the weights (the loss scale, the notices acted on), from
        the epoch's leader to the joining ranks (through the epoch's store)."""
        key = "trainer"
        if self.view.rank == self.epoch.m.leader:
            self.epoch.store.set(key, json.dumps(state))
            return state
        if self.loaded:
            return state
        _poll(self.epoch.store, [key], time.monotonic() + self.timeout.total_seconds(), lambda: False)
        return json.loads(self.epoch.store.get(key))

    def _make_groups(self, groups, store):
        return make_gloo_or_nccl(self.view, self.timeout)(groups, store)


def make_gloo_or_nccl(view, timeout: datetime.timedelta):
    """The group maker for `KeepGoing.next_epoch`: each group of the epoch that this rank is in,
    created afresh under a store prefix naming it (no collective over the old world: a world
    group that includes dead ranks blocks), in the one order every rank uses."""
    def make(groups: List[EpochGroup], store) -> Dict[str, object]:
        from .groups import group_on_store

        return {g.key: group_on_store(store, g.key, g.ranks.index(view.rank), len(g.ranks), view.backend, timeout)
                for g in groups}
    return make


def _epoch_view(view, plan, m: Membership, groups: Dict[str, object], made: Dict[str, EpochGroup]):
    """The rank's view under epoch `m`: the re-shared plan, the segment rings among the members,
    the members' world group, the epoch and its leader."""
    import dataclasses

    from .groups import Group, Segment

    segments = []
    for seg in view.segments:
        key = ring_key(seg.layers, view.tp_rank)
        pg = groups.get(key)
        ranks = list(made[key].ranks) if pg is not None else [view.rank]
        group = Group(-1, "dp", ranks, seg.layers, None, None, pg=pg) if pg is not None else None
        segments.append(Segment(seg.layers, ranks, group))

    def hop(stage: int) -> Optional[Group]:
        key = hop_key(view.replica, stage)
        if key not in groups:
            return None
        return Group(-1, "pp", list(made[key].ranks), made[key].layers, view.replica, stage, pg=groups[key])

    prev = hop(view.stage - 1) if view.stage > 0 else None
    nxt = hop(view.stage) if view.stage + 1 < view.pp_size else None
    return dataclasses.replace(view, plan=plan, segments=segments, world_group=groups.get("world"),
                               tied_group=groups.get("tied"), pp_prev_group=prev, pp_next_group=nxt, epoch=m.epoch,
                               leader=m.leader)
