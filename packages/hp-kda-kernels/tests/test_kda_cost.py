"""choose_protocol: the cost model's choices follow its parameters and explain themselves."""

from __future__ import annotations

import pytest

from hyper_parallel.kda import DEFAULT_COST_PARAMS, CostParams, choose_protocol


def test_choice_lists_every_candidate_cost_and_picks_the_cheapest() -> None:
    c = choose_protocol(8, 1, 4, 128, 128)
    assert set(c.costs) == {"p2p", "allgather", "grouped:2", "grouped:4"}
    best = min(c.costs, key=c.costs.__getitem__)
    assert best.split(":")[0] == c.protocol
    assert c.group_size == (int(best.split(":")[1]) if ":" in best else None)
    for name in c.costs:
        assert name in c.explanation
    assert "P=8" in c.explanation


def test_latency_bound_links_prefer_one_collective() -> None:
    slow_hops = CostParams(latency_s=1e-2, bandwidth_Bps=1e12, flops_per_s=1e15)
    assert choose_protocol(8, 1, 1, 16, 16, params=slow_hops).protocol == "allgather"


def test_bandwidth_bound_links_prefer_the_chain_that_receives_one_state() -> None:
    thin_pipe = CostParams(latency_s=1e-7, bandwidth_Bps=1e6, flops_per_s=1e15)
    for P in (2, 4):
        assert choose_protocol(P, 1, 8, 128, 128, params=thin_pipe).protocol == "p2p"


def test_grouped_wins_between_the_extremes_on_many_ranks() -> None:
    mid = CostParams(latency_s=1e-4, bandwidth_Bps=1e9, flops_per_s=1e15)
    c = choose_protocol(64, 1, 2, 64, 64, params=mid)
    assert c.protocol == "grouped" and c.group_size is not None and 64 % c.group_size == 0


def test_modelled_costs_grow_with_the_state_size() -> None:
    small = choose_protocol(4, 1, 1, 64, 64).costs
    large = choose_protocol(4, 4, 8, 128, 128).costs
    assert all(large[n] > small[n] for n in small)


def _hand_costs(P: int, B: int, H: int, K: int, V: int, p: CostParams) -> dict[str, float]:
    """The README's formulas, written out independently of the module."""
    a, bw, F = p.latency_s, p.bandwidth_Bps, p.flops_per_s
    state, summary, fold = 4 * B * H * K * V, 4 * B * H * K * (K + V), 2 * B * H * K * K * V
    log2 = {2: 1, 4: 2, 8: 3}
    costs = {
        "p2p": (P - 1) * (a + state / bw + fold / F),
        "allgather": a * log2[P] + (P - 1) * (summary / bw + fold / F),
    }
    for w in [w for w in (2, 4) if w < P and P % w == 0]:
        costs[f"grouped:{w}"] = (
            a * log2[w] + (w - 1) * summary / bw
            + (P // w - 1) * (a + state / bw + w * fold / F)
            + log2[w] * (a + state / bw) + (w - 1) * fold / F
        )  # fmt: skip
    return costs


@pytest.mark.parametrize("dev", ["cpu", "cuda", "npu"])
def test_defaults_per_device_type_give_the_modelled_costs_and_their_argmin(dev: str) -> None:
    params = DEFAULT_COST_PARAMS[dev]
    for P, B, H in ((2, 1, 32), (4, 1, 32), (8, 2, 8)):
        c = choose_protocol(P, B, H, 128, 128, device_type=dev)
        want = _hand_costs(P, B, H, 128, 128, params)
        assert set(c.costs) == set(want)
        for name, cost in want.items():
            assert c.costs[name] == pytest.approx(cost, rel=1e-12), (dev, P, name)
        best = min(want, key=want.__getitem__)
        assert (c.protocol, c.group_size) == (
            best.split(":")[0], int(best.split(":")[1]) if ":" in best else None,
        )  # fmt: skip
    # the CPU defaults were measured on gloo over localhost: the chain wins for Kimi states
    assert choose_protocol(4, 1, 32, 128, 128, device_type="cpu").protocol == "p2p"


def test_explicit_params_and_group_sizes_override_the_defaults() -> None:
    custom = choose_protocol(4, 1, 4, 128, 128, group_sizes=[], params=DEFAULT_COST_PARAMS["cpu"])
    assert set(custom.costs) == {"p2p", "allgather"}
    slow_hops = CostParams(latency_s=1.0, bandwidth_Bps=1e12, flops_per_s=1e15)
    assert choose_protocol(4, 1, 4, 128, 128, device_type="cpu", params=slow_hops).protocol == (
        "allgather"
    )


def test_cost_model_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="world_size"):
        choose_protocol(0, 1, 1, 16, 16)
    with pytest.raises(ValueError, match="heads"):
        choose_protocol(4, 1, True, 16, 16)
    with pytest.raises(ValueError, match="no default cost parameters"):
        choose_protocol(4, 1, 1, 16, 16, device_type="tpu")
    with pytest.raises(ValueError, match="group size 3"):
        choose_protocol(4, 1, 1, 16, 16, group_sizes=[3])
    with pytest.raises(ValueError, match="latency_s"):
        CostParams(latency_s=0.0, bandwidth_Bps=1.0, flops_per_s=1.0)
