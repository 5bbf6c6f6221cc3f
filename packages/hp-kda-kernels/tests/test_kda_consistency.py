"""Consistency mode: ranks that disagree on a dtype, a size, a chosen option (protocol, halo
width) or a packed-documents table (``cu_seqlens``, kernel and layer) raise the same
InconsistentRanksError on every rank, naming the field and the ranks, instead of hanging;
per-rank chunk lengths (uneven, empty) stay allowed; with the checks off (the default) the
layer runs as before."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _kda_hf import kda_layer
from _kda_testutil import kda_inputs

from hyper_parallel.dtensor import consistency_checks, init_device_mesh
from hyper_parallel.dtensor.testing import (
    assert_same_inconsistency,
    caught_inconsistency,
    run_distributed,
)
from hyper_parallel.kda import (
    causal_conv_halo,
    kda_context_parallel,
    naive_recurrent_kda,
    parallelize_kda,
)

B, H, K, V = 1, 2, 16, 16
SPLIT = (5, 0)  # uneven chunks: rank 1's is empty


_caught = caught_inconsistency


def _block(x: torch.Tensor, rank: int) -> torch.Tensor:
    lo = sum(SPLIT[:rank])
    return x[:, lo : lo + SPLIT[rank]]


def _uneven_error(rank: int, mesh: Any) -> float:
    """kda_context_parallel on chunks of lengths SPLIT vs the serial reference (float64)."""
    q, k, v, g, beta, _ = kda_inputs(B, sum(SPLIT), H, K, V, seed=1)
    o, _ = kda_context_parallel(*(_block(t, rank) for t in (q, k, v, g, beta)), mesh)
    ref, _ = naive_recurrent_kda(q, k, v, g, beta)
    return (o - _block(ref, rank)).abs().max().item() if o.numel() else 0.0


def _cases() -> dict[str, Any]:
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    res: dict[str, Any] = {}
    q, k, v, g, beta, _ = kda_inputs(B, 4, H, K, V)
    with consistency_checks():
        # chunk lengths may differ (not compared): runs and is right
        res["uneven_on"] = _uneven_error(rank, mesh)
        dt = torch.float32 if rank else torch.float64
        res["dtype"] = _caught(
            lambda: kda_context_parallel(*(t.to(dt) for t in (q, k, v, g, beta)), mesh)
        )
        res["protocol"] = _caught(
            lambda: kda_context_parallel(
                q, k, v, g, beta, mesh, protocol="allgather" if rank else "p2p"
            )
        )
        h = 1 + rank  # a different head count on rank 1
        res["heads"] = _caught(
            lambda: kda_context_parallel(
                q[:, :, :h], k[:, :, :h], v[:, :, :h], g[:, :, :h], beta[:, :, :h], mesh
            )
        )
        res["halo_width"] = _caught(lambda: causal_conv_halo(q, 3 + rank, mesh))
        # the stock layer: a protocol chosen differently on rank 1 is caught at parallelize
        res["parallelize_protocol"] = _caught(
            lambda: parallelize_kda(kda_layer(), mesh, protocol="p2p" if rank else "auto")
        )
        layer = parallelize_kda(kda_layer(), mesh)
        x = torch.randn(1, 3 + 2 * rank, 32, dtype=torch.float64)
        res["layer_uneven_on"] = tuple(layer(x).shape)  # block lengths may differ
        res["layer_dtype"] = _caught(lambda: layer(x.float() if rank else x))
        # packed documents: a cu_seqlens table that differs on rank 1 (same length)
        table = torch.tensor([0, 3 + rank, 8])
        res["table"] = _caught(
            lambda: kda_context_parallel(q, k, v, g, beta, mesh, cu_seqlens=table)
        )
        x4 = torch.randn(1, 4, 32, dtype=torch.float64)
        res["layer_table"] = _caught(lambda: layer(x4, cu_seqlens=table))
    # checks off (the default): the same uneven run is right
    res["uneven_off"] = _uneven_error(rank, mesh)
    return res


# case -> (field named in the error, the call named in it)
EXPECTED = {
    "dtype": ("dtypes", "kda_context_parallel"),
    "protocol": ("protocol", "kda_context_parallel"),
    "heads": ("dims_BHKV", "kda_context_parallel"),
    "halo_width": ("width", "causal_conv_halo"),
    "parallelize_protocol": ("protocol", "parallelize_kda"),
    "layer_dtype": ("dtype", "parallelize_kda (KimiLinearDeltaAttention) forward"),
    # the table is part of the entry point's one signature (the placement compares nothing)
    "table": ("cu_seqlens", "kda_context_parallel"),
    "layer_table": ("cu_seqlens", "parallelize_kda (KimiLinearDeltaAttention) forward"),
}


@pytest.mark.timeout(120)
def test_disagreeing_ranks_raise_on_every_rank_and_uneven_chunks_still_run():
    os.environ.pop("HP_CHECK_CONSISTENCY", None)
    results = run_distributed(_cases, 2, timeout=90)
    assert_same_inconsistency(results, EXPECTED)
    assert "ranks [0]: 'p2p'; ranks [1]: 'allgather'" in results[0]["protocol"][1]
    assert "ranks [0]: 3; ranks [1]: 4" in results[0]["halo_width"][1]
    assert "(1, 1, 16, 16)" in results[0]["heads"][1] and "(1, 2, 16, 16)" in results[0]["heads"][1]
    assert "ranks [0]: (0, 3, 8); ranks [1]: (0, 4, 8)" in results[0]["layer_table"][1]
    assert results[0]["layer_uneven_on"] == (1, 3, 32)
    assert results[1]["layer_uneven_on"] == (1, 5, 32)
    for r in results:
        assert r["uneven_on"] < 1e-5 and r["uneven_off"] < 1e-5
