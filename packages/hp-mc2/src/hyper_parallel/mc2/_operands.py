"""The local checks of a dual's operands (``x``, ``weight``, ``bias``), the op names and the
dtype names of the messages. Purely local and the same on every rank when every rank passes
same-shaped operands, so they run before any communication."""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch.distributed.tensor import DTensor

__all__ = ["OPS", "Op", "check_chunks", "dtype_name", "validate_operands"]

OPS = ("all_gather_matmul", "matmul_reduce_scatter")
Op = Literal["all_gather_matmul", "matmul_reduce_scatter"]

_DTYPE_NAMES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float64: "fp64",
}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def check_chunks(chunks: Any, where: str = "") -> None:
    """``chunks`` is ``None`` or a positive int (``where``, if given, prefixes the message)."""
    if chunks is not None and (
        not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1
    ):
        prefix = f"{where}: " if where else ""
        raise ValueError(f"{prefix}chunks must be a positive int or None, got {chunks!r}")


def validate_operands(
    op: Op, x: Any, weight: Any, bias: Any, world_size: int, chunks: int | None
) -> None:
    """Raise a clear error for operands no implementation can run (the ``impl`` name is
    checked by the caller, first: :func:`hyper_parallel.mc2.impls.check_impl_choice`)."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    check_chunks(chunks)
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if isinstance(t, DTensor):
            raise TypeError(
                f"{op}: {name} is a DTensor; the functional forms take this rank's local "
                f"tensors (pass {name}.to_local())"
            )
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{op}: {name} must be 2-D, got shape {tuple(t.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{op}: x must be a floating tensor, got {x.dtype}")
    if weight.dtype != x.dtype:
        raise TypeError(
            f"{op}: x is {dtype_name(x.dtype)} but weight is {dtype_name(weight.dtype)}; "
            "x, weight and bias must share one dtype"
        )
    if x.device != weight.device:
        raise ValueError(f"{op}: x is on {x.device} but weight is on {weight.device}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"{op}: inner dims differ: x is {tuple(x.shape)} ([m, k]) but weight is "
            f"{tuple(weight.shape)} ([n, k] in nn.Linear layout)"
        )
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"{op}: bias must be a torch.Tensor or None, got {type(bias).__name__}")
        which = "local shard [n_local]" if op == "all_gather_matmul" else "full, replicated [n]"
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(
                f"{op}: bias must be the {which} = ({weight.shape[0]},), got {tuple(bias.shape)}"
            )
        if bias.dtype != x.dtype:
            raise TypeError(
                f"{op}: x is {dtype_name(x.dtype)} but bias is {dtype_name(bias.dtype)}; "
                "x, weight and bias must share one dtype"
            )
        if bias.device != weight.device:
            raise ValueError(f"{op}: bias is on {bias.device} but weight is on {weight.device}")
    if op == "matmul_reduce_scatter" and x.shape[0] % world_size != 0:
        raise ValueError(
            f"{op}: m={x.shape[0]} rows are not divisible by the group size {world_size} "
            "(the reduce-scatter splits m evenly)"
        )
