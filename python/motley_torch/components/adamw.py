"""The trainer's AdamW: torch's own AdamW kernels (`torch.optim.adamw.adamw`, the functional API
that `torch.optim.AdamW.step` calls: fused on CUDA, multi-tensor elsewhere) over state kept in
torch's layout (`state[p] = {"step", "exp_avg", "exp_avg_sq"}`, `param_groups`, `defaults`), so
checkpoints, ZeRO-1 and the memory line read it as they would read `torch.optim.AdamW`'s.

Why not `torch.optim.AdamW` itself: its constructor, `zero_grad` and `step` are wrapped by
torch's dynamo guards (`torch._disable_dynamo`, `_use_grad_for_differentiable`), which import
`torch._dynamo` (and with it inductor, sympy and triton's bindings) on first use: about 1.3 s
of CPU in every rank process that never compiles, paid again on every restart of a recovery
(BENCHMARKS.md, "A rank's fixed CPU, without dynamo"). The kernels are the same; a rank that compiles imports
dynamo for its blocks anyway, and the functional API is what compiled optimizers trace.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch.optim.adamw import adamw


class AdamW:
    """Decoupled weight decay Adam (Loshchilov and Hutter), one parameter group, no amsgrad."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, fused: bool = False, foreach: bool = False):
        params = list(params)
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"AdamW: lr {lr}, betas {betas}, eps {eps}, weight_decay {weight_decay}: "
                             f"lr, eps and weight decay must be >= 0 and each beta in [0, 1)")
        if fused and foreach:
            raise ValueError("AdamW: fused and foreach are two kernels; choose one")
        if fused and not all(p.device.type == "cuda" and p.dtype.is_floating_point for p in params):
            raise ValueError("AdamW: fused=True needs floating-point CUDA parameters; use foreach=True elsewhere")
        self.defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                         "amsgrad": False, "maximize": False, "foreach": foreach, "fused": fused}
        self.param_groups = [dict(self.defaults, params=params)]
        self.state: dict = {}

    def init_state(self):
        """Every parameter's state made now (zeros, as the first step would make them)."""
        for group in self.param_groups:
            for p in group["params"]:
                if not self.state.get(p):
                    self.state[p] = self._zero_state(p, group)

    @staticmethod
    def _zero_state(p: torch.Tensor, group: dict) -> dict:
        # As torch's AdamW makes it: the step a float32 scalar, on the device for the fused kernel.
        step = torch.zeros((), dtype=torch.float32, device=p.device if group["fused"] else "cpu")
        return {"step": step,
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamW does not support sparse gradients")
                st = self.state.get(p)
                if not st:
                    st = self.state[p] = self._zero_state(p, group)
                params.append(p)
                grads.append(p.grad)
                exp_avgs.append(st["exp_avg"])
                exp_avg_sqs.append(st["exp_avg_sq"])
                steps.append(st["step"])
            if not params:
                continue
            beta1, beta2 = group["betas"]
            adamw(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=group["foreach"], fused=group["fused"],
                  has_complex=any(torch.is_complex(p) for p in params), amsgrad=False, beta1=beta1, beta2=beta2,
                  lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)

    def zero_grad(self, set_to_none: bool = True):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_()
                    p.grad.zero_()
