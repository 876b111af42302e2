"""The last stage's head and loss without the full logits.

`sum over tokens of cross_entropy(hidden @ W^T, target)` is computed a chunk of tokens at a
time: each chunk's logits (in the compute type, then fp32 for the softmax, as the unfused
`F.cross_entropy(logits.float(), ...)` does) give the chunk's loss and, right away, the
gradients of the summed loss with respect to the chunk's hidden states and to W; the logits
are then dropped. At most one chunk's `[tokens, vocab]` is ever alive, instead of the whole
micro-batch's in fp32 plus its half copy and its gradient (with a 128k vocabulary the largest
activation of the last stage). The backward pass only scales the kept gradients by the
incoming gradient (the loss scale over the batch's tokens), so no matmul is recomputed: the
FLOPs are those of the unfused head (forward, data and weight gradients), the technique of
Liger-Kernel's fused linear cross-entropy.

The weight gradient is not accumulated chunk by chunk: the chunks' logit gradients (in the
compute type) are kept for a group of at most `GROUP_BYTES`, and the group's weight gradient is
one matmul over all of its tokens, added once to the fp32 accumulator. Added per chunk, the
`vocab x hidden` fp32 accumulator would be read and written once per chunk (for a 128k
vocabulary at 8,192 tokens, eight chunks and about 40 GB of memory traffic a step; measured
on an H100 in BENCHMARKS.md); one group is also the unfused head's own arithmetic (one matmul over the
micro-batch's tokens, rounded to the compute type once).

Targets of `ignore_index` (-100, padding) count for nothing, as in `F.cross_entropy`.
"""

from __future__ import annotations

from typing import Optional

import torch

IGNORE = -100
# Bytes of fp32 logits one chunk may hold.
CHUNK_BYTES = 512 * 2**20
# Bytes of logit gradients (in the compute type) kept for one weight-gradient matmul.
GROUP_BYTES = 1024 * 2**20


def chunk_tokens(tokens: int, vocab: int, budget: int = CHUNK_BYTES) -> int:
    """Tokens per chunk: as many as `budget` bytes of fp32 logits hold (at least 128)."""
    return min(tokens, max(128, budget // (4 * vocab)))


def group_tokens(tokens: int, vocab: int, chunk: int, element_bytes: int, budget: Optional[int] = None) -> int:
    """Tokens per weight-gradient group: whole chunks, as many as `budget` (default
    `GROUP_BYTES`) bytes of logit gradients hold (at least one chunk)."""
    budget = GROUP_BYTES if budget is None else budget
    per_chunk = chunk * vocab * element_bytes
    return min(tokens, chunk * max(1, budget // per_chunk))


def _softmax_grad(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype):
    """(summed cross-entropy in fp32, `scale` x d loss / d logits in `out_dtype`) of logits
    [n, vocab] (any float type; the softmax is taken in fp32)."""
    x = logits.float()
    keep = targets != IGNORE
    safe = torch.where(keep, targets, 0)
    lse = torch.logsumexp(x, dim=-1)
    picked = x.gather(1, safe[:, None])[:, 0]
    loss = torch.where(keep, lse - picked, 0.0).sum()
    onehot = torch.arange(x.shape[1], device=x.device)[None, :] == safe[:, None]
    grad = (torch.exp(x - lse[:, None]) - onehot.float()) * (keep[:, None] * scale)
    return loss, grad.to(out_dtype)


def _loss_only(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    x = logits.float()
    keep = targets != IGNORE
    picked = x.gather(1, torch.where(keep, targets, 0)[:, None])[:, 0]
    return torch.where(keep, torch.logsumexp(x, dim=-1) - picked, 0.0).sum()


_compiled_softmax_grad = None


def softmax_grad(logits, targets, scale, out_dtype, compiled: bool):
    """`_softmax_grad`, fused by torch.compile when `compiled` (the trainer's --compile): the
    chunk's logits are read twice and its gradient written once, in the half type, instead of
    the half logits, their fp32 copy and every intermediate going through memory. The scale is
    a tensor so a changing loss scale recompiles nothing."""
    global _compiled_softmax_grad
    if not compiled:
        return _softmax_grad(logits, targets, scale, out_dtype)
    if _compiled_softmax_grad is None:
        _compiled_softmax_grad = torch.compile(_softmax_grad, dynamic=False)
    return _compiled_softmax_grad(logits, targets, scale, out_dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, compute_dtype, chunk, compiled, need, grad_scale):
        shape = hidden.shape
        h = hidden.reshape(-1, shape[-1])
        t = targets.reshape(-1)
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            w = weight.to(compute_dtype)
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            grad_h = torch.empty_like(h) if need and hidden.requires_grad else None
            want_w = need and weight.requires_grad
            grad_w = None
            group = group_tokens(h.shape[0], weight.shape[0], chunk, w.element_size())
            kept = None  # the group's logit gradients, for its one weight-gradient matmul
            # Scaled before the cast to the half type, as the unfused head's logit gradient is:
            # fp16 loss scaling then sees the same overflows.
            scale = torch.tensor(grad_scale, dtype=torch.float32, device=hidden.device)
            for a in range(0, h.shape[0], chunk):
                b = min(a + chunk, h.shape[0])
                hc = h[a:b].to(compute_dtype)
                logits = hc @ w.t()
                if not need:
                    total += _loss_only(logits, t[a:b])
                    continue
                loss, g = softmax_grad(logits, t[a:b], scale, compute_dtype, compiled)
                del logits
                total += loss
                if grad_h is not None:
                    grad_h[a:b] = g @ w
                if not want_w:
                    continue
                g0 = a - a % group
                g1 = min(g0 + group, h.shape[0])
                if g0 == a and b == g1:  # a group of one chunk: its gradient as it is
                    kept = g
                else:
                    if kept is None:
                        kept = torch.empty((g1 - g0, g.shape[1]), dtype=g.dtype, device=g.device)
                    kept[a - g0:b - g0] = g
                del g
                if b == g1:
                    part = kept.t() @ h[g0:g1].to(compute_dtype)
                    kept = None
                    if grad_w is None:
                        grad_w = part.float()
                    else:
                        grad_w.add_(part)
                    del part
            if want_w and grad_w is None:
                grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        # Kept on the context, not saved, so the backward hands them on as the only reference:
        # autograd then takes each as the parameter's gradient instead of copying it (a
        # `vocab x hidden` fp32 copy of the weight gradient).
        ctx.grads = (grad_h, grad_w)
        ctx.shape = shape
        ctx.weight_dtype = weight.dtype
        ctx.grad_scale = grad_scale
        return total

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.grads is None:
            raise RuntimeError("linear_cross_entropy: a second backward through the same loss (retain_graph) is not "
                               "supported: its gradients were computed once, in the forward")
        grad_h, grad_w = ctx.grads
        ctx.grads = None
        # 1.0 exactly when the caller's backward brings the gradient it announced.
        factor = grad_out / ctx.grad_scale
        gh = grad_h.mul_(factor).reshape(ctx.shape) if grad_h is not None else None
        gw = grad_w.mul_(factor).to(ctx.weight_dtype) if grad_w is not None else None
        return gh, gw, None, None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk: Optional[int] = None, compiled: bool = False, grad_scale: float = 1.0) -> torch.Tensor:
    """sum(cross_entropy(hidden @ weight^T, targets)) in fp32, chunked. The logits' type is
    autocast's when autocast is on (as the unfused head computes them), else the weight's.
    `grad_scale`: the gradient the backward pass will bring to this sum (the loss scale over
    the batch's tokens); the kept gradients are computed at that scale (any other still gives
    the right gradient, rescaled)."""
    if not grad_scale > 0:
        raise ValueError(f"grad_scale {grad_scale} must be positive")
    dev = hidden.device.type
    compute = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else weight.dtype
    tokens = hidden.numel() // hidden.shape[-1]
    n = chunk or chunk_tokens(tokens, weight.shape[0])
    # Inside a Function's forward grad mode is always off: whether a backward will follow is
    # decided here.
    need = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _LinearCrossEntropy.apply(hidden, weight, targets, compute, n, compiled, need, float(grad_scale))
