"""FSDP2 made to SUM gradients on every torch it can be (``hyper_parallel.models.fsdp``): a toy
model whose middle block uses one linear layer on some ranks only, wrapped with ``fully_shard``
and ``make_sums``, gives every parameter the exact sum over the ranks of the local gradients
(integer-valued data: every sum is exact in any order, so ``torch.equal`` checks the scaling),
in float64 and float32, over one FSDP mesh of 4 ranks and with the block under HSDP (dp 2 ×
2 shards); the parameter one rank did not use still joins that rank's reduce-scatter (no hang,
no shorter buffer). Also: which means this torch offers, named by ``fsdp_mode``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hyper_parallel.dtensor import init_device_mesh, unflatten
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.models.fsdp import (
    fsdp_available,
    fsdp_mode,
    make_sums,
    native_unused_params,
)

DIM, ROWS = 4, 3


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM, bias=False)
        self.b = nn.Linear(DIM, DIM)  # used on some ranks only

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        y = self.a(x)
        return y + self.b(y) if use_b else y


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(DIM, DIM, bias=False)  # so the block's input needs a gradient
        self.block = _Block()
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.head(self.block(self.pre(x), use_b))


def _toy(dtype: torch.dtype) -> _Toy:
    torch.manual_seed(0)
    toy = _Toy()
    with torch.no_grad():
        for p in toy.parameters():
            p.copy_(torch.randint(-1, 2, p.shape))
    return toy.to(dtype)


def _run(dtype_name: str, hsdp: bool, fill: bool | None) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    dtype = getattr(torch, dtype_name)
    rank, world = dist.get_rank(), dist.get_world_size()
    flat = init_device_mesh("cpu", (world,), mesh_dim_names=("world",))
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randint(-1, 2, (ROWS, DIM), generator=g).to(dtype)
    use_b = rank != 1
    # the local gradients, summed over the ranks in float64 (exact: small integers)
    plain = _toy(dtype)
    plain(x, use_b).sum().backward()
    want = {}
    for name, p in plain.named_parameters():
        local = torch.zeros_like(p, dtype=torch.float64) if p.grad is None else p.grad.double()
        dist.all_reduce(local)
        want[name] = local
    toy = _toy(dtype)
    if hsdp:
        mesh = unflatten(flat, "world", (2, world // 2), ("dp", "sh"))
        if fsdp_mode() == "sum_op":  # torch 2.7: FSDP over "sh", the hook sums over dp
            block = (fully_shard(toy.block, mesh=mesh["sh"]), mesh["sh"], mesh["dp"])
        else:
            block = (fully_shard(toy.block, mesh=mesh), mesh, None)
    else:
        block = (fully_shard(toy.block, mesh=flat), flat, None)
    make_sums([block, (fully_shard(toy, mesh=flat), flat, None)], fill_unused=fill)
    for _ in range(2):  # a second step: the hooks and the fill run again
        toy.zero_grad(set_to_none=True)
        toy(x, use_b).sum().backward()
    got = {}
    for name, p in toy.named_parameters():
        assert isinstance(p, DTensor), name
        got[name] = None if p.grad is None else p.grad.full_tensor().double()
    sharded = {n: tuple(p.to_local().shape) != tuple(p.shape) for n, p in toy.named_parameters()}
    return {"want": want, "got": got, "sharded": sharded}


@pytest.mark.skipif(not fsdp_available(), reason="no FSDP2 that can sum on this torch")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fill", [None, True], ids=["by-torch", "fill"])
@pytest.mark.parametrize("hsdp", [False, True], ids=["fsdp", "hsdp"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_fsdp_sums_exactly_with_a_parameter_one_rank_did_not_use(dtype, hsdp, fill):
    """``fill``: None, this torch's means for unused parameters; True, the zero-cost
    dependency (what torch < 2.13 uses) on any torch."""
    for rank, r in enumerate(run_distributed(_run, 4, dtype, hsdp, fill, timeout=280)):
        assert set(r["got"]) == set(r["want"])
        for name, want in r["want"].items():
            assert r["got"][name] is not None, (rank, name)
            assert torch.equal(r["got"][name], want), (rank, name, r["got"][name], want)
        assert r["sharded"]["block.a.weight"] and r["sharded"]["pre.weight"], r["sharded"]


def test_fsdp_mode_names_the_means_of_this_torch():
    from torch.distributed.fsdp import FSDPModule

    mode = fsdp_mode()
    if hasattr(FSDPModule, "set_gradient_divide_factor"):
        assert mode == "divide_factor"
    elif hasattr(FSDPModule, "set_all_reduce_hook"):  # torch 2.7
        assert mode == "sum_op"
    assert fsdp_available() == (mode is not None)
    assert native_unused_params() == hasattr(FSDPModule, "set_reduce_scatter_unused_params")
