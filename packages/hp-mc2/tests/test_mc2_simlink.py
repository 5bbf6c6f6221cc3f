"""The modeled link (``simulated_link``) changes no result: the chunked MLP pair (as styles and
as functions, one chunk and several) and the gated MLP give bitwise the same output and every
gradient with and without it, and the link really carried their collectives."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _mc2_testutil import rank_and_size, seeded
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

from hyper_parallel.dtensor import init_device_mesh
from hyper_parallel.dtensor.testing import compare_under_link, run_distributed
from hyper_parallel.mc2 import (
    MC2ColwiseParallel,
    MC2RowwiseParallel,
    all_gather_matmul,
    gated_mlp,
    matmul_reduce_scatter,
)

LATENCY = 1e-3
M, D, F = 4, 8, 6  # rows per rank, hidden, ffn features per rank


class _MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, ffn)
        self.down = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


def _grads(y: torch.Tensor, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    dy = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)
    y.backward(dy)
    return [y.detach(), *(t.grad for t in leaves)]


def _functional(chunks: int, gated: bool) -> list[torch.Tensor]:
    r = rank_and_size()[0]
    x = seeded(1 + r, M, D, dtype=torch.float64).requires_grad_()
    ws_ = [seeded(10 + i + 3 * r, *s, dtype=torch.float64).requires_grad_() for i, s in
           enumerate([(F, D), (F, D), (D, F)])]  # fmt: skip
    bias = seeded(20 + r, F, dtype=torch.float64).requires_grad_()
    if gated:
        y = gated_mlp(
            x, *ws_, act_fn=torch.nn.functional.silu, gate_bias=bias, impl="torch",
            chunks=chunks,
        )  # fmt: skip
        return _grads(y, [x, *ws_, bias])
    h = all_gather_matmul(x, ws_[0], bias=bias, impl="torch", chunks=chunks)
    h = torch.nn.functional.gelu(h)
    y = matmul_reduce_scatter(h, ws_[2], impl="torch", chunks=chunks)
    return _grads(y, [x, ws_[0], ws_[2], bias])


def _styles(base: nn.Module, mesh: Any) -> list[torch.Tensor]:
    r, ws = rank_and_size()
    model = copy.deepcopy(base)
    parallelize_module(
        model, mesh, {"up": MC2ColwiseParallel(1, chunks=2), "down": MC2RowwiseParallel(1)}
    )
    x = seeded(5, 2, M * ws, D, dtype=torch.float64).chunk(ws, dim=1)[r].clone()
    x.requires_grad_()
    y = _grads(model(x), [x])
    return y + [p.grad.to_local() for p in model.parameters()]


def _rank_compare() -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (rank_and_size()[1],))
    torch.manual_seed(0)
    base = _MLP(D, F * rank_and_size()[1]).double()
    cases: dict[str, Callable[[], list[torch.Tensor]]] = {
        f"{'gated' if g else 'mlp'}/chunks={c}": (lambda c=c, g=g: _functional(c, g))
        for c in (1, 2)
        for g in (False, True)
    }
    cases["styles"] = lambda: _styles(base, mesh)
    return compare_under_link(cases, LATENCY)


@pytest.mark.timeout(120)
def test_outputs_and_gradients_bitwise_identical_under_the_link():
    for rank_res in run_distributed(_rank_compare, 2, timeout=100):
        for name, r in rank_res.items():
            assert r["count"] >= 3 and all(r["equal"]), (name, r["equal"])
            # forward gather + reduce-scatter and their backward duals at least
            assert r["collectives"] >= 4 and r["modeled_s"] >= 4 * LATENCY, (name, r)
