"""What the trainer feeds its model: each step's global batch (a tokenized dataset, `--data`,
or the synthetic sequences) and the evaluation set (`--eval-data`), cut the same way on every
plan so the numbers do not depend on the plan.

Evaluation takes the first N samples in order, in chunks of the plan's global batch (each
chunk split over the replicas as a training batch is); the last chunk is padded with rows
whose targets are -100, which count for nothing. The eval loss is the mean token
cross-entropy over the N * seq_len targets.
"""

from __future__ import annotations

from typing import Iterator, List, Optional

import torch

from .data import global_batch_tokens


class StepSource:
    """The global batch [global_batch, seq_len + 1] of every step, in order from `start`."""

    def __init__(self, args, vocab: int, seq_len: int, global_batch: int, samples_consumed: int = 0):
        self.seed, self.vocab, self.seq_len, self.global_batch = args.seed, vocab, seq_len, global_batch
        self.batches = None
        self.wait_s = 0.0
        self.ids: List[int] = []  # the global sample ids of the last batch (--data only)
        if args.data:
            from .data import TrainBatches, open_tokens

            ds = open_tokens(args.data, dtype=args.data_dtype, vocab=vocab)
            self.batches = TrainBatches(ds, seq_len, global_batch, args.seed, samples_consumed=samples_consumed)

    def tokens(self, step: int) -> torch.Tensor:
        if self.batches is None:
            return global_batch_tokens(self.seed, step, self.global_batch, self.seq_len, self.vocab)
        tokens, self.ids = self.batches.next()
        self.wait_s = self.batches.last_wait_s
        return tokens

    def close(self):
        if self.batches is not None:
            self.batches.close()


def eval_set(args, vocab: int, seq_len: int) -> Optional[torch.Tensor]:
    """The first --eval-samples samples of --eval-data, [N, seq_len + 1]; None without it."""
    if not args.eval_data:
        return None
    from .data import eval_tokens, open_tokens

    ds = open_tokens(args.eval_data, dtype=args.data_dtype, vocab=vocab)
    return eval_tokens(ds, seq_len, args.eval_samples)


def eval_chunks(tokens: torch.Tensor, global_batch: int) -> Iterator[torch.Tensor]:
    """[global_batch, seq_len + 1] chunks; padding rows of the last have targets -100 (their
    inputs are token 0, any valid id)."""
    n = tokens.shape[0]
    for a in range(0, n, global_batch):
        chunk = tokens[a : a + global_batch]
        if chunk.shape[0] < global_batch:
            pad = torch.full((global_batch - chunk.shape[0], tokens.shape[1]), -100, dtype=tokens.dtype)
            pad[:, 0] = 0
            chunk = torch.cat([chunk, pad])
        yield chunk


def split_inputs_targets(chunk: torch.Tensor):
    """(inputs, targets): padded inputs (-100) read as token 0."""
    inputs = chunk[:, :-1].clamp(min=0)
    return inputs, chunk[:, 1:]


def due_evals(start: int, steps: int, every: int) -> List[int]:
    """The steps (optimizer steps taken) after which the eval loss is printed: 0 (on a run that
    starts there), every `every`, and the last."""
    out = [s for s in range(start, steps + 1) if (s == 0 or (every > 0 and s % every == 0))]
    if steps not in out:
        out.append(steps)
    return out
