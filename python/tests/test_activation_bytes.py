"""The runtime's saved activations, counted tensor by tensor, are the numbers the cost model's
estimate is held to (solver/src/cost/activations.rs, test the_estimate_is_the_runtimes_count):
a change to the model's forward that keeps more or less must update both."""

from __future__ import annotations

import pytest

from motley_torch.spec import ModelSpec
from motley_torch.tools.saved import layer_token_bytes

LLAMA = ModelSpec.from_dict({"name": "count", "family": "llama", "layers": 1, "hidden": 1024, "heads": 16,
                             "kv_heads": 8, "ffn_hidden": 2816, "seq_len": 512, "vocab": 1000, "gated_mlp": True})


@pytest.mark.parametrize("precision,half_weights,per_token_h,fixed", [
    ("fp32", False, 80.57, 0.0), ("bf16", False, 52.32, 2.0), ("bf16", True, 42.32, 0.0)])
def test_a_llama_layer_saves_what_the_cost_model_prices(precision, half_weights, per_token_h, fixed):
    r = layer_token_bytes(LLAMA, precision, half_weights, seq=64)
    # per_token_h as the cost model's table writes it, to two decimals: half a unit of the last.
    assert r["per_token"] / 1024 == pytest.approx(per_token_h, abs=0.005), r
    # Byte counts fitted in float64: zero up to that fit's rounding (counts under 1e8, 2^-52).
    assert r["per_token_key"] == pytest.approx(0.0, abs=1e-6), "flash attention: nothing per key"
    # 2 bytes a parameter for autocast's half copies of the weights, less the norm gains it does
    # not copy (2 x 1024 of the layer's 11.8 M parameters: 3.5e-4 of them).
    assert r["fixed_per_param"] == pytest.approx(fixed, abs=1e-3), "autocast's half copies of fp32 weights"


@pytest.mark.parametrize("precision,half_weights,per_token_h", [
    ("fp32", False, 65.07), ("bf16", False, 34.57), ("bf16", True, 32.57)])
def test_a_compiled_llama_layer_saves_what_the_cost_model_prices(precision, half_weights, per_token_h):
    """torch.compile's partitioner recomputes the norms' and rotary's elementwise work: the
    compiled block saves what activations.rs prices for compiled plans (`motley plan`'s default;
    `--eager` prices the counts above)."""
    r = layer_token_bytes(LLAMA, precision, half_weights, seq=64, compiled=True)
    assert r["per_token"] / 1024 == pytest.approx(per_token_h, abs=0.005), r
    assert r["per_token_key"] == pytest.approx(0.0, abs=1e-6), "flash attention: nothing per key"


def test_gpt_attention_keeps_its_probabilities():
    gpt = ModelSpec.from_dict({"name": "count", "family": "gpt", "layers": 1, "hidden": 256, "heads": 8,
                               "seq_len": 512, "vocab": 1000})
    r = layer_token_bytes(gpt, "fp32", False, seq=32)
    # fp32 probabilities per head and key, plus the causal mask's byte per key.
    assert r["per_token_key"] == pytest.approx(4 * 8 + 1, rel=0.01), r
    # 32h + 8 per f (4h) + the LayerNorms' fp32 mean and rstd (16 bytes).
    assert r["per_token"] == pytest.approx(64 * 256 + 16, abs=1), r


def test_the_step_keeps_one_half_copy_of_each_weight():
    """Pipeline.step runs inside one disabled autocast context, so the micro-batches' forwards
    share autocast's cast of each weight (the cost model prices one copy per step, not one per
    micro-batch in flight); without it every forward makes its own."""
    import torch

    lin = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8, requires_grad=True)

    def copies(outer: bool) -> int:
        seen = set()

        def pack(t):
            if t.dtype == torch.bfloat16 and tuple(t.shape) == (8, 8):
                seen.add(t.untyped_storage().data_ptr())
            return t

        outs = []
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if outer:
                with torch.autocast("cpu", enabled=False):
                    for _ in range(3):
                        with torch.autocast("cpu", dtype=torch.bfloat16):
                            outs.append(lin(x))
            else:
                for _ in range(3):
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        outs.append(lin(x))
        return len(seen)

    assert copies(outer=True) == 1
    assert copies(outer=False) == 3
