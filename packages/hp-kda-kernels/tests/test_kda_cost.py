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


def test_defaults_exist_per_device_type_and_are_overridable() -> None:
    assert set(DEFAULT_COST_PARAMS) >= {"cpu", "cuda", "npu"}
    for dev in ("cpu", "cuda", "npu"):
        assert choose_protocol(4, 1, 4, 128, 128, device_type=dev).protocol in {
            "p2p", "allgather", "grouped",
        }  # fmt: skip
    custom = choose_protocol(4, 1, 4, 128, 128, group_sizes=[], params=DEFAULT_COST_PARAMS["cpu"])
    assert "grouped:2" not in custom.costs


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
