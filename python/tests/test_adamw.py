"""The trainer's AdamW (components/adamw.py) steps exactly as torch.optim.AdamW does, keeps its
state in torch's layout, and never imports torch._dynamo (the reason it exists)."""

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from motley_torch.components.adamw import AdamW
from motley_torch.components.stage_init import make_optimizer


def _params(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*shape, generator=g)) for shape in ((7, 5), (5,), (3, 4, 2))]


def _train(opt, params, steps: int, seed: int):
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("foreach", [True, False])
def test_steps_equal_torchs_adamw_bit_for_bit(foreach):
    # The same kernel (torch.optim.adamw.adamw) over the same inputs: equal to the last bit, not
    # within a tolerance. A wrong beta, eps, decay or bias correction changes the bits.
    ours_p, theirs_p = _params(0), _params(0)
    kw = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=foreach)
    ours, theirs = AdamW(ours_p, **kw), torch.optim.AdamW(theirs_p, **kw)
    _train(ours, ours_p, 6, seed=0)
    _train(theirs, theirs_p, 6, seed=0)
    for a, b in zip(ours_p, theirs_p):
        assert torch.equal(a, b)
        sa, sb = ours.state[a], theirs.state[b]
        assert set(sa) == set(sb) == {"step", "exp_avg", "exp_avg_sq"}
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k
            assert sa[k].dtype == sb[k].dtype and sa[k].device == sb[k].device, k
    # And a different decay is seen: the comparison can fail.
    other_p = _params(0)
    _train(AdamW(other_p, **dict(kw, weight_decay=0.0)), other_p, 6, seed=0)
    assert not torch.equal(other_p[0], ours_p[0])


def test_the_trainers_optimizer_makes_its_state_at_once_and_skips_parameters_without_gradients():
    params = _params(1)
    opt = make_optimizer(params, SimpleNamespace(lr=1e-3, weight_decay=0.01))
    assert opt.defaults["foreach"] and not opt.defaults["fused"]
    for p in params:
        st = opt.state[p]
        assert float(st["step"]) == 0.0 and not st["exp_avg"].any() and not st["exp_avg_sq"].any()
    before = params[1].detach().clone()
    params[0].grad = torch.ones_like(params[0])
    opt.step()
    assert float(opt.state[params[0]]["step"]) == 1.0
    assert float(opt.state[params[1]]["step"]) == 0.0
    assert torch.equal(params[1], before)
    opt.zero_grad(set_to_none=False)
    assert params[0].grad is not None and not params[0].grad.any()
    opt.zero_grad()
    assert params[0].grad is None


def test_bad_settings_name_what_to_change():
    with pytest.raises(ValueError, match="beta"):
        AdamW(_params(2), lr=1e-3, betas=(0.9, 1.5))
    with pytest.raises(ValueError, match="choose one"):
        AdamW(_params(2), lr=1e-3, fused=True, foreach=True)
    with pytest.raises(ValueError, match="CUDA"):
        AdamW(_params(2), lr=1e-3, fused=True)


def test_a_rank_that_does_not_compile_never_imports_dynamo():
    # torch.optim.AdamW's wrappers import torch._dynamo on first use (1.3-1.9 s of CPU per rank).
    code = (
        "import sys, torch\n"
        "from types import SimpleNamespace\n"
        "from motley_torch.components.stage_init import make_optimizer\n"
        "p = [torch.nn.Parameter(torch.zeros(3))]\n"
        "opt = make_optimizer(p, SimpleNamespace(lr=1e-3, weight_decay=0.0))\n"
        "p[0].grad = torch.ones(3); opt.step(); opt.zero_grad()\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
