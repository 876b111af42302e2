"""The lines a training run prints on stdout, read by the coordinator's curves, `motley job
logs`, the benches and the tests (a contract: python/README.md, "The reference trainer"): one per step, one per
evaluation, one memory line after the first step.
"""

from __future__ import annotations

import json
from typing import Optional

import torch


def emit(step: int, loss: float, tokens: int = 0, step_s: float = 0.0, loss_scale: float = 1.0,
         skipped: bool = False, flops_per_token: float = 0.0, peak_tflops: Optional[float] = None,
         epoch: int = 0, again: bool = False):
    """One progress line: the global mean loss, tokens per second, the step's wall seconds, the
    loss scale the step ran with and whether an overflow skipped its update; `mfu` (components.mfu)
    when the GPUs' summed peak is known; the job's membership epoch (0 until a replica is lost,
    docs/keep-going.md); `"again": true` on a line a new leader prints a second time (the old one
    may have gone before printing it)."""
    from .mfu import mfu

    tps = tokens / step_s if step_s > 0 else 0.0
    line = {"step": step, "loss": loss, "tokens_per_s": round(tps, 3), "step_s": round(step_s, 6),
            "loss_scale": loss_scale, "skipped": skipped, "epoch": epoch}
    u = mfu(tps, flops_per_token, peak_tflops)
    if u is not None:
        line["mfu"] = round(u, 5)
    if again:
        line["again"] = True
    print(json.dumps(line), flush=True)


def memory_line(model, opt, device, masters=()) -> str:
    """{"memory": {...}}, MB: what the rank's parameters (with ZeRO-1's fp32 masters kept beside
    half-precision parameters), gradients and optimizer state hold and its peak (CUDA:
    max_memory_allocated; CPU: the process's peak RSS)."""
    import resource

    def mb(ts):
        return round(sum(t.numel() * t.element_size() for t in ts) / 2**20, 3)

    params = list(model.parameters())
    params += [m for m in masters if not any(m is p for p in params)]
    state = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    peak = (torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return json.dumps({"memory": {"params_mb": mb(params), "grads_mb": mb([p.grad for p in params if p.grad is not None]),
                                  "optimizer_mb": mb(state), "peak_mb": round(peak, 3), "device": device.type}})


def emit_eval(step: int, loss: float):
    print(json.dumps({"step": step, "eval_loss": loss}), flush=True)


def log_samples(path: Optional[str], step: int, ids):
    if path and ids:
        with open(path, "a") as f:
            f.write(json.dumps({"step": step, "samples": list(ids)}) + "\n")
