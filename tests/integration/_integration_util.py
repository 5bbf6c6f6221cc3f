"""Shared helpers of the integration tests: device selection, the 2-D mesh, the distributed
run of a hybrid model and its comparison with the serial model.

Device: ``HP_TEST_DEVICE`` = ``cpu`` (default, gloo), ``cuda`` (NCCL) or ``npu`` (HCCL, needs
torch_npu from the image). On an accelerator rank r uses device ``r % device_count`` and the
model runs in float32 (HCCL has no float64 collectives); on CPU everything is float64.
"""

from __future__ import annotations

import os
from typing import Any

import _hybrid_model as hm
import torch
import torch.distributed as dist

from hyper_parallel.dtensor import init_device_mesh, unflatten
from hyper_parallel.dtensor.testing import run_distributed

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
TIMEOUT = 120.0  # seconds for one distributed run (4 ranks on 2 shared cores take ~5 s)


def device_type() -> str:
    dev = os.environ.get("HP_TEST_DEVICE", "cpu").strip().lower() or "cpu"
    if dev not in BACKENDS:
        raise ValueError(f"HP_TEST_DEVICE must be one of {sorted(BACKENDS)}, got {dev!r}")
    return dev


def backend() -> str:
    return BACKENDS[device_type()]


def dtype() -> torch.dtype:
    return torch.float64 if device_type() == "cpu" else torch.float32


def tolerances(has_kda: bool) -> dict[str, float]:
    """``assert_close`` tolerances against the float64 serial model. kda_context_parallel keeps
    its states and summaries in float32 (documented), so layers with KDA get float32-level
    tolerances even on CPU; everything else is compared at float64 precision."""
    if device_type() != "cpu":
        return {"rtol": 2e-3, "atol": 2e-4}
    if has_kda:
        return {"rtol": 1e-5, "atol": 1e-6}
    return {"rtol": 1e-9, "atol": 1e-10}


def rank_device() -> torch.device:
    """This rank's device (sets the current accelerator device)."""
    dev = device_type()
    if dev == "cpu":
        return torch.device("cpu")
    if dev == "npu":
        import torch_npu  # noqa: F401  (registers the npu device; only on NPU images)
    module = getattr(torch, dev)
    index = dist.get_rank() % module.device_count()
    module.set_device(index)
    if dev == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return torch.device(dev, index)


def build_mesh(tp: int, cp: int) -> Any:
    """tp x cp from one flat mesh over all ranks, with ``hyper_parallel.dtensor.unflatten``."""
    world = init_device_mesh(device_type(), (tp * cp,), mesh_dim_names=("world",))
    return unflatten(world, "world", (tp, cp), ("tp", "cp"))


def serial_model(config: hm.HybridConfig, seed: int = 0) -> hm.HybridStack:
    torch.manual_seed(seed)
    return hm.HybridStack(config).to(torch.float64)


def inputs(config: hm.HybridConfig, batch: int, seq: int, seed: int = 1) -> tuple[Any, Any]:
    """Input ``x [B, S, D]`` and the upstream gradient ``dy`` (loss = sum(y * dy))."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, config.hidden, generator=g, dtype=torch.float64)
    dy = torch.randn(batch, seq, config.hidden, generator=g, dtype=torch.float64)
    return x, dy


def rank_forward_backward(
    config: hm.HybridConfig, x: Any, dy: Any, tp: int, cp: int, options: dict[str, Any]
) -> dict[str, Any]:
    """One rank: build, parallelise, run forward + backward on its token block."""
    device = rank_device()
    mesh = build_mesh(tp, cp)
    model = serial_model(config).to(device=device, dtype=dtype())
    hm.parallelize_hybrid(model, mesh, **options)
    x_local = hm.shard_tokens(x, mesh).to(device=device, dtype=dtype()).requires_grad_()
    y = model(x_local)
    (y * hm.shard_tokens(dy, mesh).to(y)).sum().backward()
    hm.sync_gradients(model, mesh)
    assert x_local.grad is not None
    return {
        "block": hm.token_block(mesh),
        "groups": {
            name: tuple(dist.get_process_group_ranks(mesh.get_group(name))) for name in ("tp", "cp")
        },
        "y": y.detach().cpu(),
        "dx": x_local.grad.cpu(),
        "grads": hm.full_gradients(model),
    }


def run_parallel(
    config: hm.HybridConfig, x: Any, dy: Any, tp: int = 2, cp: int = 2, **options: Any
) -> list[dict[str, Any]]:
    return run_distributed(
        rank_forward_backward,
        tp * cp,
        config,
        x,
        dy,
        tp,
        cp,
        options,
        backend=backend(),
        timeout=TIMEOUT,
    )


def assemble(results: list[dict[str, Any]], key: str) -> Any:
    """The full-sequence tensor from every rank's block."""
    blocks = sorted((r["block"][0], r[key]) for r in results)
    assert [b for b, _ in blocks] == list(range(len(results)))
    return torch.cat([t for _, t in blocks], dim=1)


def check_against_serial(
    config: hm.HybridConfig, results: list[dict[str, Any]], x: Any, dy: Any
) -> None:
    """Forward, input gradient and every parameter gradient (on every rank) equal the serial
    float64 model's."""
    ref = serial_model(config)
    xr = x.clone().requires_grad_()
    yr = ref(xr)
    (yr * dy).sum().backward()
    tol = tolerances("kda" in config.layers)
    torch.testing.assert_close(assemble(results, "y").double(), yr.detach(), **tol)
    torch.testing.assert_close(assemble(results, "dx").double(), xr.grad, **tol)
    expected = {n: p.grad for n, p in ref.named_parameters()}
    for rank, r in enumerate(results):
        assert set(r["grads"]) == set(expected), f"rank {rank}: missing gradients"
        for name, grad in expected.items():
            torch.testing.assert_close(
                r["grads"][name].double(),
                grad,
                **tol,
                msg=lambda m, n=name, k=rank: f"{n} on rank {k}: {m}",
            )
