"""The modeled link (``simulated_link``) changes no result: every strategy and schedule gives
bitwise the same output and gradients with and without it, and the link really carried the
block's collectives (so the comparison is not vacuous)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _cp_testutil import TIMEOUT, build, cp_mesh, inputs

from hyper_parallel.context_parallel import parallelize_mla, shard_sequence
from hyper_parallel.dtensor.testing import compare_under_link, run_distributed

LATENCY = 1e-3
COMBOS = [(s, o) for s in ("expanded", "latent") for o in (True, False)]


def _step(strategy: str, overlap: bool, mesh: Any) -> list[torch.Tensor]:
    m = build(q_lora=True)
    parallelize_mla(m, mesh, strategy=strategy, overlap=overlap)
    x, dy = inputs()
    x_local = shard_sequence(x, mesh).clone().requires_grad_(True)
    out = m(x_local)
    out.backward(shard_sequence(dy, mesh))
    return [out.detach(), x_local.grad, *(p.grad for _, p in m.named_parameters())]


def _rank_compare() -> dict[str, Any]:
    mesh = cp_mesh()
    cases = {
        (strategy, overlap): (lambda s=strategy, o=overlap: _step(s, o, mesh))
        for strategy, overlap in COMBOS
    }
    return compare_under_link(cases, LATENCY)  # type: ignore[arg-type]


@pytest.mark.timeout(TIMEOUT)
def test_outputs_and_gradients_bitwise_identical_under_the_link():
    for rank_res in run_distributed(_rank_compare, 2, timeout=TIMEOUT):
        for combo, r in rank_res.items():
            assert r["count"] > 3 and all(r["equal"]), (combo, r["equal"])
            # the block's collectives (a2a / gather / reduce-scatter, both directions) ran
            # under the link
            assert r["collectives"] >= 6, (combo, r)
            assert r["modeled_s"] >= 6 * LATENCY, (combo, r)
