"""One weight cast per step on the plain path (`--half-weights`): the model's own parameters
in the compute type (bf16/fp16), fp32 masters beside them for the optimizer.

Under autocast over fp32 weights every micro-batch's forward casts every weight to the half
type (and, inside a compiled block, the graph does it on every call), and its backward casts
each weight's gradient back to fp32: a read of 4 bytes and a write of 2 per parameter per
micro-batch, and the same again backwards. Here the forward reads the half weights as they are;
the masters are cast into them once, after the optimizer step (`refresh`), as Megatron-LM's
fp16/bf16 optimizer does with its fp32 main parameters.

Gradients still sum in fp32 across micro-batches: each parameter's half gradient is added into
its master's fp32 gradient as soon as autograd has accumulated it (`register_post_accumulate_
grad_hook`, registered before the gradient sync's own hooks, so a bucket launched from those
finds the micro-batch added) and dropped, so at most one micro-batch's half gradient exists at
a time. The gradient sync reduces the masters' gradients (fp32 buckets, as the plain path's),
the loss scaler and the optimizer see the masters, a checkpoint saves and restores them
(the model units in fp32, as an fp32 run's: either restores the other), and `--save-params` /
`--save-hf` export them. ZeRO-1 stores half weights its own way (`zero.ZeroOne`).
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from ..spec import PlanError


class HalfWeights:
    """The fp32 masters of a model whose parameters it has cast to `half`."""

    def __init__(self, model: torch.nn.Module, half: torch.dtype):
        self.model, self.half = model, half
        # By identity: a tied embedding/head on one stage is one parameter, with one master.
        self.master: Dict[torch.nn.Parameter, torch.nn.Parameter] = {}
        for p in model.parameters():
            if p in self.master:
                continue
            if p.dtype != torch.float32:
                raise PlanError(f"--half-weights: a {p.dtype} parameter; the model must be built in fp32 (its weights are "
                                f"cast to the compute type here)")
            self.master[p] = torch.nn.Parameter(p.detach().clone())
        with torch.no_grad():
            for p in self.master:
                p.data = p.data.to(half)
        self.handles = [p.register_post_accumulate_grad_hook(self._accumulate) for p in self.master]

    def _accumulate(self, p: torch.nn.Parameter):
        """A micro-batch's half gradient of `p` into its master's fp32 gradient (in place: a
        bucket's view, when the gradient sync made it one)."""
        m = self.master[p]
        if m.grad is None:
            m.grad = p.grad.to(torch.float32)
        else:
            m.grad.add_(p.grad)
        p.grad = None

    def masters(self) -> List[torch.nn.Parameter]:
        return list(self.master.values())

    def refresh(self):
        """After the optimizer step: the one cast of the step, every master into its half weight."""
        with torch.no_grad():
            torch._foreach_copy_(list(self.master), list(self.master.values()))

    def export_masters(self, writes: bool) -> Optional[Dict[str, torch.Tensor]]:
        """The fp32 masters by parameter name, on the CPU, for a rank that `writes` the stage's
        full tensors (`stage_files.write_stage_files`, as `ZeroOne.export_masters`): local, no
        collective."""
        if not writes:
            return None
        return {n: self.master[p].detach().cpu() for n, p in self.model.named_parameters()}
