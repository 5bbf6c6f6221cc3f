"""The base of the test doubles that stand in for ``torch_npu`` on CPU.

A layer's NPU backend is tested on CPU by installing a double of the torch_npu ops it calls as
the process's provider (:func:`hyper_parallel.dtensor.npu.use_npu_ops`). A double subclasses
:class:`NpuDouble` and implements those ops as methods, under torch_npu's names and with its
signatures. It is the one sanctioned stand-in in the tests: the collectives stay real, so a
double's comm-fused op (``npu_all_gather_base_mm`` and the like) looks the communicator name it
is given up with :meth:`NpuDouble.group_of` and runs real gloo communication on that group.

Example::

    import torch
    from hyper_parallel.dtensor.npu import current_npu_ops, use_npu_ops
    from hyper_parallel.dtensor.npu_double import NpuDouble

    class AddDouble(NpuDouble):
        def npu_add(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a + b

    with use_npu_ops(AddDouble()):
        provider = current_npu_ops()  # the double: every layer's NPU backend calls it now
        assert provider.available(ops=("npu_add",)) is None
        assert provider.available(ops=("npu_add", "npu_mul")) == "AddDouble has no npu_mul"
        assert provider.npu_add(torch.ones(2), torch.ones(2)).tolist() == [2.0, 2.0]
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch.distributed as dist

__all__ = ["NpuDouble"]


class NpuDouble:
    """A provider (:class:`hyper_parallel.dtensor.npu.NpuProvider`) of the ops its subclass
    defines, on CPU tensors: ``device_type`` ``"cpu"``; :meth:`available` names the ops it does
    not define; :meth:`comm_name` registers a process group under a name that
    :meth:`group_of` maps back. Needs no ``__init__`` of its own, so subclasses may be
    dataclasses."""

    device_type: str = "cpu"

    def available(self, ops: Iterable[str] = ()) -> str | None:
        """``None`` when the double defines every op named in ``ops``, else which it lacks."""
        missing = [name for name in ops if not callable(getattr(type(self), name, None))]
        if missing:
            return f"{type(self).__name__} has no {', '.join(missing)}"
        return None

    def _hcom_groups(self) -> dict[str, Any]:
        groups: dict[str, Any] = self.__dict__.setdefault("_hcom_groups_", {})
        return groups

    def comm_name(self, group: Any) -> str:
        """A communicator name for ``group`` (``None``: the default group), the same for the
        same group object; :meth:`group_of` gives the group back."""
        group = dist.group.WORLD if group is None else group
        groups = self._hcom_groups()
        for name, known in groups.items():
            if known is group:
                return name
        name = f"hcom-double-{len(groups)}-{dist.get_process_group_ranks(group)}"
        groups[name] = group
        return name

    def group_of(self, hcom: str) -> Any:
        """The ``torch.distributed`` group that :meth:`comm_name` named ``hcom`` (``KeyError``
        for a name it never gave)."""
        try:
            return self._hcom_groups()[hcom]
        except KeyError:
            raise KeyError(
                f"unknown hcom {hcom!r}: not a name this double's comm_name gave"
            ) from None

    def __getattr__(self, name: str) -> Any:
        # an op the double does not define: say so (as hasattr expects, an AttributeError)
        if name.startswith("npu_"):
            raise AttributeError(f"{type(self).__name__} has no {name}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
