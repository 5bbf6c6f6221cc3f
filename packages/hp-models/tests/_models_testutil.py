"""Helpers shared by the hp-models tests: the (cp, tp) mesh from one world mesh, whole tensors
from DTensors, and every parameter's whole gradient."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from hyper_parallel.dtensor import init_device_mesh, unflatten


def cp_tp_mesh(cp: int, tp: int) -> Any:
    """The (cp, tp) mesh over ``cp·tp`` ranks, made with ``unflatten`` of one world mesh."""
    world = init_device_mesh("cpu", (cp * tp,), mesh_dim_names=("world",))
    return unflatten(world, "world", (cp, tp), ("cp", "tp"))


def full(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of the whole tensor (``full_tensor()`` of a DTensor). A copy: after a
    no_grad forward FSDP2 may leave parameters unsharded and free that storage later."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def full64(t: torch.Tensor) -> torch.Tensor:
    """:func:`full` in float64."""
    return full(t).double()


def grads(model: torch.nn.Module, strip: str = "") -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient by name (``strip`` removed from the names), for the
    parameters that have one."""
    return {
        name.replace(strip, "") if strip else name: full(p.grad)
        for name, p in model.named_parameters()
        if p.grad is not None
    }
