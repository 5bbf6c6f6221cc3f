"""The modeled link (``simulated_link``) changes no result: ``kda_context_parallel`` with each
exchange protocol and the short-convolution halo give bitwise the same outputs, final state and
every gradient with and without it, and the link really carried their collectives."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _kda_testutil import kda_inputs

from hyper_parallel.dtensor import init_device_mesh
from hyper_parallel.dtensor.testing import compare_under_link, run_distributed
from hyper_parallel.kda import kda_context_parallel, start_causal_conv_halo

LATENCY = 1e-3
B, T, H, K, V = 1, 16, 2, 4, 3
WIDTH = 4


def _kda(protocol: str, mesh: Any) -> list[torch.Tensor]:
    P, r = dist.get_world_size(), dist.get_rank()
    full = kda_inputs(B, T, H, K, V, seed=3)
    lo, hi = T * r // P, T * (r + 1) // P
    xs = [x[:, lo:hi].clone().requires_grad_(True) for x in full[:5]]
    h0 = full[5].clone().requires_grad_(True)
    o, hT = kda_context_parallel(
        *xs, mesh, protocol=protocol, initial_state=h0, output_final_state=True, chunk_size=4
    )
    loss = (o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)).sum()
    if hT is not None:
        loss = loss + hT.square().sum()
    loss.backward()
    # the final state lives on the last rank, the initial state's gradient on the first
    final = hT.detach() if hT is not None else torch.zeros(0)
    dh0 = h0.grad if h0.grad is not None else torch.zeros(0)
    return [o.detach(), final, *(x.grad for x in xs), dh0]


def _halo(mesh: Any) -> list[torch.Tensor]:
    r = dist.get_rank()
    g = torch.Generator().manual_seed(10 + r)
    x = torch.randn(B, 6, 5, dtype=torch.float64, generator=g).requires_grad_(True)
    w = torch.randn(5, 1, WIDTH, dtype=torch.float64, generator=g)
    pending = start_causal_conv_halo(x, WIDTH, mesh)
    y0 = x.square()  # compute between launch and wait
    full = torch.cat([pending.wait(), x], dim=1)
    y = torch.nn.functional.conv1d(full.transpose(1, 2), w, groups=5).transpose(1, 2)
    (y.sum() + y0.sum() + (y * y).sum()).backward()
    return [y.detach(), x.grad]


def _rank_compare() -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    cases = {"p2p": lambda: _kda("p2p", mesh), "allgather": lambda: _kda("allgather", mesh)}
    cases["halo"] = lambda: _halo(mesh)
    return compare_under_link(cases, LATENCY)


@pytest.mark.timeout(120)
def test_outputs_and_gradients_bitwise_identical_under_the_link():
    for rank_res in run_distributed(_rank_compare, 2, timeout=100):
        for name, r in rank_res.items():
            assert r["count"] >= 2 and all(r["equal"]), (name, r["equal"])
            assert r["collectives"] >= 2 and r["modeled_s"] >= 2 * LATENCY, (name, r)
