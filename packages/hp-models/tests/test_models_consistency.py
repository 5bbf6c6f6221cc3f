"""Consistency mode (here through ``HP_CHECK_CONSISTENCY=1``): ranks that disagree on an
option of ``parallelize_model``, the model's dtype, the length of their block or their packed
documents table (by value) raise the same InconsistentRanksError on every rank, naming the
field and the ranks, instead of hanging; with the checks off the same model computes the same
loss."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hyper_parallel.dtensor import init_device_mesh, unflatten
from hyper_parallel.dtensor.testing import (
    assert_same_inconsistency,
    caught_inconsistency,
    run_distributed,
)
from hyper_parallel.models import gather_sequence, parallelize_model, shard_batch
from hyper_parallel.models.testing import random_batch, tiny_model

_caught = caught_inconsistency


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
    dt = torch.float32 if rank else torch.float64
    res["dtype"] = _caught(lambda: parallelize_model(tiny_model("kimi", dtype=dt), mesh))
    model = parallelize_model(tiny_model("kimi"), mesh, grad_reduction="allreduce")
    local = shard_batch(random_batch(seq=16), mesh)
    shorter = {k: v[:, : 8 - 2 * rank] for k, v in local.items()}
    res["seq"] = _caught(lambda: model(**shorter))
    res["gather"] = _caught(lambda: gather_sequence(shorter["input_ids"], mesh))
    # packed documents: a table that differs on rank 1 (same length), caught before the
    # forward's first collective (the loss's token count)
    packed = {**local, "cu_seqlens": torch.tensor([0, 5 + 3 * rank, 16])}
    res["documents"] = _caught(lambda: model(**packed))
    with torch.no_grad():
        res["loss_on"] = model(**local).loss.item()
        os.environ.pop("HP_CHECK_CONSISTENCY")
        res["loss_off"] = model(**local).loss.item()
    return res


# case -> (field named in the error, the call named in it)
EXPECTED = {
    "strategy": ("mla_strategy", "parallelize_model"),
    "protocol": ("kda_protocol", "parallelize_model"),
    "dtype": ("param_dtypes", "parallelize_model"),
    "seq": ("arg_input_ids", "parallelized model forward"),
    "gather": ("x", "gather_sequence"),
    "documents": ("documents_cu_seqlens", "parallelized model forward"),
}


@pytest.mark.timeout(120)
def test_disagreeing_ranks_raise_on_every_rank_and_consistent_calls_still_run():
    results = run_distributed(_cases, 2, timeout=90)
    assert_same_inconsistency(results, EXPECTED)
    assert "ranks [0]: 'latent'; ranks [1]: 'expanded'" in results[0]["strategy"][1]
    assert "Tensor[2, 8]:int64" in results[0]["seq"][1]
    assert "Tensor[2, 6]:int64" in results[0]["seq"][1]
    assert "ranks [0]: (0, 5, 16); ranks [1]: (0, 8, 16)" in results[0]["documents"][1]
    for r in results:
        assert r["loss_on"] == r["loss_off"] == results[0]["loss_on"]
        assert 0 < r["loss_on"] < 10
