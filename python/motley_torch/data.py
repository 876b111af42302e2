"""Synthetic, deterministic training data and how a plan splits it.

Step i's global batch is generated whole from a torch.Generator seeded by (seed, i): every
sequence is an arithmetic progression of token ids modulo the vocabulary (random start and
stride), which a model can learn, so the loss falls. Replicas take contiguous slices of the
global batch in replica order; a replica's slice is cut into micro-batches in order, and a
stage with dp TP-groups gives TP-group d rows [d*mb/dp, (d+1)*mb/dp) of every micro-batch.
"""

from __future__ import annotations

from typing import List, Tuple

import torch

from .plan import Plan


def step_generator(seed: int, step: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 2_147_483_647 + step * 7_919 + 17) % (2**62))
    return g


def global_batch_tokens(seed: int, step: int, global_batch: int, seq_len: int, vocab: int) -> torch.Tensor:
    """[global_batch, seq_len + 1] token ids: inputs are [:, :-1], targets [:, 1:]."""
    g = step_generator(seed, step)
    start = torch.randint(0, vocab, (global_batch, 1), generator=g)
    stride = torch.randint(1, max(2, min(vocab, 8)), (global_batch, 1), generator=g)
    pos = torch.arange(seq_len + 1)[None, :]
    return (start + stride * pos) % vocab


def rank_micro_batches(plan: Plan, rank: int, tokens: torch.Tensor) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, targets) of every micro-batch of `rank`, its stage-dp slice only."""
    return [(tokens[a:b, :-1], tokens[a:b, 1:]) for a, b in plan.rank_samples(rank)]
