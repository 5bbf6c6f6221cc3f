"""``moe_block_forward``: a stock MoE block (``DeepseekV3MoE``, ``KimiLinearMoE``,
``Qwen3NextSparseMoeBlock``) with its experts split over ep gives, on each rank's own tokens,
what the stock block gives on them: the output and every gradient (the hidden states, the
router, the shared expert and its gate on each rank; each expert's weights on its owner, summed
over the tokens of every rank of the ep group), float64; the shared work runs while the first
dispatch is in flight; ``on_routing`` sees the router's choice. ``shared_work`` and the
refusals run on plain (unsplit) blocks."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _moe_testutil import TIMEOUT, E, H, close, ep_mesh, local_grad, stock_block
from torch import nn

from hyper_parallel.dtensor import comm
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.moe import moe_block_forward, parallelize_experts, shared_work

WORLD = 4
# (family, ep, (B, S) per rank of the ep group): ep 2 runs as two ep groups in the 4-rank world
CASES = [
    ("deepseek", 2, [(2, 3), (1, 5)]),
    ("kimi", 2, [(1, 4), (2, 2)]),
    ("qwen3-next", 2, [(2, 2), (1, 6)]),
    ("qwen3-next", 4, [(1, 3), (2, 3), (1, 1), (1, 5)]),
]
# the stock routers compute in float32 (DeepSeek-V3 and Kimi cast the logits, Qwen3-Next's
# softmax), so what flows back through the router (its weight, the hidden states) can differ in
# a float32 rounding when the experts' float64 gradient differs in its last bits (with torch
# 2.13 they agree to 1e-10; the bound allows one float32 rounding on other versions)
ROUTER_TOL = 1e-6


def _shared_modules(block: nn.Module) -> list[nn.Module]:
    names = ("shared_experts", "shared_expert")
    return [getattr(block, n) for n in names if getattr(block, n, None) is not None]


def _case(family: str, ep: int, shapes: list[tuple[int, int]], seed: int) -> dict:
    rank = dist.get_rank()
    mesh = ep_mesh(ep, groups=WORLD // ep)
    r, group = rank % ep, rank // ep
    g = torch.Generator().manual_seed(seed + group)
    xs = [torch.randn(b, s, H, generator=g, dtype=torch.float64) for b, s in shapes]
    dys = [torch.randn(b, s, H, generator=g, dtype=torch.float64) for b, s in shapes]

    # the stock block, serially on each rank's tokens: per-rank gradients of the replicated
    # parameters, the experts' summed over the ranks
    stock = stock_block(family)
    want: list[dict] = []
    for x, dy in zip(xs, dys):
        ref = copy.deepcopy(stock)
        xr = x.clone().requires_grad_(True)
        out = ref(xr)
        out.backward(dy)
        want.append({"out": out.detach(), "dh": xr.grad, "index": ref.gate(x)[2],
                     **{n: p.grad for n, p in ref.named_parameters()}})  # fmt: skip
    e_l = E // ep
    own = slice(r * e_l, (r + 1) * e_l)
    for n in ("experts.gate_up_proj", "experts.down_proj"):
        want[r][n] = sum(w[n] for w in want)[own]

    block = stock_block(family)
    parallelize_experts(block.experts, mesh, chunks=2)
    pending: list = []
    for m in _shared_modules(block):
        m.register_forward_pre_hook(lambda *_: pending.append(comm.pending_collectives()))
    routed: list = []
    x = xs[r].clone().requires_grad_(True)
    out = moe_block_forward(block, x, on_routing=routed.append)
    out.backward(dys[r])
    got = {"out": out.detach(), "dh": x.grad, "index": routed[0],
           **{n: local_grad(p) for n, p in block.named_parameters()}}  # fmt: skip
    return {"got": got, "want": want[r], "pending": pending, "routings": len(routed)}


def rank_blocks() -> list[dict]:
    return [_case(*case, seed=10 * n) for n, case in enumerate(CASES)]


_CACHE: list = []


def _runs() -> list[list[dict]]:
    if not _CACHE:
        _CACHE.append(run_distributed(rank_blocks, WORLD, timeout=TIMEOUT))
    return _CACHE[0]


@pytest.mark.parametrize("n", range(len(CASES)), ids=[f"{f}-ep{ep}" for f, ep, _ in CASES])
def test_block_forward_equals_the_stock_block_output_and_every_gradient(n):
    for rank, ranks in enumerate(_runs()):
        res = ranks[n]
        got, want = res["got"], res["want"]
        assert set(got) == set(want), (rank, sorted(set(got) ^ set(want)))
        # the router's, the experts', the shared expert's (and its gate's) parameters
        assert any(k.startswith("gate.") for k in got) and any("shared" in k for k in got)
        assert torch.equal(got["index"], want["index"]) and res["routings"] == 1
        for name, value in want.items():
            assert value is not None and got[name] is not None, (rank, name)
            assert got[name].shape == value.shape, (rank, name)
            through_router = name == "dh" or name.startswith("gate.")
            close(got[name], value, ROUTER_TOL if through_router else 1e-10)


def test_the_shared_work_runs_while_the_first_dispatch_is_in_flight():
    for ranks in _runs():
        for res in ranks:
            assert len(res["pending"]) == 1, res["pending"]  # called once, under the dispatch
            assert any("moe:dispatch0" in p for p in res["pending"][0]), res["pending"]


class _NoRouter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Linear(H, H)


def test_shared_work_and_the_refusals_on_plain_blocks():
    x = torch.randn(2, 3, H, dtype=torch.float64)
    for family in ("deepseek", "qwen3-next"):
        block = stock_block(family)
        # experts not split: the stock forward's numbers, serially
        close(moe_block_forward(block, x), block(x), 0.0)
    qwen = stock_block("qwen3-next")
    gated = torch.sigmoid(qwen.shared_expert_gate(x)) * qwen.shared_expert(x)
    assert torch.equal(shared_work(qwen)(x), gated)
    kimi = stock_block("kimi")
    assert shared_work(kimi) is kimi.shared_experts
    assert shared_work(_NoRouter()) is None
    with pytest.raises(TypeError, match=r"_NoRouter has no gate"):
        moe_block_forward(_NoRouter(), x)
    with pytest.raises(TypeError, match=r"Linear has no gate and no experts"):
        moe_block_forward(nn.Linear(H, H), x)
    orphan = _NoRouter()
    orphan.shared_expert_gate = nn.Linear(H, 1)
    with pytest.raises(TypeError, match="shared_expert_gate but no shared_expert"):
        shared_work(orphan)
