"""Run by test_zero1_tied.py as every rank's `python -m zero_probe`: the reference trainer, with
the ZeRO-1 gradient sync's `finish` wrapped so that, at the first step, a holder of the tied
embedding/head writes each tied parameter's local gradient before the sums and its master's
gradient after them to $MOTLEY_PROBE_DIR/rank{R}.safetensors ("before.NAME", "after.NAME")."""

import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from motley_torch.distributed import gradient_sync
from motley_torch.train import main

_finish = gradient_sync.ZeroOneSync.finish


def finish(self):
    if self.tied is None or getattr(self, "probed", False):
        return _finish(self)
    self.probed = True
    named = [(n, p) for n, p in self.zero.model.named_parameters() if any(p is q for q in self.tied.params)]
    out = {f"before.{n}": (p.grad.detach().float().clone() if p.grad is not None else torch.zeros(p.shape))
           for n, p in named}
    _finish(self)
    out.update({f"after.{n}": self.zero.master[p].grad.detach().float().clone() for n, p in named})
    save_file(out, os.path.join(os.environ["MOTLEY_PROBE_DIR"], f"rank{dist.get_rank()}.safetensors"))


gradient_sync.ZeroOneSync.finish = finish

if __name__ == "__main__":
    sys.exit(main())
