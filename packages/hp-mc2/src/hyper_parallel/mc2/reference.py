"""Reference twins of the two duals: same signatures, blocking whole-tensor collectives and
plain autograd matmuls, no chunks, no fused kernels. Slow and obviously correct; tests compare
every backend against them, and users can swap them in to debug."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hyper_parallel.mc2._collectives import all_gather_async, reduce_scatter_async
from hyper_parallel.mc2.backend import validate_operands

__all__ = ["all_gather_matmul_reference", "matmul_reduce_scatter_reference"]


def _gather_rows(t: torch.Tensor, group: Any) -> torch.Tensor:
    ws = dist.get_world_size(group)
    out = t.new_empty(ws * t.shape[0], *t.shape[1:])
    all_gather_async(out, t, group).wait()
    return out


def _scatter_rows(t: torch.Tensor, group: Any) -> torch.Tensor:
    ws = dist.get_world_size(group)
    out = t.new_empty(t.shape[0] // ws, *t.shape[1:])
    reduce_scatter_async(out, t, group).wait()
    return out


class _AllGatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return _gather_rows(t, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return _scatter_rows(g, ctx.group), None


class _ReduceScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return _scatter_rows(t, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return _gather_rows(g, ctx.group), None


class _SumGradOverRanks(torch.autograd.Function):
    """Identity whose gradient is summed over the group: a replicated parameter used on
    row-sharded data gets the gradient of all rows."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


def all_gather_matmul_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    group: Any = None,
    *,
    bias: torch.Tensor | None = None,
    backend: str = "auto",
    chunks: int | None = None,
) -> torch.Tensor:
    """``F.linear(AllGather_m(x), W, b)``; ``backend`` and ``chunks`` are accepted and ignored."""
    validate_operands(
        "all_gather_matmul", x, weight, bias, dist.get_world_size(group), "auto", None
    )
    return F.linear(_AllGatherRows.apply(x, group), weight, bias)


def matmul_reduce_scatter_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    group: Any = None,
    *,
    bias: torch.Tensor | None = None,
    backend: str = "auto",
    chunks: int | None = None,
) -> torch.Tensor:
    """``ReduceScatter_m(x @ Wᵀ) + b``; ``backend`` and ``chunks`` are accepted and ignored."""
    ws = dist.get_world_size(group)
    validate_operands("matmul_reduce_scatter", x, weight, bias, ws, "auto", None)
    y = _ReduceScatterRows.apply(F.linear(x, weight), group)
    return y if bias is None else y + _SumGradOverRanks.apply(bias, group)
