"""``run_experts(..., alongside=fn)``: a MoE block's shared experts run while the first
dispatch is in flight (forward), under the caller's autocast, and their result and gradients
are those of running them on their own; with ``overlap=False`` they run before the dispatch."""

from __future__ import annotations

import torch
import torch.distributed as dist
from _moe_testutil import TIMEOUT, H, close, ep_mesh, routing, stock_experts
from torch import nn

from hyper_parallel.dtensor import comm
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.moe import parallelize_experts, run_experts


def rank_alongside() -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    shared = nn.Sequential(nn.Linear(H, 8), nn.SiLU(), nn.Linear(8, H)).double()
    h, i, w = routing(rank, 6)
    out = {}
    for overlap in (True, False):
        m = parallelize_experts(stock_experts(), ep_mesh(), overlap=overlap, chunks=2)
        x = h.clone().requires_grad_(True)
        seen = []

        def side(x=x, seen=seen):
            seen.append(comm.pending_collectives())
            return shared(x)

        y, s = run_experts(m, x, i, w, alongside=side)
        plain = m(h, i, w)
        (y + s).square().sum().backward()
        out[overlap] = {"pending": seen[0], "y": y.detach(), "plain": plain.detach(),
                        "s": s.detach(), "ref_s": shared(h).detach(), "dx": x.grad}  # fmt: skip
    return out


def test_shared_work_runs_while_the_first_dispatch_is_in_flight_and_computes_the_same():
    for res in run_distributed(rank_alongside, 2, timeout=TIMEOUT):
        assert any("moe:dispatch0" in p for p in res[True]["pending"]), res[True]["pending"]
        assert res[False]["pending"] == []  # blocking twin: before any exchange
        for run in res.values():
            close(run["y"], run["plain"])
            close(run["s"], run["ref_s"])
        close(res[True]["dx"], res[False]["dx"])


def test_run_experts_refuses_a_module_that_is_not_parallel():
    try:
        run_experts(stock_experts(), *routing(0, 2))
    except RuntimeError as exc:
        assert "not parallelized" in str(exc)
    else:
        raise AssertionError("run_experts accepted a plain module")
