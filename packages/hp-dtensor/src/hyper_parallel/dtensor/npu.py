"""The one seam between the layers and ``torch_npu``: the active *provider* of its ops.

A layer never imports ``torch_npu`` itself. It asks :func:`current_npu_ops` for the provider
and calls the ops on it by torch_npu's own names (``provider.npu_grouped_matmul(...)``,
``provider.npu_all_gather_base_mm(...)``), after asking ``provider.available(ops=(...names))``
whether they can run here. There is one provider for the whole process (not one per layer, not
thread-local), so a test double installed once with :func:`use_npu_ops` is what every layer's
NPU backend calls.

- :class:`TorchNpu`, the default provider, imports ``torch_npu`` on first use only: never when
  this module is imported, and never when asked :meth:`~TorchNpu.available` on a machine
  without it (``importlib.util.find_spec`` first: importing a ``torch_npu`` built without CANN
  breaks ``torch``).
- :func:`hccl_comm_name` is the HCCL communicator name (``hcom``) of a process group on every
  torch_npu generation; it is what the fused communication ops take.
- :class:`hyper_parallel.dtensor.npu_double.NpuDouble` is the base of the test doubles that
  stand in for ``torch_npu`` on CPU (their comm-fused ops run real gloo communication).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist

__all__ = ["NpuProvider", "TorchNpu", "current_npu_ops", "hccl_comm_name", "use_npu_ops"]


class NpuProvider(Protocol):
    """What a layer needs from ``torch_npu`` (or from a stand-in for it).

    Besides the members below, a provider has torch_npu's ops as attributes, under
    torch_npu's names and with its signatures (``provider.npu_moe_token_permute(...)``).
    """

    #: device type of the tensors the ops take (``"npu"`` for torch_npu)
    device_type: str

    def available(self, ops: Iterable[str] = ()) -> str | None:
        """``None`` when the provider can run and has every op named in ``ops``, else why not
        (e.g. ``"torch_npu is not installed"``, ``"torch_npu 2.6.0 has no npu_alltoallv_gmm"``)."""
        ...

    def comm_name(self, group: Any) -> str:
        """The communicator name (``hcom``) of process group ``group`` (``None``: the default
        group), as the comm-fused ops take it."""
        ...

    def __getattr__(self, name: str) -> Any: ...


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


class TorchNpu:
    """The real provider: ``torch_npu``, imported on first use of an op (or of
    :meth:`available` / :meth:`soc_name` on a machine where it is installed); its ``npu_*``
    ops are forwarded unchanged."""

    device_type = "npu"

    def __init__(self) -> None:
        self._module: Any = None
        self._why_not: str | None = None  # why torch_npu cannot be imported, once known

    def _torch_npu(self) -> Any:
        """The ``torch_npu`` module (``None`` when it cannot be imported: see ``_why_not``)."""
        if self._module is None and self._why_not is None:
            if importlib.util.find_spec("torch_npu") is None:
                self._why_not = "torch_npu is not installed"
            else:
                try:
                    self._module = importlib.import_module("torch_npu")
                except Exception as exc:
                    self._why_not = f"torch_npu is not importable ({type(exc).__name__}: {exc})"
        return self._module

    def available(self, ops: Iterable[str] = ()) -> str | None:
        module = self._torch_npu()
        if module is None:
            return self._why_not
        missing = [name for name in ops if not hasattr(module, name)]
        if missing:
            version = getattr(module, "__version__", "?")
            return f"torch_npu {version} has no {', '.join(missing)}"
        return None

    def comm_name(self, group: Any) -> str:
        return hccl_comm_name(group)

    def soc_name(self) -> str | None:
        """The NPU's SoC name (``torch_npu.npu.get_device_name()``, e.g. ``"Ascend910B3"``;
        Atlas A3 is ``"Ascend910_93xx"``), or ``None`` where torch_npu or a device is missing."""
        if self.available() is not None:
            return None
        try:
            return str(self._module.npu.get_device_name())
        except Exception:
            return None

    def __getattr__(self, name: str) -> Any:
        # only the ops: everything else (dunders included) is an ordinary missing attribute
        if not name.startswith("npu_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        why = self.available(ops=(name,))
        if why is not None:
            raise AttributeError(f"{name}: {why}")
        return getattr(self._module, name)


_active: NpuProvider = TorchNpu()


def current_npu_ops() -> NpuProvider:
    """The provider every layer's NPU backend uses right now (a :class:`TorchNpu` unless
    :func:`use_npu_ops` installed another)."""
    return _active


@contextlib.contextmanager
def use_npu_ops(provider: NpuProvider) -> Iterator[NpuProvider]:
    """Make ``provider`` the process's provider inside the ``with`` block (for every layer and
    every thread), then restore the previous one; blocks nest."""
    global _active
    previous, _active = _active, provider
    try:
        yield provider
    finally:
        _active = previous
