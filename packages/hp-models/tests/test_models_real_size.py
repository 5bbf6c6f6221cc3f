"""``benchmarks/real_size.py`` (parameter bytes per rank under ``parallelize_model`` with
FSDP2, counted in one process over torch's fake process group) against real ranks: for tiny
DeepSeek-V3 and Kimi-Linear models on 4 gloo ranks, every rank's local parameter elements
(routed experts apart), FSDP2's padded allocation and the largest all-gathered layer equal what
the script computes for that rank from the fake group; over the ranks the shards add up to the
whole model (no dp replica), and ``ep`` divides the experts FSDP2 gathers by exactly ``ep``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hyper_parallel.dtensor import init_device_mesh, unflatten
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.models import parallelize_model
from hyper_parallel.models.fsdp import fsdp_available
from hyper_parallel.models.testing import deepseek_config, kimi_config, tiny_model

pytestmark = pytest.mark.skipif(not fsdp_available(), reason="needs FSDP2 that can sum")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "real_size.py"
TIMEOUT = 120.0
# (kind, config overrides, (dp, cp, tp), ep) on 4 ranks; a vocabulary of 50 rows gives uneven
# FSDP2 chunks (13, 13, 13, 11), 4 routed experts over edp = 4 / ep ranks (ep = 1: chunks of 1)
CASES: list[tuple[str, dict[str, Any], tuple[int, int, int], int]] = [
    ("deepseek", {"vocab_size": 50}, (1, 2, 2), 1),
    ("deepseek", {"vocab_size": 50}, (1, 2, 2), 2),
    ("deepseek", {"vocab_size": 50}, (2, 2, 1), 4),
    ("kimi", {"vocab_size": 50, "num_experts": 8}, (1, 2, 2), 4),
    ("kimi", {"vocab_size": 50, "num_experts": 8}, (2, 1, 2), 2),
]


def _script() -> Any:
    name = "hp_models_real_size"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPT)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _config(kind: str, overrides: dict[str, Any]) -> Any:
    return (deepseek_config if kind == "deepseek" else kimi_config)(**overrides)


def _real_rank(cases: list[Any]) -> list[Any]:
    """On each real rank: for every case, (local elements, routed-expert elements, FSDP2
    allocation, largest gathered layer) of the real model placed by ``parallelize_model``."""
    import torch.distributed as dist

    rs = _script()
    out = []
    for i, (kind, overrides, (dp, cp, tp), ep) in enumerate(cases):
        model = tiny_model(kind, dtype=torch.float32, **overrides)
        # a root mesh of its own per case (hp-dtensor names the flattened sub-meshes per root,
        # and the cases flatten different layouts to the same names)
        name = f"world{i}"
        world = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=(name,))
        mesh = unflatten(world, name, (dp, cp, tp), ("dp", "cp", "tp"))
        parallelize_model(model, mesh, ep=ep, grad_reduction="fsdp")
        out.append((*rs.local_elements(model), *rs.fsdp_elements(model)[:2]))
    return out


@pytest.mark.timeout(TIMEOUT + 30)
def test_fake_group_counts_equal_real_ranks() -> None:
    rs = _script()
    real = run_distributed(_real_rank, 4, CASES, timeout=TIMEOUT)
    for i, (kind, overrides, mesh, ep) in enumerate(CASES):
        cfg = _config(kind, overrides)
        dp, cp, tp = mesh
        model = rs.place(cfg, dp, cp, tp, ep, 0)
        total, experts = rs.every_rank_elements(model, 4)
        alloc, gathered, unmanaged = rs.fsdp_elements(model)
        assert unmanaged == 0
        case = f"{kind} {mesh} ep={ep}"
        for r in range(4):
            assert real[r][i] == (total[r], experts[r], alloc, gathered), f"{case}, rank {r}"
        # the script's own row: the busiest rank, checked there against placements on
        # ranks 0 and 3
        row = rs.measure(kind, mesh, ep, cfg=cfg)
        assert (row.max_elems, row.min_elems) == (max(total), min(total)), case
        assert row.params == sum(p.numel() for p in model.parameters()), case
    assert len({r[0][0] for r in real}) > 1, "no uneven chunks: the case tests too little"


@pytest.mark.timeout(60)
def test_shards_add_up_and_ep_divides_the_gathered_experts() -> None:
    rs = _script()
    cfg = deepseek_config(vocab_size=50, n_routed_experts=8)
    whole = rs.build_on_meta(cfg)
    n_params = sum(p.numel() for p in whole.parameters())
    n_experts = sum(p.numel() for n, p in whole.named_parameters() if rs._is_expert(n))
    gathered_experts = {}
    for ep in (1, 2, 4):
        model = rs.place(cfg, 1, 2, 2, ep, 0)  # dp = 1: nothing is replicated
        total, experts = rs.every_rank_elements(model, 4)
        assert sum(total) == n_params, ep
        assert sum(experts) == n_experts, ep
        names = {id(p): n for n, p in model.named_parameters()}
        gathered_experts[ep] = sum(
            torch.Size(fp._orig_size).numel()  # what FSDP2 all-gathers it to
            for mod in model.modules()
            if hasattr(mod, "_get_fsdp_state")
            and mod._get_fsdp_state()._fsdp_param_group is not None
            for fp in mod._get_fsdp_state()._fsdp_param_group.fsdp_params
            if rs._is_expert(names[id(fp.sharded_param)])
        )
    assert gathered_experts[1] == n_experts
    assert gathered_experts[2] * 2 == gathered_experts[4] * 4 == n_experts
