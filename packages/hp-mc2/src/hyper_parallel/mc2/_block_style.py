"""What the two MLP-block styles (:class:`~hyper_parallel.mc2.MC2GatedMLPParallel`,
:class:`~hyper_parallel.mc2.MC2MLPParallel`) share: their option and mesh checks, the checks of
the module's linears, distributing them, and running the block on the input's rows."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, distribute_tensor

from hyper_parallel.dtensor import check_rank_order
from hyper_parallel.mc2._operands import check_chunks, dtype_name
from hyper_parallel.mc2.impls import check_impl_choice
from hyper_parallel.mc2.linear import check_sequence_dim

__all__ = [
    "check_input",
    "check_linears",
    "check_style_options",
    "check_tp_mesh",
    "distribute_linears",
    "on_rows",
    "rows_of",
]


def check_style_options(where: str, sequence_dim: Any, impl: Any, chunks: Any) -> None:
    """A block style's ``sequence_dim``, ``impl`` and ``chunks`` (its constructor's checks)."""
    check_sequence_dim(sequence_dim)
    check_impl_choice(impl, where)
    check_chunks(chunks, where)


def check_tp_mesh(where: str, device_mesh: Any) -> None:
    """A 1-D tensor-parallel mesh in rank order, else ``ValueError`` (before any collective)."""
    if not isinstance(device_mesh, DeviceMesh) or device_mesh.ndim != 1:
        what = (
            f"a {device_mesh.ndim}-D mesh"
            if isinstance(device_mesh, DeviceMesh)
            else type(device_mesh).__name__
        )
        raise ValueError(f"{where} needs a 1-D tensor-parallel mesh (e.g. mesh['tp']), got {what}")
    check_rank_order(device_mesh)


def check_linears(where: str, kind: str, linears: list[tuple[str, nn.Linear]]) -> None:
    """Every weight and bias of ``linears`` (``(child name, linear)``, the first the reference)
    a plain tensor on the first weight's device, in its dtype."""
    ref_name, ref = linears[0][0], linears[0][1].weight
    for lname, lin in linears:
        for pname in ("weight", "bias"):
            p = getattr(lin, pname)
            if p is None:
                continue
            if isinstance(p, DTensor):
                raise ValueError(f"{where}: {kind}.{lname}.{pname} is already a DTensor")
            if p.device != lin.weight.device or p.device != ref.device:
                raise ValueError(
                    f"{where}: {kind}.{lname}.{pname} is on {p.device} but "
                    f"{ref_name}.weight is on {ref.device}; move the module to one device"
                )
            if p.dtype != ref.dtype:
                raise TypeError(
                    f"{where}: {kind}.{lname}.{pname} is {dtype_name(p.dtype)} but "
                    f"{ref_name}.weight is {dtype_name(ref.dtype)}"
                )


def distribute_linears(
    layout: Iterable[tuple[nn.Linear, str, Placement]], device_mesh: DeviceMesh, src: int
) -> None:
    """Each ``(linear, "weight"|"bias", placement)`` of ``layout`` made a DTensor
    ``Parameter`` (absent biases skipped), ``src`` the rank whose full tensors are sharded."""
    kwargs: dict[str, Any] = {} if src == 0 else {"src_data_rank": src}
    for lin, pname, placement in layout:
        p = getattr(lin, pname)
        if p is None:
            continue
        dp = distribute_tensor(p.detach(), device_mesh, [placement], **kwargs)
        lin.register_parameter(pname, nn.Parameter(dp, requires_grad=p.requires_grad))


def rows_of(x: Any, sequence_dim: int) -> Any:
    """``x`` ``[..., S_local, ..., D]`` as rows ``[N, D]``, sequence first (for the consistency
    fields; ``x`` itself where the body will reject it)."""
    try:
        rows = x.movedim(sequence_dim, 0)
        return rows.reshape(-1, rows.shape[-1])
    except Exception:  # rejected by the body, after the comparison
        return x


def on_rows(x: torch.Tensor, seq: int, run: Any) -> torch.Tensor:
    """``run`` on ``x``'s rows, sequence first so each rank's tokens are one contiguous block
    of rows, and its ``[N, D]`` result back in ``x``'s layout."""
    xs = x.movedim(seq, 0)
    lead = xs.shape[:-1]
    y2 = run(xs.reshape(-1, xs.shape[-1]))
    return y2.view(*lead, y2.shape[-1]).movedim(0, seq)


def check_input(x: Any, weight: torch.Tensor, sequence_dim: int, where: str) -> int:
    """Local checks, identical on every rank for same-shaped inputs; the normalised seq dim."""
    if isinstance(x, DTensor):
        raise TypeError(
            f"{where}: the input must be this rank's sequence block as a local tensor "
            f"[B, S/tp, D], got a DTensor with placements {x.placements}; pass x.to_local() "
            "(or the local block you would shard it into)"
        )
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{where}: the input must be a torch.Tensor, got {type(x).__name__}")
    d = x.dim()
    if d < 2 or not -d <= sequence_dim < d or sequence_dim % d == d - 1:
        raise ValueError(
            f"{where}: sequence_dim={sequence_dim} is out of range for a {d}-D input "
            f"{tuple(x.shape)} (the last dim holds the features)"
        )
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"{where}: input has {x.shape[-1]} features but the module's hidden size is "
            f"{weight.shape[1]}"
        )
    if x.dtype != weight.dtype:
        raise TypeError(
            f"{where}: input is {dtype_name(x.dtype)} but the weights are "
            f"{dtype_name(weight.dtype)}; cast the module or the input"
        )
    if x.device != weight.device:
        raise ValueError(f"{where}: input is on {x.device} but the weights are on {weight.device}")
    return sequence_dim % d
