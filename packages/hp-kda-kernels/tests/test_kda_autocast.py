"""A context-parallel stock ``KimiLinearDeltaAttention`` under ``torch.autocast`` (bf16, fp16,
CPU, float32 weights) computes what the serial layer computes under the same autocast, with
the recurrence's state in float32: the projections, the short convolution, the gate and the
output norm in autocast's dtypes, the KDA core in float32 (cast at its boundary).

The serial reference is the stock layer with its torch ``chunk_kda`` fallback run with autocast
off: the fallback casts its inputs to float32 but would then run its matmuls, state included,
in bf16 under the caller's autocast, where flash-linear-attention's kernel (what the stock model
runs on a GPU) keeps float32. Checked: the output's and every gradient's dtype, and values
within a fraction of the serial layer's own low-precision spread (``‖serial under autocast −
serial in float32‖``): the forward to 0.1 of it (every rank rounds where the serial layer
does), the gradients to 2x (each rank's parameter gradient is its own rows' share, rounded in
the low precision before the shares are summed: rounding of the order of the spread itself).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _kda_hf import kda_layer, kimi

from hyper_parallel.dtensor import init_device_mesh
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.kda import parallelize_kda

B, T, HIDDEN = 2, 16, 32
FORWARD_FRACTION, GRAD_FRACTION = 0.1, 2.0


def _run(layer: Any, x: torch.Tensor, dy: torch.Tensor, amp: Any, inside: bool) -> dict:
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
        y = layer(x)
        if inside:
            y.backward(dy.to(y.dtype))
    if not inside:
        y.backward(dy.to(y.dtype))
    return {"y": y.detach(), "dx": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}


def _serial(layer: Any, x: torch.Tensor, dy: torch.Tensor, amp: Any) -> dict:
    module = kimi()
    original = module.chunk_kimi_delta_attention

    def fp32_core(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast("cpu", enabled=False):
            return original(*args, **kwargs)

    module.chunk_kimi_delta_attention = fp32_core
    try:
        return _run(copy.deepcopy(layer), x, dy, amp, False)
    finally:
        module.chunk_kimi_delta_attention = original


def _cases() -> list[list[str]]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    p, r = mesh.size(), mesh.get_local_rank()
    rows = slice(r * T // p, (r + 1) * T // p)
    g = torch.Generator().manual_seed(5)
    X, dY = torch.randn(B, T, HIDDEN, generator=g), torch.randn(B, T, HIDDEN, generator=g)
    serial = kda_layer(seed=0, hidden=HIDDEN).float()
    f32 = _serial(serial, X, dY, None)
    out = []
    for amp, inside in ((torch.bfloat16, False), (torch.float16, True)):
        par = parallelize_kda(copy.deepcopy(serial), mesh)
        got = _run(par, X[:, rows], dY[:, rows], amp, inside)
        for name, _ in par.named_parameters():  # each rank's share of a replicated parameter
            dist.all_reduce(got[name])
        low = _serial(serial, X, dY, amp)
        bad = []
        for key, want in low.items():
            ref, base = (
                (want[:, rows], f32[key][:, rows]) if key in ("y", "dx") else (want, f32[key])
            )
            if got[key].dtype != ref.dtype:
                bad.append(f"{amp} {key}: dtype {got[key].dtype}, serial {ref.dtype}")
                continue
            spread = float(torch.linalg.vector_norm(ref.double() - base.double()))
            diff = float(torch.linalg.vector_norm(got[key].double() - ref.double()))
            fraction = FORWARD_FRACTION if key == "y" else GRAD_FRACTION
            if not diff <= fraction * spread + 1e-7:
                bad.append(f"{amp} {key}: |par - serial| = {diff:.3g}, spread {spread:.3g}")
        out.append(bad)
    return out


@pytest.mark.timeout(240)
def test_kda_layer_under_autocast_matches_the_serial_layer_with_a_float32_state():
    for rank, per_amp in enumerate(run_distributed(_cases, 2, timeout=200)):
        for bad in per_amp:
            assert not bad, (rank, bad)
