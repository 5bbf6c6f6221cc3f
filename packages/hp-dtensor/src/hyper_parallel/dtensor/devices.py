"""Which process-group backend a device type uses, and binding a rank to its device.

The one place that knows ``cpu -> gloo``, ``cuda -> nccl``, ``npu -> hccl``, that the npu
device needs ``torch_npu`` imported first (it registers the device and HCCL; it is imported
only on that branch), and how a rank binds to its local card. Benchmarks, the main job and the
integration tests call these instead of restating them.
"""

from __future__ import annotations

import torch

__all__ = ["BACKENDS", "bind_device", "process_group_backend"]

BACKENDS: dict[str, str] = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


def process_group_backend(device_type: str) -> str:
    """The ``torch.distributed`` backend of ``device_type`` (``ValueError`` naming the
    supported device types otherwise)."""
    if device_type not in BACKENDS:
        raise ValueError(f"device must be one of {sorted(BACKENDS)}, got {device_type!r}")
    return BACKENDS[device_type]


def bind_device(device_type: str, index: int) -> torch.device:
    """Make card ``index`` this process's current ``device_type`` device (importing
    ``torch_npu`` first for ``"npu"``) and return it; ``cpu`` binds nothing."""
    process_group_backend(device_type)  # validates
    if device_type == "cpu":
        return torch.device("cpu")
    if device_type == "npu":
        import torch_npu  # noqa: F401  (registers the npu device and HCCL; NPU images only)
    getattr(torch, device_type).set_device(index)
    return torch.device(device_type, index)
