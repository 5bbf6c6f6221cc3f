"""Device presets for the planner's modeled step time, and the link figures.

Peak dense bf16 rates and memory, from the vendors' public figures:

- ``910B``: Ascend 910B, 64 GB HBM; 313 TFLOPS fp16 (Huawei's Atlas 800T A2 training server:
  8 NPUs, 2.5 PFLOPS fp16 in all).
- ``910C``: Ascend 910C, two 910B-class dies in one package: 128 GB HBM, 752 TFLOPS bf16
  (Huawei Cloud, "Serving Large Language Models on Huawei CloudMatrix384", arXiv:2506.12708,
  section 3).
- ``H100``: NVIDIA H100 SXM5, 80 GB HBM3; 989 TFLOPS bf16 dense (NVIDIA's H100 Tensor Core GPU
  datasheet; 1,979 with 2:4 sparsity).

Links: the figures the layers' ``auto`` cost models already use
(:data:`hyper_parallel.kda.cost.DEFAULT_COST_PARAMS`: ``npu`` 50 GB/s, 20 µs; ``cuda``
100 GB/s, 15 µs; ``cpu``: gloo over localhost), by device type; ``--link`` overrides them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEVICES", "Device", "link_bandwidth"]


@dataclass(frozen=True)
class Device:
    """A device preset: ``memory`` bytes, ``flops`` peak bf16 FLOP/s, ``device_type`` for the
    layers' cost models and the link figures (``npu``/``cuda``/``cpu``)."""

    name: str
    memory: int
    flops: float
    device_type: str


DEVICES: dict[str, Device] = {
    "910B": Device("910B", 64 * 10**9, 313e12, "npu"),
    "910C": Device("910C", 128 * 10**9, 752e12, "npu"),
    "H100": Device("H100", 80 * 10**9, 989e12, "cuda"),
}


def link_bandwidth(device_type: str) -> tuple[float, float]:
    """``(bytes/s, latency s)`` of one rank's link for ``device_type``, as the layers' cost
    models take it."""
    from hyper_parallel.kda.cost import DEFAULT_COST_PARAMS

    p = DEFAULT_COST_PARAMS[device_type]
    return p.bandwidth_Bps, p.latency_s
