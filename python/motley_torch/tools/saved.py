"""What autograd keeps for the backward pass, counted: every tensor saved by a forward (each
storage once, parameters excluded), through `torch.autograd.graph.saved_tensors_hooks`. The
cost model's activation estimate (`solver/src/cost/activations.rs`) is held to these counts
(`bench/activation_bytes.py`, `tests/test_activation_bytes.py`)."""

from __future__ import annotations

from typing import Callable

import torch


def saved_bytes(module: torch.nn.Module, forward: Callable[[], object]) -> int:
    """Bytes `forward()` saves for backward, outside `module`'s parameters."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen.setdefault(st.data_ptr(), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(seen.values())


def layer_token_bytes(spec, precision: str, half_weights: bool, seq: int = 256, compiled: bool = False) -> dict:
    """One layer of `spec` as the trainer runs it (`precision` under autocast; the weights in
    the half type when `half_weights`, as ZeRO-1 keeps them; compiled with torch.compile when
    `compiled`, as `--compile on` does): bytes saved per token, per layer parameter (the
    weights' half copies autocast keeps, whatever the tokens), and (gpt, whose attention keeps
    its probabilities) per token and key. Compiled, the layer's input requires a gradient, as
    every layer's does in a run; the eager counts the cost model was first held to leave it
    without (the first norm's saved input then goes uncounted)."""
    from ..models.transformer import Block
    from ..components.precision import autocast

    torch.manual_seed(0)
    block = Block(spec, None, 0, 1)
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    if half_weights:
        block.to(half)
    amp = autocast(precision, torch.device("cpu"))
    stream = half if half_weights else torch.float32
    if compiled:
        block.compile()

    def count(s):
        x = torch.randn(1, s, spec.hidden, dtype=stream, requires_grad=compiled)
        if compiled:
            with amp():  # compiled for this length outside the count
                block(x)

        def fwd():
            with amp():
                return block(x)

        return saved_bytes(block, fwd)

    # bytes(s) = fixed + per_token * s + per_token_key * s^2, solved on three lengths.
    s1, s2, s3 = seq, 2 * seq, 3 * seq
    c1, c2, c3 = count(s1), count(s2), count(s3)
    quad = ((c3 - c2) / (s3 - s2) - (c2 - c1) / (s2 - s1)) / (s3 - s1)
    per_token = (c2 - c1) / (s2 - s1) - quad * (s1 + s2)
    fixed = c1 - per_token * s1 - quad * s1 * s1
    params = sum(p.numel() for p in block.parameters())
    return {"per_token": per_token, "per_token_key": quad, "fixed_per_param": fixed / params}
