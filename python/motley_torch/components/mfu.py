"""Model FLOPs utilisation the way the anchors report it (torchtitan, Megatron-LM, PaLM):
model FLOPs per trained token = 6 x the parameters that multiply (every matrix, the output
head included; the embedding lookup is no matmul) + 12 x layers x hidden x seq_len for
attention's QK^T and AV (causal masking not discounted), over the GPUs' dense peak for the
precision (vendor datasheets). Recomputation is not counted: MFU, not hardware utilisation.

A GPU missing from the table has no known peak (no `mfu` is reported) unless
$MOTLEY_PEAK_TFLOPS gives one, in TFLOPS per GPU.
"""

from __future__ import annotations

import os
from typing import Optional

from ..spec import ModelSpec, PlanError

# Dense tensor-core peak TFLOPS per precision (vendor datasheets; fp32 without TF32).
PEAKS = {
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "H800": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "A800": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "fp32": 91.6},
    "A10": {"bf16": 125.0, "fp16": 125.0, "fp32": 31.2},
    "V100": {"fp16": 125.0, "fp32": 15.7},
    "T4": {"fp16": 65.0, "fp32": 8.1},
}


def peak_tflops(device_name: str, precision: str) -> Optional[float]:
    """$MOTLEY_PEAK_TFLOPS, else the datasheet peak of the first table entry (longest first)
    whose name is in the device's name; None when unknown."""
    given = os.environ.get("MOTLEY_PEAK_TFLOPS", "").strip()
    if given:
        try:
            value = float(given)
        except ValueError:
            value = -1.0
        if not value > 0:
            raise PlanError(f"MOTLEY_PEAK_TFLOPS: {given!r} is not a positive number of TFLOPS per GPU; "
                            f"unset it to use the datasheet table")
        return value
    up = device_name.upper()
    for key in sorted(PEAKS, key=len, reverse=True):
        if key in up:
            return PEAKS[key].get(precision)
    return None


def device_peak(device, precision: str) -> Optional[float]:
    """The peak of a torch device (None on the CPU unless $MOTLEY_PEAK_TFLOPS says one)."""
    import torch

    if device.type == "cuda":
        return peak_tflops(torch.cuda.get_device_name(device), precision)
    return peak_tflops("cpu", precision)


def train_flops_per_token(spec: ModelSpec, seq_len: int) -> float:
    h, ffn = spec.hidden, spec.ffn_hidden
    kv = spec.kv_heads * h // spec.heads
    per_layer = 2 * h * h + 2 * h * kv + (3 if spec.gated_mlp else 2) * h * ffn
    params = spec.layers * per_layer + spec.vocab * h
    return 6.0 * params + 12.0 * spec.layers * h * seq_len


def mfu(tokens_per_s: float, flops_per_token: float, peak_total_tflops: Optional[float]) -> Optional[float]:
    """tokens/s x FLOPs per token over the summed peak of the GPUs that trained them."""
    if not peak_total_tflops or tokens_per_s <= 0:
        return None
    return tokens_per_s * flops_per_token / (peak_total_tflops * 1e12)
