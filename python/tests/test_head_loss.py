"""The chunked head loss (models/head_loss.py) against the unfused head: F.linear then
F.cross_entropy on the float logits, in every precision the trainer runs, with padding targets,
chunks that do not divide the tokens, a loss scale, and no gradient under no_grad. On CUDA too
where there is one (python/gpu-check's machine)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from motley_torch.models import head_loss
from motley_torch.models.head_loss import chunk_tokens, group_tokens, linear_cross_entropy

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# fp32: the same sums in another order. Half: the logit gradient is rounded to the half type
# before the matmuls on both sides, but the weight gradient is summed over groups of chunks in
# fp32 here and in one half-type matmul by the unfused head: a few half-type ulps of the largest
# value.
TOL = {None: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def unfused(h, w, t, dtype, dev):
    ctx = torch.autocast(dev, dtype=dtype) if dtype else contextlib.nullcontext()
    with ctx:
        logits = F.linear(h, w)
    return F.cross_entropy(logits.float().reshape(-1, w.shape[0]), t.reshape(-1), reduction="sum", ignore_index=-100)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16])
def test_equals_the_unfused_head(dev, dtype):
    if dev == "cpu" and dtype == torch.float16:
        pytest.skip("fp16 matmuls are the GPU's (the trainer's CPU fp16 runs autocast's CPU kernels, tested in "
                    "test_precision)")
    torch.manual_seed(0)
    scale = 0.37
    h = torch.randn(3, 50, 32, device=dev, requires_grad=True)
    w = torch.randn(1000, 32, device=dev, requires_grad=True)
    t = torch.randint(0, 1000, (3, 50), device=dev)
    t[0, :5] = -100
    want = unfused(h, w, t, dtype, dev)
    (want * scale).backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ctx = torch.autocast(dev, dtype=dtype) if dtype else contextlib.nullcontext()
    with ctx:
        got = linear_cross_entropy(h, w, t, chunk=40, grad_scale=scale)
    assert got.dtype == torch.float32
    (got * scale).backward()
    tol = TOL[dtype]
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-5 if dtype is None else 1e-3)
    assert (h.grad - gh).abs().max().item() <= tol * gh.abs().max().item()
    assert (w.grad - gw).abs().max().item() <= tol * gw.abs().max().item()


def test_other_backward_scales_and_no_grad():
    torch.manual_seed(1)
    h = torch.randn(2, 9, 16, requires_grad=True)
    w = torch.randn(70, 16, requires_grad=True)
    t = torch.randint(0, 70, (2, 9))
    (unfused(h, w, t, None, "cpu") * 5.0).backward()
    gh = h.grad.clone()
    h.grad = w.grad = None
    # Announced 1.0, brought 5.0: still the right gradient.
    (linear_cross_entropy(h, w, t, chunk=4) * 5.0).backward()
    assert (h.grad - gh).abs().max().item() <= 1e-5 * gh.abs().max().item()
    with torch.no_grad():
        v = linear_cross_entropy(h, w, t, chunk=4)
    assert not v.requires_grad
    assert float(v) == pytest.approx(float(unfused(h, w, t, None, "cpu").detach()), rel=1e-6)
    with pytest.raises(ValueError, match="grad_scale"):
        linear_cross_entropy(h, w, t, grad_scale=0.0)


@pytest.mark.parametrize("chunks_per_group", [1, 2, 3, None])
def test_weight_gradient_groups(monkeypatch, chunks_per_group):
    """Groups of one chunk, of two (the last one short: 5 chunks), of three, and one group of all:
    the same gradients as the unfused head (fp32), and a second backward is refused by name."""
    torch.manual_seed(2)
    h = torch.randn(2, 25, 16, requires_grad=True)
    w = torch.randn(300, 16, requires_grad=True)
    t = torch.randint(0, 300, (2, 25))
    unfused(h, w, t, None, "cpu").backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    if chunks_per_group is not None:
        monkeypatch.setattr(head_loss, "GROUP_BYTES", chunks_per_group * 10 * 300 * 4)
        assert group_tokens(50, 300, 10, 4) == min(50, 10 * chunks_per_group)
    loss = linear_cross_entropy(h, w, t, chunk=10)
    loss.backward(retain_graph=True)
    assert (h.grad - gh).abs().max().item() <= 1e-5 * gh.abs().max().item()
    assert (w.grad - gw).abs().max().item() <= 1e-5 * gw.abs().max().item()
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


def test_groups_hold_at_most_the_budget():
    assert group_tokens(8192, 128256, 1046, 2) == 4184  # 1 GiB of bf16 logit gradients: 4 chunks
    assert group_tokens(16384, 32000, 4194, 2) == 16384  # never more than the tokens
    assert group_tokens(8192, 128256, 1046, 2, budget=1) == 1046  # never less than a chunk


def test_chunks_hold_at_most_the_budget():
    assert chunk_tokens(16384, 128256) == 1046  # 512 MiB of fp32 logits
    assert chunk_tokens(100, 32000) == 100  # never more than the tokens
    assert chunk_tokens(10**6, 10**9) == 128  # never fewer than 128


def test_the_planner_prices_the_same_chunks():
    """solver/src/cost/activations.rs prices the head's peak with this module's chunk budget."""
    import os
    import re

    from motley_torch.models.head_loss import CHUNK_BYTES, GROUP_BYTES

    with open(os.path.join(os.path.dirname(__file__), "..", "..", "solver", "src", "cost", "activations.rs")) as f:
        src = f.read()
    m = re.search(r"pub const HEAD_CHUNK_BYTES: f64 = ([0-9.]+) \* 1024\.0 \* 1024\.0;", src)
    assert m, "HEAD_CHUNK_BYTES not found in activations.rs"
    assert float(m.group(1)) * 2**20 == CHUNK_BYTES
    m = re.search(r"pub const HEAD_GROUP_BYTES: f64 = 1024\.0 \* 1024\.0 \* 1024\.0;", src)
    assert m and GROUP_BYTES == 2**30, "HEAD_GROUP_BYTES (activations.rs) and GROUP_BYTES differ"
