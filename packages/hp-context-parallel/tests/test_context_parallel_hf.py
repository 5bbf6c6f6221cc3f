"""parallelize_mla on the stock Hugging Face DeepSeek-V3 and Kimi-Linear attention modules:
the context-parallel module equals the serial module on the full sequence (output, input
gradient, every parameter gradient), for both strategies, overlapped and blocking, at 2 ranks
and at 4 ranks on a mesh flattened from (cp, tp)."""

from __future__ import annotations

import pytest
import torch
from _cp_hf import COMBOS, VARIANTS, rank_parallel, serial_reference

from hyper_parallel.dtensor.testing import run_distributed

TIMEOUT = 240.0
_CACHE: dict[int, list] = {}
_REFS: dict[str, dict] = {}


def _parallel(world: int) -> list:
    if world not in _CACHE:
        _CACHE[world] = run_distributed(rank_parallel, world, COMBOS, timeout=TIMEOUT)
    return _CACHE[world]


def _reference(variant: str) -> dict:
    if variant not in _REFS:
        _REFS[variant] = serial_reference(variant)
    return _REFS[variant]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("variant,strategy,overlap", COMBOS)
def test_stock_hf_mla_context_parallel_equals_serial_with_every_gradient(
    world, variant, strategy, overlap
):
    ref = _reference(variant)
    per_rank = [r[(variant, strategy, overlap)] for r in _parallel(world)]
    tol = dict(rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(torch.cat([r["out"] for r in per_rank], 1), ref["out"], **tol)
    torch.testing.assert_close(torch.cat([r["dx"] for r in per_rank], 1), ref["dx"], **tol)
    assert set(per_rank[0]["grads"]) == set(ref["grads"])
    for name, g in ref["grads"].items():
        summed = sum(r["grads"][name] for r in per_rank)
        torch.testing.assert_close(summed, g, **tol, msg=lambda m, n=name: f"{n}: {m}")
    for r in per_rank:
        assert r["weights"] is None  # the forward returns (output, None)
        assert r["same_parameters"]


def test_the_variants_cover_both_rope_layouts_yarn_q_lora_and_nope():
    fams = {(v[0], v[1] is None, v[2], v[3]) for v in VARIANTS.values()}
    assert ("deepseek", True, True, False) in fams  # interleaved, no q LoRA
    assert any(f[0] == "deepseek" and not f[2] and f[3] for f in fams)  # rotate-half + yarn
    assert {f[1] for f in fams if f[0] == "kimi"} == {True, False}
