"""The seam between the ``npu`` implementation and the two fused torch_npu MC2 kernels.

The ``npu`` implementation never imports ``torch_npu`` itself: it asks the active *provider*
for ``npu_all_gather_base_mm``, ``npu_mm_reduce_scatter_base`` (torch_npu signatures) and the
communicator name of a process group. The default provider imports ``torch_npu`` lazily, and
only once tensors are already on an NPU (so a CPU machine never touches it). Tests install a
double with :func:`use_npu_ops` to drive the same code path on CPU over gloo.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from collections.abc import Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist

__all__ = ["NpuOps", "TorchNpuOps", "current_npu_ops", "hccl_comm_name", "use_npu_ops"]


class NpuOps(Protocol):
    """What the ``npu`` implementation needs from torch_npu (or from a stand-in)."""

    #: device type of the tensors the kernels accept ("npu" for torch_npu).
    device_type: str

    def available(self) -> str | None:
        """``None`` when the kernels can run, else why not."""
        ...

    def world_sizes(self) -> frozenset[int]:
        """Group sizes the kernels support on this machine."""
        ...

    def comm_name(self, group: Any) -> str:
        """The communicator name (``hcom``) of ``group``."""
        ...

    def npu_all_gather_base_mm(
        self, input: torch.Tensor, x2: torch.Tensor, hcom: str, world_size: int, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def npu_mm_reduce_scatter_base(
        self, input: torch.Tensor, x2: torch.Tensor, hcom: str, world_size: int, **kwargs: Any
    ) -> torch.Tensor: ...


def hccl_comm_name(group: Any, rank: int | None = None, *, torch_version: str | None = None) -> str:
    """HCCL communicator name of ``group`` for this process, on every torch_npu generation.

    torch > 2.0.1 keeps the HCCL backend behind ``group._get_backend(npu)``; torch_npu for
    torch <= 2.0.1 put ``get_hccl_comm_name`` on the group itself. ``rank`` is the global rank
    (this process's by default), as torch_npu's examples pass it; ``group=None`` is the
    default group.
    """
    if group is None:
        group = dist.distributed_c10d._get_default_group()
    if rank is None:
        rank = dist.get_rank()
    version = torch.torch_version.TorchVersion(torch_version or torch.__version__)
    if version > "2.0.1" and hasattr(group, "_get_backend"):
        backend = group._get_backend(torch.device("npu"))
        return str(backend.get_hccl_comm_name(rank))
    if hasattr(group, "get_hccl_comm_name"):
        return str(group.get_hccl_comm_name(rank))
    raise TypeError(
        f"cannot get an HCCL communicator name from {type(group).__name__}: it has neither "
        "_get_backend(npu).get_hccl_comm_name nor get_hccl_comm_name (is it an HCCL group?)"
    )


class TorchNpuOps:
    """The real kernels: ``torch_npu`` imported on first use."""

    device_type = "npu"

    def __init__(self) -> None:
        self._module: Any = None

    def _torch_npu(self) -> Any:
        if self._module is None:
            self._module = importlib.import_module("torch_npu")
        return self._module

    def available(self) -> str | None:
        if importlib.util.find_spec("torch_npu") is None:
            return "torch_npu is not installed"
        try:
            self._torch_npu()
        except Exception as exc:
            return f"torch_npu is not importable ({type(exc).__name__}: {exc})"
        return None

    def world_sizes(self) -> frozenset[int]:
        sizes = {2, 4, 8}
        with contextlib.suppress(Exception):
            # Atlas A3 (SoC names Ascend910_93xx) also runs 16 and 32 ranks.
            if "910_93" in str(self._torch_npu().npu.get_device_name()):
                sizes |= {16, 32}
        return frozenset(sizes)

    def comm_name(self, group: Any) -> str:
        return hccl_comm_name(group)

    def npu_all_gather_base_mm(
        self, input: torch.Tensor, x2: torch.Tensor, hcom: str, world_size: int, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = self._torch_npu().npu_all_gather_base_mm(input, x2, hcom, world_size, **kwargs)
        return out[0], out[1]

    def npu_mm_reduce_scatter_base(
        self, input: torch.Tensor, x2: torch.Tensor, hcom: str, world_size: int, **kwargs: Any
    ) -> torch.Tensor:
        return self._torch_npu().npu_mm_reduce_scatter_base(input, x2, hcom, world_size, **kwargs)


_default: NpuOps = TorchNpuOps()
_active: NpuOps = _default


def current_npu_ops() -> NpuOps:
    """The provider the ``npu`` implementation uses right now."""
    return _active


@contextlib.contextmanager
def use_npu_ops(provider: NpuOps) -> Iterator[NpuOps]:
    """Route the ``npu`` implementation to ``provider`` inside the ``with`` block (not
    thread-local)."""
    global _active
    previous, _active = _active, provider
    try:
        yield provider
    finally:
        _active = previous
