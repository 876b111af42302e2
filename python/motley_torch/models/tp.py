"""Megatron-style tensor-parallel linear layers over a TP process group.

ColumnParallelLinear splits the output features: its input goes through `copy_to_tp`
(identity forward, all-reduce of the gradient backward). RowParallelLinear splits the input
features: its partial outputs go through `reduce_from_tp` (all-reduce forward, identity
backward) and the bias is added once, after the reduction. With no group (or size 1) both
are plain linear layers.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, op=dist.ReduceOp.SUM, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


def _active(group, size: int) -> bool:
    return group is not None and size > 1


def copy_to_tp(x: torch.Tensor, group, size: int) -> torch.Tensor:
    return _CopyToTP.apply(x, group) if _active(group, size) else x


def reduce_from_tp(x: torch.Tensor, group, size: int) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group) if _active(group, size) else x


class ColumnParallelLinear(nn.Module):
    """y[:, shard] = x W[shard]^T + b[shard]; weight is [out/tp, in]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None,
                 tp_rank: int = 0, tp_size: int = 1, dtype=None, device=None):
        super().__init__()
        if out_features % tp_size:
            raise ValueError(f"ColumnParallelLinear: tp {tp_size} does not divide out_features {out_features}")
        self.in_features, self.out_features = in_features, out_features
        self.group, self.tp_rank, self.tp_size = group, tp_rank, tp_size
        n = out_features // tp_size
        self.weight = nn.Parameter(torch.empty(n, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(n, dtype=dtype, device=device)) if bias else None
        nn.init.normal_(self.weight, std=0.02)

    def shard(self, full: torch.Tensor, kind: str) -> torch.Tensor:
        """This rank's part of the full (unsharded) `weight` or `bias`."""
        n = self.out_features // self.tp_size
        return full[self.tp_rank * n : (self.tp_rank + 1) * n]

    def load_full(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None):
        with torch.no_grad():
            self.weight.copy_(self.shard(weight, "weight"))
            if self.bias is not None and bias is not None:
                self.bias.copy_(self.shard(bias, "bias"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.group, self.tp_size), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum over TP ranks of x[..., shard] W[:, shard]^T, plus b; weight is [out, in/tp]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None,
                 tp_rank: int = 0, tp_size: int = 1, dtype=None, device=None):
        super().__init__()
        if in_features % tp_size:
            raise ValueError(f"RowParallelLinear: tp {tp_size} does not divide in_features {in_features}")
        self.in_features, self.out_features = in_features, out_features
        self.group, self.tp_rank, self.tp_size = group, tp_rank, tp_size
        n = in_features // tp_size
        self.weight = nn.Parameter(torch.empty(out_features, n, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        nn.init.normal_(self.weight, std=0.02)

    def shard(self, full: torch.Tensor, kind: str) -> torch.Tensor:
        if kind == "bias":
            return full
        n = self.in_features // self.tp_size
        return full[:, self.tp_rank * n : (self.tp_rank + 1) * n]

    def load_full(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None):
        with torch.no_grad():
            self.weight.copy_(self.shard(weight, "weight"))
            if self.bias is not None and bias is not None:
                self.bias.copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(F.linear(x, self.weight), self.group, self.tp_size)
        return y + self.bias if self.bias is not None else y
