"""What the ``npu`` implementation needs from torch_npu: the two fused MC2 kernels, asked of
hp-dtensor's one torch_npu seam (:mod:`hyper_parallel.dtensor.npu`).

The ``npu`` implementation never imports ``torch_npu`` itself: it asks the process's provider
(:func:`current_npu_ops`, the same one for every layer) for ``npu_all_gather_base_mm`` and
``npu_mm_reduce_scatter_base`` (torch_npu signatures, availability asked by name:
:data:`MC2_OPS`) and for the communicator name of a process group. The default provider imports
``torch_npu`` lazily, and only once tensors are already on an NPU (so a CPU machine never
touches it). Tests install a double with :func:`use_npu_ops` to drive the same code path on
CPU over gloo. ``current_npu_ops``, ``use_npu_ops`` and ``hccl_comm_name`` are hp-dtensor's
own, re-exported here.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import torch

from hyper_parallel.dtensor.npu import (
    NpuProvider,
    TorchNpu,
    current_npu_ops,
    hccl_comm_name,
    use_npu_ops,
)

__all__ = [
    "MC2_OPS",
    "NpuOps",
    "TorchNpuOps",
    "current_npu_ops",
    "hccl_comm_name",
    "use_npu_ops",
    "world_sizes",
]

#: the torch_npu ops the ``npu`` implementation calls
MC2_OPS = ("npu_all_gather_base_mm", "npu_mm_reduce_scatter_base")
_SIZES = frozenset({2, 4, 8})  # group sizes the kernels take on every Atlas machine
_A3_SIZES = frozenset({2, 4, 8, 16, 32})  # and on Atlas A3 (SoC names Ascend910_93xx)


class NpuOps(NpuProvider, Protocol):
    """What the ``npu`` implementation needs from torch_npu (or from a stand-in): a provider
    (:class:`hyper_parallel.dtensor.npu.NpuProvider`) with the two MC2 kernels. A provider may
    also say which group sizes the kernels take (``world_sizes()``); else
    :func:`world_sizes` tells them from the SoC."""

    def npu_all_gather_base_mm(
        self, input: torch.Tensor, x2: torch.Tensor, hcom: str, world_size: int, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def npu_mm_reduce_scatter_base(
        self, input: torch.Tensor, x2: torch.Tensor, hcom: str, world_size: int, **kwargs: Any
    ) -> torch.Tensor: ...


def _sizes_of_soc(soc: str | None) -> frozenset[int]:
    return _A3_SIZES if soc is not None and "910_93" in soc else _SIZES


def world_sizes(provider: Any) -> frozenset[int]:
    """Group sizes the MC2 kernels take under ``provider``: its own ``world_sizes()`` where it
    has one (a test double), else {2, 4, 8}, and 16 and 32 too on Atlas A3 (its
    ``soc_name()``)."""
    own = getattr(provider, "world_sizes", None)
    if callable(own):
        return frozenset(own())
    soc = None
    soc_name = getattr(provider, "soc_name", None)
    if callable(soc_name):
        with contextlib.suppress(Exception):
            soc = soc_name()
    return _sizes_of_soc(soc)


class TorchNpuOps(TorchNpu):
    """The real kernels: hp-dtensor's :class:`~hyper_parallel.dtensor.npu.TorchNpu` (torch_npu
    imported on first use), with the group sizes the kernels take on this machine."""

    def world_sizes(self) -> frozenset[int]:
        return _sizes_of_soc(self.soc_name())
