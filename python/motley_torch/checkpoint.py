"""Checkpoint shards: the seam for saving and restoring a rank's state across re-plans.

A re-planned job (different stages, TP degree or replicas) must load the shards written
under the old plan and re-cut them for the new one; that belongs to the recovery issue
(checkpointing and restart after a re-plan) and is not implemented here. The interface is
fixed so trainers can call it; both functions raise NotImplementedError until then.
`motley_torch.train --save-params` (full, unsharded parameters at the end) is not a
checkpoint: it has no optimizer state and cannot resume.
"""

from __future__ import annotations

from typing import Any, Dict

ISSUE = "checkpoint shards are not implemented yet: see the recovery issue (checkpoint and restart after a re-plan)"


def save_shard(view, model, optimizer, step: int, directory: str) -> str:
    """Write this rank's parameters and optimizer state for `step` under `directory`, named by
    the layers and TP slice it holds (not by rank, so another plan can find them); returns the
    path written."""
    raise NotImplementedError(ISSUE)


def load_shard(view, model, optimizer, directory: str) -> Dict[str, Any]:
    """Restore this rank's slice of the newest complete checkpoint under `directory`, whatever
    plan wrote it; returns metadata (step, the plan that wrote it)."""
    raise NotImplementedError(ISSUE)
