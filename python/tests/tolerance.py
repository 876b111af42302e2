"""Every numeric equality of the tests in one rule: a tolerance relative to the size of what is
compared, with its reason.

Two computations of the same maths in the same floating-point type that differ only in the
order of their operations (transformers' kernels against ours, a plan's reduction order against
one process's, TP partial sums against whole matrix products) differ by rounding alone. Each
rounded operation on a value's path adds a relative error of at most the unit roundoff
u = eps/2 of the magnitudes involved (Higham, "Accuracy and Stability of Numerical
Algorithms", 2nd ed., section 2.2, the standard model; section 3.1 for a chain of them): after
`ops` such steps each side is within ops * u of the exact result, so the two are within

    |actual - expected| <= ops * eps * max|expected|

with eps the type's machine epsilon (2^-23 for fp32) and `ops` the length of the longest chain
of rounded operations whose order differs, counted at each call site with its reason. Where
both sides run the same operations on the same values in the same order (a restore onto the
same plan, recomputation on and off, a sum over a ring of two), they are asserted equal to the
bit instead; bf16 and fp16 runs are compared in their own type's eps. A wrong
formula, a wrong constant or a wrong weight moves a result by far more than that:
test_llama.py's test_a_real_error_fails_the_margin (a wrong rope_theta or norm epsilon, a
dropped bias, one matrix off by 1e-4) and test_tolerance.py (a learning rate off by 1%) show it.

Set MOTLEY_TOLERANCE_LOG=FILE to append, per check, what was compared, the difference and the
bound as a JSON line: how far inside its margin each check passes, measured.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

EPS32 = torch.finfo(torch.float32).eps  # 2^-23: fp32's 24-bit significand
EPS_BF16 = torch.finfo(torch.bfloat16).eps  # 2^-7: bf16's 8-bit significand
EPS_FP16 = torch.finfo(torch.float16).eps  # 2^-10: fp16's 11-bit significand

# The forward pass of one block, counted as the operations whose rounding order may differ
# between two implementations: the first norm (a reduction over hidden), the q/k/v projections,
# the rotary embedding (or the position table's addition), the attention scores, the softmax,
# the weighted sum over keys, the output projection, the second norm, the MLP's first
# projection with its activation (SwiGLU: gate/up, SiLU and their product; GPT: fc1 and GELU),
# its second projection.
OPS_PER_BLOCK = 10
# The final RMSNorm and the head's projection.
OPS_HEAD = 2

Number = Union[float, int]
Values = Union[torch.Tensor, Number, Sequence[Number]]


def forward_ops(layers: int) -> int:
    """The rounding steps on the way from the tokens to the logits of a `layers`-block model."""
    return OPS_PER_BLOCK * layers + OPS_HEAD


def loss_ops(layers: int) -> int:
    """The mean token loss: the logits' chain, then log-sum-exp over the vocabulary and the mean
    over the tokens (two reductions whose order differs)."""
    return forward_ops(layers) + 2


def gradient_ops(layers: int) -> int:
    """A gradient is the forward chain, the backward pass back through the same chain, and the
    sum of every token's contribution (a reduction whose order differs too): three times the
    forward's steps."""
    return 3 * forward_ops(layers)


def tp_forward_ops(layers: int, tp: int) -> int:
    """TP sums partial products over its tp ranks where one process makes one matrix product:
    tp - 1 more additions on each row-parallel output (the attention's output projection, the
    MLP's second) of every block."""
    return 2 * (tp - 1) * layers


def tp_gradient_ops(layers: int, tp: int) -> int:
    """... and as many on each column-parallel input's gradient (q/k/v, the MLP's first) in the
    backward pass."""
    return 2 * tp_forward_ops(layers, tp)


def _tensor(x: Values) -> torch.Tensor:
    if torch.is_tensor(x):
        return x.detach().double()
    if isinstance(x, (int, float)):
        return torch.tensor([float(x)], dtype=torch.float64)
    return torch.tensor([float(v) for v in x], dtype=torch.float64)


def bound(expected: Values, ops: float, eps: float = EPS32, scale: Optional[float] = None) -> float:
    """ops * eps * max|expected| (or * scale: the size of the terms a result sums, where they
    cancel to far less): the largest difference rounding alone explains."""
    return ops * eps * (_tensor(expected).abs().max().item() if scale is None else scale)


def excess(actual: Values, expected: Values, ops: float, eps: float = EPS32, scale: Optional[float] = None) -> float:
    """max|actual - expected| in units of the bound: <= 1 passes, > 1 fails."""
    a, e = _tensor(actual), _tensor(expected)
    if a.shape != e.shape:
        raise AssertionError(f"shapes differ: {tuple(a.shape)} against {tuple(e.shape)}")
    limit = bound(e, ops, eps, scale)
    diff = (a - e).abs().max().item() if a.numel() else 0.0
    if limit == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / limit


def _log(what: str, actual: Values, expected: Values, ops: float, eps: float, ratio: float, scale: Optional[float]):
    path = os.environ.get("MOTLEY_TOLERANCE_LOG")
    if not path:
        return
    a, e = _tensor(actual), _tensor(expected)
    diff = (a - e).abs().max().item() if a.numel() else 0.0
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
    with open(path, "a") as f:
        f.write(json.dumps({"test": test, "what": what, "diff": diff, "bound": bound(e, ops, eps, scale), "ops": ops,
                            "eps": eps, "scale": e.abs().max().item() if scale is None else scale,
                            "ratio": ratio}) + "\n")


def assert_close_rel(actual: Values, expected: Values, ops: float, what: str, eps: float = EPS32,
                     scale: Optional[float] = None) -> float:
    """|actual - expected| <= ops * eps * max|expected| (or * scale); the message names what, the
    difference, the bound and how it was made. Returns the difference in units of the bound."""
    ratio = excess(actual, expected, ops, eps, scale)
    _log(what, actual, expected, ops, eps, ratio, scale)
    if not ratio <= 1.0:
        a, e = _tensor(actual), _tensor(expected)
        diff = (a - e).abs().max().item()
        size = f"max|expected| {e.abs().max().item():.4g}" if scale is None else f"the terms' size {scale:.4g}"
        raise AssertionError(f"{what}: differs by {diff:.4g}, over the bound {ops:.4g} x eps {eps:.3g} x {size} = "
                             f"{bound(e, ops, eps, scale):.4g} ({ratio:.3g} times it)")
    return ratio


def step_ops(step: int, layers: int) -> float:
    """The rounding steps on the way to a training run's loss at `step`, against another run of
    the same maths in another order: the loss's own forward chain (loss_ops), and the
    parameters' drift, each of the `step` earlier updates carrying its gradient's rounding
    (gradient_ops; AdamW divides an update by the gradient's running RMS, so a relative error
    in a gradient is the same relative error in the update, neither damped nor amplified). The
    updates' errors are independent, of either sign, and add as a random walk does, by the
    square root of their number (Higham, section 2.8, the statistical rule of thumb sqrt(n) u)."""
    return loss_ops(layers) + math.sqrt(step) * gradient_ops(layers)


def assert_steps_close(actual: Sequence[Number], expected: Sequence[Number], layers: int, what: str,
                       steps: Optional[Sequence[int]] = None) -> float:
    """Per-step fp32 losses of two training runs of a `layers`-block model whose steps differ by
    rounding alone, step i's within step_ops(i, layers) * eps * |loss i| (`steps`: the step of
    each pair, default 0, 1, ...; an eval loss at step k counts as step k: the parameters after
    k updates). Returns the largest difference in units of its step's bound."""
    return _steps_close(actual, expected, lambda i: step_ops(i, layers), what, EPS32, steps)


def assert_half_steps_close(actual: Sequence[Number], expected: Sequence[Number], what: str, eps: float,
                            steps: Optional[Sequence[int]] = None) -> float:
    """Per-step losses of runs in a half type (eps: EPS_BF16 or EPS_FP16), against fp32 or the
    same type in another order: a half rounding moves a product's input by at most one unit
    roundoff u = eps / 2, and the loss, a mean over the batch's tokens of their log-softmax,
    averages those roundings; so at most one u of the loss for the step's own forward pass and
    one per earlier update, adding as a random walk: (1 + sqrt(i)) * u * |loss i| at step i."""
    return _steps_close(actual, expected, lambda i: 0.5 * (1 + math.sqrt(i)), what, eps, steps)


def _steps_close(actual, expected, ops_at, what: str, eps: float, steps) -> float:
    if len(actual) != len(expected):
        raise AssertionError(f"{what}: {len(actual)} steps against {len(expected)}")
    steps = list(range(len(actual))) if steps is None else list(steps)
    worst = 0.0
    for i, a, e in zip(steps, actual, expected):
        worst = max(worst, assert_close_rel(a, e, ops_at(i), f"{what}, step {i}", eps))
    return worst


def layers_of(model_file) -> int:
    """A model file's layer count (the op counts above are per layer)."""
    import yaml

    return int(yaml.safe_load(Path(model_file).read_text())["layers"])
