"""Blocking twins of the two duals and of the gated and plain MLP blocks: the same
signatures and the same distributed results, with blocking whole-tensor collectives and plain
autograd matmuls (no chunks, no fused kernels). Slow and obviously correct; tests compare every
implementation against them, and users can swap them in to debug. (Formerly
``hyper_parallel.mc2.reference``, still importable as a deprecated alias.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hyper_parallel.dtensor import comm
from hyper_parallel.mc2._block import validate_block_operands
from hyper_parallel.mc2._collectives import OWNER, _group, all_gather_async, reduce_scatter_async
from hyper_parallel.mc2._keywords import impl_keyword
from hyper_parallel.mc2._operands import validate_operands

__all__ = [
    "all_gather_matmul_reference",
    "gated_mlp_reference",
    "matmul_reduce_scatter_reference",
    "mlp_block_reference",
]


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
        comm.start_all_reduce(g, _group(ctx.group), "all_reduce:grad", "backward", OWNER).wait()
        return g, None


@impl_keyword("all_gather_matmul_reference")
def all_gather_matmul_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    group: Any = None,
    *,
    bias: torch.Tensor | None = None,
    impl: str = "auto",
    chunks: int | None = None,
) -> torch.Tensor:
    """``F.linear(AllGather_m(x), W, b)``; ``impl`` and ``chunks`` are accepted and ignored."""
    validate_operands("all_gather_matmul", x, weight, bias, dist.get_world_size(group), None)
    return F.linear(_AllGatherRows.apply(x, group), weight, bias)


@impl_keyword("matmul_reduce_scatter_reference")
def matmul_reduce_scatter_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    group: Any = None,
    *,
    bias: torch.Tensor | None = None,
    impl: str = "auto",
    chunks: int | None = None,
) -> torch.Tensor:
    """``ReduceScatter_m(x @ Wᵀ) + b``; ``impl`` and ``chunks`` are accepted and ignored."""
    ws = dist.get_world_size(group)
    validate_operands("matmul_reduce_scatter", x, weight, bias, ws, None)
    y = _ReduceScatterRows.apply(F.linear(x, weight), group)
    return y if bias is None else y + _SumGradOverRanks.apply(bias, group)


@impl_keyword("gated_mlp_reference")
def gated_mlp_reference(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    group: Any = None,
    *,
    act_fn: Callable[[torch.Tensor], torch.Tensor],
    gate_bias: torch.Tensor | None = None,
    up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    impl: str = "auto",
    chunks: int | None = None,
) -> torch.Tensor:
    """``ReduceScatter_m((act(X W_gᵀ + b_g) ⊙ (X W_uᵀ + b_u)) W_dᵀ) + b_d``, ``X =
    AllGather_m(x)``, in plain autograd (it saves ``X`` and every intermediate);
    ``impl`` and ``chunks`` are accepted and ignored."""
    ws = dist.get_world_size(group)
    validate_block_operands(
        "gated_mlp", x, (gate_weight, up_weight), (gate_bias, up_bias), down_weight, down_bias,
        act_fn, ws, "auto", None,
    )  # fmt: skip
    big_x = _AllGatherRows.apply(x, group)
    h = act_fn(F.linear(big_x, gate_weight, gate_bias)) * F.linear(big_x, up_weight, up_bias)
    return matmul_reduce_scatter_reference(h, down_weight, group, bias=down_bias)


@impl_keyword("mlp_block_reference")
def mlp_block_reference(
    x: torch.Tensor,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    group: Any = None,
    *,
    act_fn: Callable[[torch.Tensor], torch.Tensor],
    up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    impl: str = "auto",
    chunks: int | None = None,
) -> torch.Tensor:
    """``ReduceScatter_m(act(X W_uᵀ + b_u) W_dᵀ) + b_d``, ``X = AllGather_m(x)``, in plain
    autograd (it saves ``X`` and every intermediate); ``impl`` and ``chunks`` are accepted and
    ignored."""
    ws = dist.get_world_size(group)
    validate_block_operands(
        "mlp_block", x, (up_weight,), (up_bias,), down_weight, down_bias, act_fn, ws, "auto", None
    )
    h = act_fn(all_gather_matmul_reference(x, up_weight, group, bias=up_bias))
    return matmul_reduce_scatter_reference(h, down_weight, group, bias=down_bias)
