"""Consistency mode (here through ``HP_CHECK_CONSISTENCY=1``): ranks that disagree on an
option of ``parallelize_model``, the model's dtype, the length of their block, their packed
documents table (by value), the autocast dtype of the forward or the parameters given to
``sync_gradients`` raise the same InconsistentRanksError on every rank, naming the field and the
ranks, instead of hanging; ``parallelize_model`` compares once (the layers' entry points inside
it do not compare again); with the checks off the same model computes the same loss."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hyper_parallel.dtensor import consistency, init_device_mesh, unflatten
from hyper_parallel.dtensor.testing import (
    assert_same_inconsistency,
    caught_inconsistency,
    run_distributed,
)
from hyper_parallel.models import gather_sequence, parallelize_model, shard_batch, sync_gradients
from hyper_parallel.models.testing import random_batch, tiny_model

_caught = caught_inconsistency


def _bf16_if(enabled: bool, fn: Any) -> Any:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
        return fn()


def _cases() -> dict[str, Any]:
    os.environ["HP_CHECK_CONSISTENCY"] = "1"
    rank = dist.get_rank()
    world = init_device_mesh("cpu", (2,), mesh_dim_names=("world",))
    mesh = unflatten(world, "world", (1, 2), ("cp", "tp"))
    res: dict[str, Any] = {}
    res["strategy"] = _caught(
        lambda: parallelize_model(
            tiny_model("kimi"), mesh, mla_strategy="expanded" if rank else "latent"
        )
    )
    res["protocol"] = _caught(
        lambda: parallelize_model(tiny_model("kimi"), mesh, kda_protocol="p2p" if rank else "auto")
    )
    res["moe_chunks"] = _caught(
        lambda: parallelize_model(tiny_model("kimi"), mesh, moe_chunks=2 if rank else "auto")
    )
    dt = torch.float32 if rank else torch.float64
    res["dtype"] = _caught(lambda: parallelize_model(tiny_model("kimi", dtype=dt), mesh))
    # one comparison per parallelize_model: the layers' entry points inside do not re-compare
    gathers: list[dict[str, str]] = []
    real = consistency._gather_signatures

    def counted(mine: dict[str, str], *rest: Any) -> Any:
        gathers.append(mine)
        return real(mine, *rest)

    consistency._gather_signatures = counted
    try:
        model = parallelize_model(tiny_model("kimi"), mesh, grad_reduction="allreduce")
    finally:
        consistency._gather_signatures = real
    res["comparisons"] = [sorted(fields) for fields in gathers]
    local = shard_batch(random_batch(seq=16), mesh)
    shorter = {k: v[:, : 8 - 2 * rank] for k, v in local.items()}
    res["seq"] = _caught(lambda: model(**shorter))
    res["gather"] = _caught(lambda: gather_sequence(shorter["input_ids"], mesh))
    # packed documents: a table that differs on rank 1 (same length), caught before the
    # forward's first collective (the loss's token count)
    packed = {**local, "cu_seqlens": torch.tensor([0, 5 + 3 * rank, 16])}
    res["documents"] = _caught(lambda: model(**packed))
    res["autocast"] = _caught(lambda: _bf16_if(rank == 1, lambda: model(**local)))
    # sync_gradients: rank 1 trains one parameter fewer
    model(**local).loss.backward()
    if rank:
        model.lm_head.weight.requires_grad_(False)
    res["sync"] = _caught(lambda: sync_gradients(model))
    model.lm_head.weight.requires_grad_(True)
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        res["loss_on"] = model(**local).loss.item()
        os.environ.pop("HP_CHECK_CONSISTENCY")
        res["loss_off"] = model(**local).loss.item()
    return res


# case -> (field named in the error, the call named in it)
EXPECTED = {
    "strategy": ("mla_strategy", "parallelize_model"),
    "protocol": ("kda_protocol", "parallelize_model"),
    "moe_chunks": ("moe_chunks", "parallelize_model"),
    "dtype": ("param_dtypes", "parallelize_model"),
    "seq": ("arg_input_ids", "parallelized model forward"),
    "gather": ("x", "gather_sequence"),
    "documents": ("documents_cu_seqlens", "parallelized model forward"),
    "autocast": ("autocast", "parallelized model forward"),
    "sync": ("params", "sync_gradients"),
}


@pytest.mark.timeout(120)
def test_disagreeing_ranks_raise_on_every_rank_and_consistent_calls_still_run():
    results = run_distributed(_cases, 2, timeout=90)
    assert_same_inconsistency(results, EXPECTED)
    assert "ranks [0]: 'latent'; ranks [1]: 'expanded'" in results[0]["strategy"][1]
    assert "Tensor[2, 8]:int64" in results[0]["seq"][1]
    assert "Tensor[2, 6]:int64" in results[0]["seq"][1]
    assert "ranks [0]: (0, 5, 16); ranks [1]: (0, 8, 16)" in results[0]["documents"][1]
    assert "ranks [0]: 'off'; ranks [1]: 'bfloat16'" in results[0]["autocast"][1]
    for r in results:  # parallelize_model compared once, with its own fields only
        assert len(r["comparisons"]) == 1, r["comparisons"]
        assert "mla_strategy" in r["comparisons"][0] and "roles" in r["comparisons"][0]
    for r in results:
        assert r["loss_on"] == r["loss_off"] == results[0]["loss_on"]
        assert 0 < r["loss_on"] < 10
