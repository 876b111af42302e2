"""Training data: a tokenized dataset (or synthetic tokens) and how a plan splits it.

Datasets (`open_tokens`, `TrainBatches`, `eval_tokens`; formats in indexed.py, `prepare` in
prepare.py): the training order is a global counter c over the samples handed out; epoch
e = c // n (n samples), sample id = perm(seed, e)[c % n], perm(seed, e) being a shuffle of
range(n) by numpy's PCG64 seeded with [seed, e]. Every global batch is the next global_batch
ids, so a restore with the same global_batch and samples_consumed continues exactly.
`python -m motley_torch.data prepare|inspect` makes and describes datasets.

Synthetic data:

Step i's global batch is generated whole from a torch.Generator seeded by (seed, i): every
sequence is an arithmetic progression of token ids modulo the vocabulary (random start and
stride), which a model can learn, so the loss falls. Replicas take contiguous slices of the
global batch in replica order; a replica's slice is cut into micro-batches in order, and a
stage with dp TP-groups gives TP-group d rows [d*mb/dp, (d+1)*mb/dp) of every micro-batch.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import numpy as np

from .indexed import DataError, TokenData, open_tokens
from ..plan import Plan

if TYPE_CHECKING:
    import torch

__all__ = ["step_generator", "global_batch_tokens", "rank_micro_batches", "DataError", "TokenData",
           "open_tokens", "epoch_permutation", "TrainBatches", "eval_tokens", "main"]


def step_generator(seed: int, step: int) -> "torch.Generator":
    import torch

    g = torch.Generator()
    g.manual_seed((seed * 2_147_483_647 + step * 7_919 + 17) % (2**62))
    return g


def global_batch_tokens(seed: int, step: int, global_batch: int, seq_len: int, vocab: int) -> torch.Tensor:
    """[global_batch, seq_len + 1] token ids: inputs are [:, :-1], targets [:, 1:]."""
    import torch

    g = step_generator(seed, step)
    start = torch.randint(0, vocab, (global_batch, 1), generator=g)
    stride = torch.randint(1, max(2, min(vocab, 8)), (global_batch, 1), generator=g)
    pos = torch.arange(seq_len + 1)[None, :]
    return (start + stride * pos) % vocab


def rank_micro_batches(plan: Plan, rank: int, tokens: torch.Tensor) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, targets) of every micro-batch of `rank`, its stage-dp slice only."""
    return [(tokens[a:b, :-1], tokens[a:b, 1:]) for a, b in plan.rank_samples(rank)]


def device_micro_batches(plan: Plan, rank: int, tokens: torch.Tensor,
                         device: torch.device) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """`rank_micro_batches` on `device`: on a GPU the rank's rows go over in one copy from
    pinned memory that does not make the host wait (a pageable copy does: the GPU then idles
    while the next step's first kernels are launched); views of it are the micro-batches."""
    spans = plan.rank_samples(rank)
    if device.type != "cuda" or not spans:
        return rank_micro_batches(plan, rank, tokens)
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    rows = tokens[lo:hi].contiguous().pin_memory().to(device, non_blocking=True)
    return [(rows[a - lo:b - lo, :-1], rows[a - lo:b - lo, 1:]) for a, b in spans]


# ---------------------------------------------------------------------------------------------
# Tokenized datasets: the training order, prefetched global batches, the evaluation samples
# ---------------------------------------------------------------------------------------------


def _positive(v, what: str, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < minimum:
        raise DataError(f"{what}: expected an integer >= {minimum}, got {v!r}")
    return int(v)


def epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    """perm(seed, epoch): range(n) shuffled by numpy's PCG64 seeded with [seed, epoch]."""
    a = np.arange(n, dtype=np.int32 if n < 2**31 else np.int64)
    np.random.Generator(np.random.PCG64([seed, epoch])).shuffle(a)
    return a


class TrainBatches:
    """Global batches of a dataset in the training order, the next one prepared in a thread.

    `next()` -> (tokens int64 [global_batch, seq_len+1], ids: the global sample ids in row
    order). `samples_consumed` is the samples handed out so far (the training position);
    `last_wait_s` the seconds the last `next()` waited for its batch."""

    def __init__(self, ds: TokenData, seq_len: int, global_batch: int, seed: int,
                 samples_consumed: int = 0, prefetch: bool = True):
        self.ds = ds
        self.seq_len = _positive(seq_len, "model.seq_len")
        self.global_batch = _positive(global_batch, "global_batch")
        self.seed = _positive(seed, "--seed", 0)
        self.num_samples = ds.num_samples(self.seq_len)
        if self.num_samples == 0:
            raise DataError(f"--data {ds.bin_path}: {ds.num_tokens} tokens make no sample of seq_len "
                            f"{self.seq_len} (it needs {self.seq_len + 1}); fix: more data or a shorter seq_len")
        self._consumed = _positive(samples_consumed, "samples_consumed", 0)
        self.last_wait_s = 0.0
        self._perms: Dict[int, np.ndarray] = {}
        self._lock = threading.Lock()
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pending: Optional[Tuple[int, Future]] = None
        self._closed = False
        if prefetch:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="motley-data")
            self._start(self._consumed)

    @property
    def samples_consumed(self) -> int:
        return self._consumed

    def sample_ids(self, start: int, count: int) -> List[int]:
        """The sample ids at training positions [start, start+count)."""
        n = self.num_samples
        out: List[int] = []
        c = start
        while c < start + count:
            epoch, k = divmod(c, n)
            take = min(n - k, start + count - c)
            out.extend(self._perm(epoch)[k:k + take].tolist())
            c += take
        return out

    def _perm(self, epoch: int) -> np.ndarray:
        with self._lock:
            p = self._perms.get(epoch)
            if p is None:
                p = epoch_permutation(self.seed, epoch, self.num_samples)
                for e in [e for e in self._perms if e < epoch - 1]:
                    del self._perms[e]
                self._perms[epoch] = p
            return p

    def _build(self, start: int) -> Tuple[torch.Tensor, List[int]]:
        ids = self.sample_ids(start, self.global_batch)
        out = np.empty((self.global_batch, self.seq_len + 1), dtype=np.int64)
        self.ds.fill(out, ids, self.seq_len)
        import torch

        return torch.from_numpy(out), ids

    def _start(self, start: int) -> None:
        self._pending = (start, self._pool.submit(self._build, start))

    def next(self) -> Tuple[torch.Tensor, List[int]]:
        if self._closed:
            raise DataError(f"--data {self.ds.bin_path}: next() after close()")
        t0 = time.perf_counter()
        if self._pool is None:
            batch = self._build(self._consumed)
        else:
            if self._pending is None:  # the last prefetch failed: try that batch again
                self._start(self._consumed)
            start, fut = self._pending
            assert start == self._consumed
            try:
                batch = fut.result()
            except BaseException:
                self._pending = None
                raise
        self.last_wait_s = time.perf_counter() - t0
        self._consumed += self.global_batch
        if self._pool is not None:
            self._start(self._consumed)
        return batch

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pool is not None:
            if self._pending is not None:
                self._pending[1].cancel()
            self._pool.shutdown(wait=True)
            self._pending = None

    def __enter__(self) -> "TrainBatches":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def eval_tokens(ds: TokenData, seq_len: int, n: int) -> torch.Tensor:
    """The first n samples in order: int64 [n, seq_len+1]."""
    seq_len = _positive(seq_len, "model.seq_len")
    n = _positive(n, "--eval-samples")
    have = ds.num_samples(seq_len)
    if n > have:
        raise DataError(f"--eval-samples: {n} asked, but {ds.bin_path} has {have} samples of seq_len "
                        f"{seq_len} ({ds.num_tokens} tokens); fix: --eval-samples {have} or fewer")
    flat = ds.tokens(0, n * seq_len + 1, seq_len)
    rows = np.lib.stride_tricks.sliding_window_view(flat, seq_len + 1)[::seq_len][:n]
    import torch

    return torch.from_numpy(np.ascontiguousarray(rows))


# ---------------------------------------------------------------------------------------------
# python -m motley_torch.data prepare|inspect
# ---------------------------------------------------------------------------------------------


def _inspect(args) -> Dict:
    ds = open_tokens(args.path, dtype=args.data_dtype)
    doc = {"documents": ds.num_documents, "tokens": ds.num_tokens, "dtype": ds.dtype, "format": ds.format}
    if args.output == "json":
        print(json.dumps(doc))
    elif ds.format == "indexed":
        print(f"{ds.bin_path} + {ds.idx_path}: Megatron indexed dataset (MMIDIDX), {ds.num_documents} documents, "
              f"{ds.num_sequences} sequences, {ds.num_tokens} tokens, dtype {ds.dtype}")
    else:
        print(f"{ds.bin_path}: flat token file, {ds.num_tokens} tokens, dtype {ds.dtype}")
    return doc


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m motley_torch.data",
                                description="Make (prepare) and describe (inspect) tokenized datasets.")
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare", help="tokenize text files into a Megatron indexed dataset (PREFIX.bin/.idx)")
    pp.add_argument("--tokenizer", required=True, metavar="FILE", help="a Hugging Face tokenizers JSON (tokenizer.json)")
    pp.add_argument("--input", required=True, nargs="+", metavar="FILE",
                    help=".jsonl/.json: one JSON object per line (its --text-field); any other file: one document")
    pp.add_argument("--output", required=True, metavar="PREFIX", help="writes PREFIX.bin and PREFIX.idx")
    pp.add_argument("--eos-token", metavar="TOKEN", help="appended to every document (default: the first of "
                    "</s>, <|endoftext|>, <|end_of_text|>, <eos> in the vocabulary)")
    pp.add_argument("--text-field", default="text", metavar="NAME", help="the JSON field holding the text (default text)")
    pp.add_argument("--workers", type=int, metavar="N", help="tokenizer threads (default: all cores)")
    pp.add_argument("--no-special-tokens", action="store_true",
                    help="encode without the tokenizer's post-processor tokens (e.g. a BOS)")
    pp.add_argument("--chunk-mb", type=float, default=1.0, metavar="MB",
                    help="text encoded per batch (default 1 MB; memory grows by about 100 times this, "
                    "or the largest document, whichever is more)")
    pi = sub.add_parser("inspect", help="count the documents and tokens of a dataset")
    pi.add_argument("path", metavar="PATH", help="PREFIX, PREFIX.bin/.idx, or a flat FILE.bin")
    pi.add_argument("--data-dtype", choices=["uint16", "uint32"], help="a flat file's dtype (default uint16)")
    pi.add_argument("-o", "--output", choices=["text", "json"], default="text")
    args = p.parse_args(argv)
    try:
        if args.cmd == "inspect":
            _inspect(args)
        else:
            from .prepare import prepare
            prepare(args.tokenizer, args.input, args.output, eos_token=args.eos_token, text_field=args.text_field,
                    workers=args.workers, add_special_tokens=not args.no_special_tokens,
                    chunk_bytes=int(args.chunk_mb * (1 << 20)))
    except DataError as e:
        print(f"motley data: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
