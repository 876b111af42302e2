"""Mixed precision as the plan prices it: fp32 master weights and optimizer state, compute in
the half type (torch.autocast), and for fp16 one dynamic loss scale for the whole job.

`--dtype auto` follows the plan's `precision` (the planner's rule: bf16 when every GPU of the
plan has bf16 tensor cores, fp16 otherwise: V100, T4 and P100 have none) on a CUDA device;
on the CPU, where the planner's GPUs are only stood in for, auto is fp32. bf16 and fp16 also
run on the CPU when asked for (autocast's CPU kernels), so the tests take the same path.

Loss scaling (fp16): the loss is multiplied by the scale before backward; after the gradients
are synchronised every rank checks its own for inf/NaN and one all-reduce (MAX) over the world
agrees: on an overflow anywhere every rank skips the step (no optimizer update) and the scale
halves; otherwise the gradients are divided by the scale, the step is taken, and after
`window` clean steps in a row the scale doubles. The scale and the clean-step count are saved
in every checkpoint's rank file and restored with it, so a restored job goes on with the scale
it had.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Optional

import torch

from ..spec import PlanError

HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
CHOICES = ("auto", "bf16", "fp16", "fp32")


def resolve(asked: str, plan_precision: Optional[str], device: torch.device) -> str:
    """The compute type a rank (or the single process) trains in."""
    if asked not in CHOICES:
        raise PlanError(f"--dtype: {asked!r}; use one of {', '.join(CHOICES)}")
    if asked == "auto":
        if device.type != "cuda":
            return "fp32"
        if plan_precision is not None:
            asked = plan_precision
        else:
            asked = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    if asked == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise PlanError(f"--dtype: bf16 on {torch.cuda.get_device_name(device)}, which has no bf16; use fp16 "
                        f"(loss scaling) or auto")
    return asked


def autocast(precision: str, device: torch.device):
    """A context factory: the forward passes run under it."""
    if precision == "fp32":
        return contextlib.nullcontext
    dtype = HALF[precision]
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


class LossScaler:
    """One dynamic loss scale for the whole job (fp16); for other types a scale of 1 that
    never skips."""

    def __init__(self, enabled: bool, initial: float = 2.0 ** 16, window: int = 2000):
        if initial <= 0:
            raise PlanError(f"--initial-loss-scale: {initial}, must be positive")
        if window < 1:
            raise PlanError(f"--loss-scale-window: {window}, must be at least 1")
        self.enabled, self.scale, self.window, self.clean = enabled, float(initial) if enabled else 1.0, window, 0

    def factor(self) -> float:
        return self.scale

    def step(self, params: Iterable[torch.nn.Parameter], agree=None) -> bool:
        """After the gradients are synchronised: True when the step must be skipped (an
        overflow on some rank; `agree(flag) -> flag` makes every rank see the same). Otherwise
        the gradients are unscaled in place."""
        params = [p for p in params if p.grad is not None]
        if not self.enabled:
            return False
        # One fused check-and-unscale per (device, type) of gradients and one host read for the
        # step, as torch.amp.GradScaler does, not a host sync per parameter. Unscaled before the
        # verdict: on an overflow the gradients are dropped anyway.
        groups = {}
        for p in params:
            groups.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
        found = None
        for (device, _), grads in groups.items():
            f = torch.zeros(1, dtype=torch.float32, device=device)
            inv = torch.full((1,), 1.0 / self.scale, dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, f, inv)
            found = f if found is None else found + f.to(found.device)
        local = found is not None and bool(found.item() > 0)
        overflow = agree(local) if agree is not None else local
        if overflow:
            for p in params:
                p.grad = None
            self.scale /= 2.0
            self.clean = 0
            return True
        self.clean += 1
        if self.clean % self.window == 0:
            self.scale *= 2.0
        return False

    def state(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean}

    def load(self, state: Optional[dict], where: str):
        if not self.enabled or state is None:
            return
        scale, clean = state.get("scale"), state.get("clean_steps")
        if not isinstance(scale, (int, float)) or scale <= 0 or not isinstance(clean, int) or clean < 0:
            raise PlanError(f"{where}: scaler {state!r} is not a loss scale and a clean-step count")
        self.scale, self.clean = float(scale), clean
