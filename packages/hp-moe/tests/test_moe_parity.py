"""Expert parallelism equals the stock module with every expert, run serially on the tokens of
the whole ep group: forward, hidden and routing-weight gradients, and each expert's weight
gradient on its owner (float64), for DeepseekV3Experts, KimiLinearExperts and Qwen3NextExperts
at ep 2 and 4 and at ep 2 inside a 4-rank world; skewed routing and a rank without tokens; each
rank computes its experts' rows and no other; the blocking twin gives the same numbers."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _moe_testutil import (
    TIMEOUT,
    E,
    H,
    close,
    ep_mesh,
    local_grad,
    routing,
    serial_reference,
    stock_experts,
)

from hyper_parallel.dtensor import DTensor, Shard
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.moe import (
    expert_counts,
    experts_info,
    is_experts_parallel,
    parallelize_experts,
    unparallelize_experts,
)

# (family, ep, tokens per rank of the ep group, chunks, routing)
CASES = {
    2: [
        ("deepseek", 2, [6, 9], 1, "random"),
        ("kimi", 2, [7, 5], 3, "random"),
        ("deepseek", 2, [8, 0], "auto", "random"),
        ("kimi", 2, [5, 6], 2, "skewed"),
        ("qwen3-next", 2, [7, 4], 2, "random"),
    ],
    4: [
        ("deepseek", 4, [5, 8, 0, 6], 2, "random"),
        ("kimi", 4, [6, 3, 7, 9], "auto", "random"),
        ("kimi", 4, [4, 6, 5, 0], 3, "skewed"),
        ("deepseek", 2, [6, 4], 2, "random"),  # two ep groups of 2 in a 4-rank world
        ("kimi", 2, [0, 7], 1, "skewed"),
        ("qwen3-next", 4, [6, 0, 5, 4], "auto", "random"),
    ],
}


def _inputs(ep: int, sizes: list[int], how: str, seed: int) -> list:
    only = list(range(E // ep)) if how == "skewed" else None  # every token to rank 0's experts
    return [routing(s, sizes[s], only=only, seed=seed) for s in range(ep)]


def _case(family: str, ep: int, sizes: list[int], chunks, how: str, seed: int) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = ep_mesh(ep, groups=world // ep)
    r = rank % ep
    mod = stock_experts(family)
    inputs = _inputs(ep, sizes, how, seed + rank // ep)
    g = torch.Generator().manual_seed(seed + 77)
    grads = [torch.randn(n, H, generator=g, dtype=torch.float64) for n in sizes]
    ref = serial_reference(mod, inputs, grads)

    results = {}
    for overlap in (True, False):
        m = parallelize_experts(stock_experts(family), mesh, chunks=chunks, overlap=overlap)
        h, i, w = inputs[r]
        h, w = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        out = m(h, i, w)
        out.backward(grads[r])
        results[overlap] = (out.detach(), h.grad, w.grad, local_grad(m.gate_up_proj),
                            local_grad(m.down_proj))  # fmt: skip
        if overlap:
            info, counts, layout = experts_info(m), expert_counts(m), m.gate_up_proj
            is_ep = is_experts_parallel(m)
    e_l = E // ep
    own = slice(r * e_l, (r + 1) * e_l)
    want = (ref["out"][r], ref["dh"][r], ref["dw"][r], ref["gate_up_proj"][own],
            ref["down_proj"][own])  # fmt: skip
    all_idx = torch.cat([i for _, i, _ in inputs])
    return {
        "got": results[True],
        "blocking": results[False],
        "want": want,
        "info": info,
        "counts": counts,
        "serial_counts": torch.bincount(all_idx.reshape(-1), minlength=E),
        "dtensor": isinstance(layout, DTensor) and layout.placements == (Shard(0),),
        "local_shape": tuple(layout.to_local().shape),
        "is_ep": is_ep,
        "r": r,
    }


def rank_cases(world: int) -> list[dict]:
    return [_case(*case, seed=10 * n) for n, case in enumerate(CASES[world])]


_CACHE: dict[int, list] = {}


def _runs(world: int) -> list[list[dict]]:
    if world not in _CACHE:
        _CACHE[world] = run_distributed(rank_cases, world, world, timeout=TIMEOUT)
    return _CACHE[world]


def _ids(world: int) -> list[str]:
    return [f"{f}-ep{ep}-{'-'.join(map(str, s))}-c{c}-{how}" for f, ep, s, c, how in CASES[world]]


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_gets_the_stock_module_output_and_every_gradient(world):
    for ranks in _runs(world):
        for n, res in enumerate(ranks):
            for got, want, name in zip(res["got"], res["want"], ("out", "dh", "dw", "dgu", "ddn")):
                assert got.shape == want.shape, (_ids(world)[n], name)
                close(got, want)


@pytest.mark.parametrize("world", [2, 4])
def test_the_blocking_twin_computes_the_same_numbers(world):
    for ranks in _runs(world):
        for res in ranks:
            for a, b in zip(res["got"], res["blocking"]):
                close(a, b, 1e-13)


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_holds_its_experts_only_and_computes_their_rows_only(world):
    for ranks in _runs(world):
        for n, res in enumerate(ranks):
            _, ep, sizes, _, _ = CASES[world][n]
            e_l = E // ep
            assert res["dtensor"] and res["is_ep"]
            assert res["local_shape"][0] == e_l
            assert res["info"]["local_experts"] == list(range(res["r"] * e_l, (res["r"] + 1) * e_l))
            # the global counts are the serial routing's, and this rank's experts computed
            # exactly their share of the rows: no row twice, none dropped, no padding
            assert torch.equal(res["counts"], res["serial_counts"])
            mine = res["serial_counts"][res["r"] * e_l : (res["r"] + 1) * e_l].tolist()
            assert res["info"]["rows"] == mine
        for n in range(len(CASES[world])):
            ep, sizes = CASES[world][n][1], CASES[world][n][2]
            k = 2
            per_group = [ranks[n]["info"]["rows"] for ranks in _runs(world)][:ep]
            assert sum(map(sum, per_group)) == k * sum(sizes)


def test_skewed_routing_loads_one_rank_and_the_others_compute_nothing():
    for ranks in _runs(4):
        res = ranks[2]  # kimi ep 4, every token to rank 0's experts
        assert (sum(res["info"]["rows"]) > 0) == (res["r"] == 0)


def test_auto_chunks_say_why():
    for ranks in _runs(2):
        info = ranks[2]["info"]
        assert info["chunks"] >= 1 and "chunk" in info["chunks_reason"]
        assert info["impl"] == "torch" and "cpu" in info["impl_reason"]


def _round_trip() -> dict:
    mesh = ep_mesh()
    mod = stock_experts("deepseek")
    whole = [p.detach().clone() for p in mod.parameters()]
    parallelize_experts(mod, mesh)
    unparallelize_experts(mod)
    h, i, w = routing(dist.get_rank(), 5)
    return {
        "back": not is_experts_parallel(mod) and type(mod).__name__ == "DeepseekV3Experts",
        "same": all(torch.equal(a, b) for a, b in zip(whole, mod.parameters())),
        "plain": not any(isinstance(p, DTensor) for p in mod.parameters()),
        "runs": mod(h, i, w).shape == (5, H),
    }


def test_unparallelize_gathers_every_expert_back_into_the_stock_module():
    for res in run_distributed(_round_trip, 2, timeout=TIMEOUT):
        assert res == {"back": True, "same": True, "plain": True, "runs": True}
