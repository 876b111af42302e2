"""Preemption notices (docs/recovery.md, "Preemption notices"): the file the agent writes when a
node of the launch goes away at a deadline, and the ranks' agreement, once per step, to save.

    notice = SaveNotice.from_env()  # $MOTLEY_CKPT_NOTICE: a preemption notice's file, if set
    if notice is not None and notice.due(view): checkpoint.save(...)  # collective: every rank
"""

from __future__ import annotations

import json
import os

from .checkpoint import CheckpointError, _agree_max

# ---- preemption notices -----------------------------------------------------------------------
# A node of the launch goes away at a deadline (`motley node drain NODE --deadline 2m`): its agent
# writes {"notice": N, "deadline_unix_ms": D} to the file $MOTLEY_CKPT_NOTICE names (atomically).
# Ranks see it at different steps, so at the end of every step they agree, with one all-reduce
# (MAX) of a single integer, on the newest notice any of them has seen; all save that step, once
# per notice. The coordinator moves the job off the node once the step is complete.

NOTICE_ENV = "MOTLEY_CKPT_NOTICE"


class SaveNotice:
    """The preemption notice file of this launch (`path`) and the newest notice acted on."""

    def __init__(self, path: str):
        if not os.path.isabs(path):
            raise CheckpointError(f"{NOTICE_ENV}: {path!r} is not an absolute path; the agent sets it, unset it "
                                  f"when running ranks by hand")
        self.path = path
        self.handled = 0

    @classmethod
    def from_env(cls):
        """The notice file $MOTLEY_CKPT_NOTICE names (set by the agent for every rank), or None."""
        path = os.environ.get(NOTICE_ENV, "").strip()
        return cls(path) if path else None

    def seen(self) -> int:
        """The notice number in the file (0: no notice). The file is written whole (renamed into
        place), so anything unreadable is an error, not a notice half-written."""
        try:
            with open(self.path) as f:
                text = f.read()
        except FileNotFoundError:
            return 0
        except OSError as e:
            raise CheckpointError(f"{NOTICE_ENV} ({self.path}): cannot be read ({e}); the agent writes it as the "
                                  f"rank's user: check the launch directory's owner") from e
        try:
            n = json.loads(text)["notice"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{NOTICE_ENV} ({self.path}): not a preemption notice ({e!r}); "
                                  f'expected {{"notice": N, "deadline_unix_ms": D}} as the agent writes it') from e
        if not isinstance(n, int) or n < 0:
            raise CheckpointError(f"{NOTICE_ENV} ({self.path}): notice {n!r} is not a whole number >= 0")
        return n

    def due(self, view) -> bool:
        """Collective (every rank, once per step, at the same point): True on every rank when
        some rank has seen a notice newer than the last one acted on, which it now is."""
        local, seen = None, 0
        try:
            seen = self.seen()
        except CheckpointError as e:
            local = e
        # A rank that cannot read its notice still takes part (others would wait in the
        # all-reduce until the timeout), then every rank raises.
        # The newest notice acted on is agreed too (its minimum, as the maximum of its negation):
        # a member lost during the last agreement may have left it finished on some ranks only,
        # and ranks that disagreed on whether to save would wait for each other in the save's.
        n, failed, least_handled = _agree_max(view, [seen, 1 if local is not None else 0, -self.handled])
        least_handled = -least_handled
        if local is not None:
            raise local
        if failed:
            raise CheckpointError("another rank could not read its preemption notice (see its log)")
        self.handled = max(n, least_handled)
        return n > least_handled
