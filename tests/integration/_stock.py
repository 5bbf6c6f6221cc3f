"""Shared helpers of the stock-model integration tests: the device of each rank, the (cp, tp)
mesh, and a distributed training run of a stock Hugging Face model parallelised by hp-models,
compared with the same model run serially.

Device: ``HP_TEST_DEVICE`` = ``cpu`` (default: gloo, float64), ``cuda`` (NCCL) or ``npu``
(HCCL, torch_npu from the image); on an accelerator rank r uses device ``r % device_count``
and the parallel model runs in float32 (HCCL has no float64 collectives).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hyper_parallel.dtensor import init_device_mesh, unflatten
from hyper_parallel.dtensor.devices import BACKENDS, bind_device, process_group_backend

TIMEOUT = 240.0  # one distributed run of up to 4 ranks on 2 shared cores


def device_type() -> str:
    dev = os.environ.get("HP_TEST_DEVICE", "cpu").strip().lower() or "cpu"
    if dev not in BACKENDS:
        raise ValueError(f"HP_TEST_DEVICE must be one of {sorted(BACKENDS)}, got {dev!r}")
    return dev


def backend() -> str:
    return process_group_backend(device_type())


def dtype() -> torch.dtype:
    return torch.float64 if device_type() == "cpu" else torch.float32


def tolerances(kind: str) -> dict[str, float]:
    """Against the serial model in the same dtype. Hugging Face's loss upcasts logits to
    float32 (``ForCausalLMLoss``), and its torch KDA path computes in float32, so float64
    models agree to float32 rounding, not float64's."""
    if device_type() != "cpu":
        return {"rtol": 2e-3, "atol": 2e-4}
    return {"rtol": 2e-5, "atol": 2e-6} if kind == "kimi" else {"rtol": 1e-5, "atol": 1e-7}


def rank_device() -> torch.device:
    """This rank's device (sets the current accelerator device)."""
    dev = device_type()
    if dev == "cpu":
        return torch.device("cpu")
    if dev == "npu":
        import torch_npu  # noqa: F401  (device_count below needs the npu device registered)
    device = bind_device(dev, dist.get_rank() % getattr(torch, dev).device_count())
    if dev == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    return device


def build_mesh(cp: int, tp: int) -> Any:
    """(cp, tp) from one flat mesh over all ranks, with ``hyper_parallel.dtensor.unflatten``."""
    world = init_device_mesh(device_type(), (cp * tp,), mesh_dim_names=("world",))
    return unflatten(world, "world", (cp, tp), ("cp", "tp"))


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            out[name] = g.detach().double().cpu()
    return out


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().double().cpu()
        for name, p in model.named_parameters()
    }
