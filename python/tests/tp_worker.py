"""Run by test_tp.py as two processes (gloo): the TP layers against plain nn.Linear."""


import torch
import torch.distributed as dist
from torch import nn

from motley_torch.spec import ModelSpec
from motley_torch.models.tp import ColumnParallelLinear, RowParallelLinear

# (Run as a script: its directory, python/tests, is first on sys.path.)
from tolerance import assert_close_rel, forward_ops, gradient_ops, tp_forward_ops, tp_gradient_ops

# One linear layer: its product (a reduction over the input) and the bias's addition; TP adds
# the partial sums' addition across the ranks.
LINEAR = 2 + 1


def close(a, b, what, ops, scale=None):
    """Within the rounding `ops` steps explain, relative to the size of b (tolerance.py)."""
    try:
        assert_close_rel(a, b, ops, what, scale=scale)
    except AssertionError as e:
        raise AssertionError(f"rank {dist.get_rank()}: {e}")


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    torch.manual_seed(0)
    x = torch.randn(3, 5, 8)
    ref1, ref2 = nn.Linear(8, 12), nn.Linear(12, 8)
    col = ColumnParallelLinear(8, 12, group=group, tp_rank=rank, tp_size=world)
    row = RowParallelLinear(12, 8, group=group, tp_rank=rank, tp_size=world)
    col.load_full(ref1.weight.detach(), ref1.bias.detach())
    row.load_full(ref2.weight.detach(), ref2.bias.detach())
    # Column alone: this rank's columns of the output.
    xc = x.clone().requires_grad_()
    yc = col(xc)
    n = 12 // world
    close(yc, ref1(x)[..., rank * n:(rank + 1) * n], "column forward", LINEAR)
    # Column then row (the Megatron MLP): full output on every rank; gradients match.
    xr = x.clone().requires_grad_()
    xf = x.clone().requires_grad_()
    y = row(torch.relu(col(xr)))
    yf = ref2(torch.relu(ref1(xf)))
    close(y, yf, "column+row forward", 2 * LINEAR)
    g = torch.randn_like(yf)
    y.backward(g)
    yf.backward(g)
    close(xr.grad, xf.grad, "input gradient", 3 * 2 * LINEAR)
    close(col.weight.grad, ref1.weight.grad[rank * n:(rank + 1) * n], "column weight gradient", 3 * 2 * LINEAR)
    close(col.bias.grad, ref1.bias.grad[rank * n:(rank + 1) * n], "column bias gradient", 3 * 2 * LINEAR)
    close(row.weight.grad, ref2.weight.grad[:, rank * n:(rank + 1) * n], "row weight gradient", 3 * 2 * LINEAR)
    close(row.bias.grad, ref2.bias.grad, "row bias gradient", 3 * 2 * LINEAR)
    # A whole block (attention with GQA + SwiGLU) sharded vs unsharded from the same seed.
    spec = ModelSpec("t", 2, 16, 4, 6, 32, 32, 2, True)
    from motley_torch.models.transformer import GPTStage

    full = GPTStage(spec, 6, (0, 2))
    full.init_from_seed(3)
    part = GPTStage(spec, 6, (0, 2), group=group, tp_rank=rank, tp_size=world)
    part.init_from_seed(3)
    toks = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(1))
    lf, lp = full(toks), part(toks)
    close(lp, lf, "sharded GPT logits", forward_ops(spec.layers) + tp_forward_ops(spec.layers, world))
    lf.square().mean().backward()
    lp.square().mean().backward()
    fullg = dict(full.named_parameters())
    for name, p, tp_mod, attr in part.full_params():
        want = fullg[name].grad
        if tp_mod is not None:
            want = tp_mod.shard(want, attr)
        # The key bias's gradient is zero in exact arithmetic (without rotary embeddings, adding
        # one vector to every key leaves each query's softmax as it was): what remains is the
        # rounding of terms of the key projection's gradient's size, its scale here.
        scale = fullg[name.replace("k.bias", "k.weight")].grad.abs().max().item() if name.endswith("k.bias") else None
        close(p.grad, want, f"gradient of {name}", gradient_ops(spec.layers) + tp_gradient_ops(spec.layers, world),
              scale)
    gathered = part.gather_full(group)
    for name, t in gathered.items():
        close(t, fullg[name].detach(), f"gathered {name}", 0)
    dist.destroy_process_group()
    print(f"rank {rank} ok")


if __name__ == "__main__":
    main()
