"""Consistency mode: ranks that disagree on a block length, a dtype, a chosen option (strategy,
overlap) or what a rewritten Hugging Face forward decides (its mask, its packed-documents
table) raise the same InconsistentRanksError on every rank, naming the field and the ranks,
instead of hanging; with the checks off (the default) the rewritten block runs as before."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _cp_hf import build as build_hf
from _cp_hf import call as call_hf
from _cp_hf import inputs as inputs_hf
from _cp_testutil import build, cp_mesh, inputs

from hyper_parallel.context_parallel import (
    hybrid_attention,
    parallelize_mla,
    shard_sequence,
    ulysses_seq_to_head,
)
from hyper_parallel.dtensor import consistency_checks
from hyper_parallel.dtensor.testing import assert_same_inconsistency, caught_inconsistency

_caught = caught_inconsistency


def _cases() -> dict[str, Any]:
    rank = dist.get_rank()
    mesh = cp_mesh()
    x, _ = inputs()
    block = shard_sequence(x, mesh)  # [2, 8, 24] float64
    res: dict[str, Any] = {}
    with consistency_checks():
        # a strategy / overlap chosen differently on rank 1 (parallelize_mla is local; the
        # forward compares)
        m = parallelize_mla(build(False), mesh, strategy="latent" if rank else "expanded")
        res["strategy"] = _caught(lambda: m(block))
        m = parallelize_mla(build(False), mesh, overlap=rank == 0)
        res["overlap"] = _caught(lambda: m(block))
        m = parallelize_mla(build(False), mesh)
        # a different block length, then a different dtype, on rank 1
        res["seq"] = _caught(lambda: m(block[:, : 8 - 2 * rank]))
        res["dtype"] = _caught(lambda: m(block.float() if rank else block))
        # the stock DeepSeek-V3 attention given a (plain causal) mask on rank 1 only
        hf = parallelize_mla(build_hf("deepseek_interleave"), mesh)
        xh, _ = inputs_hf()
        pos = torch.arange(8 * rank, 8 * rank + 8)
        causal = torch.ones(8, 8, dtype=torch.bool).tril()[None, None]
        mask = causal if rank else None
        res["hf_mask"] = _caught(
            lambda: call_hf(hf, "deepseek_interleave", shard_sequence(xh, mesh), pos,
                            attention_mask=mask)
        )  # fmt: skip
        # packed documents: a cu_seqlens table that differs on rank 1 (same length)
        table = torch.tensor([0, 5 + 3 * rank, 16])
        res["hf_table"] = _caught(
            lambda: call_hf(hf, "deepseek_interleave", shard_sequence(xh[:1], mesh), pos,
                            cu_seqlens=table)
        )  # fmt: skip
        # a user collective: a different sequence length on rank 1
        t = torch.zeros(2, 4 + 2 * rank, 8, 3)
        res["a2a"] = _caught(lambda: ulysses_seq_to_head(t, 1, 2, mesh))
        # consistent calls pass the checks
        res["consistent"] = tuple(m(block).shape)
    # checks off (the default): the rewritten block equals the serial one on its rows
    serial = build(False)(x)
    got = m(block)
    rows = slice(8 * rank, 8 * rank + 8)
    res["off_err"] = (got - serial[:, rows]).abs().max().item()
    return res


# case -> (field named in the error, the call named in it)
EXPECTED = {
    "strategy": ("strategy", "context-parallel MultiHeadLatentAttention forward"),
    "overlap": ("overlap", "context-parallel MultiHeadLatentAttention forward"),
    "seq": ("hidden_states", "context-parallel MultiHeadLatentAttention forward"),
    "dtype": ("hidden_states", "context-parallel MultiHeadLatentAttention forward"),
    "hf_mask": ("attention_mask", "context-parallel DeepseekV3Attention forward"),
    "hf_table": ("cu_seqlens", "context-parallel DeepseekV3Attention forward"),
    "a2a": ("x", "a2a:seq_to_head"),
}


@pytest.mark.timeout(120)
def test_disagreeing_ranks_raise_on_every_rank_and_consistent_calls_still_run():
    from hyper_parallel.dtensor.testing import run_distributed

    os.environ.pop("HP_CHECK_CONSISTENCY", None)
    results = run_distributed(_cases, 2, timeout=90)
    assert_same_inconsistency(results, EXPECTED)
    assert "ranks [0]: 'expanded'; ranks [1]: 'latent'" in results[0]["strategy"][1]
    assert "Tensor[2, 8, 24]" in results[0]["seq"][1] and "Tensor[2, 6, 24]" in results[0]["seq"][1]
    assert "float32" in results[0]["dtype"][1] and "float64" in results[0]["dtype"][1]
    assert "ranks [0]: None; ranks [1]: Tensor[1, 1, 8, 8]:bool" in results[0]["hf_mask"][1]
    assert "ranks [0]: ((0, 5, 16)); ranks [1]: ((0, 8, 16))" in results[0]["hf_table"][1]
    for r in results:
        assert r["consistent"] == (2, 8, 24)
        assert r["off_err"] < 1e-10


def _hybrid_case() -> tuple[str, str] | None:
    rank = dist.get_rank()
    mesh = cp_mesh()
    s = 2 if rank != 3 else 3  # rank 3 holds a longer block
    q = torch.zeros(1, s, 4, 3)

    def attn(q, k, v, mask):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    from hyper_parallel.dtensor import consistency

    comparisons: list[str] = []
    gather = consistency._gather_signatures

    def counted(mine: Any, group: Any, size: int) -> Any:
        comparisons.append(sorted(mine)[0])
        return gather(mine, group, size)

    consistency._gather_signatures = counted  # type: ignore[assignment]
    try:
        with consistency_checks():
            shape = _caught(lambda: hybrid_attention(attn, q, q, q, mesh, 2))
            # a degree only one rank gets wrong: its own validation alone would leave the
            # other ranks waiting in the first all-to-all
            degree = _caught(lambda: hybrid_attention(attn, q[:, :2], q[:, :2], q[:, :2], mesh,
                                                      3 if rank == 1 else 2))  # fmt: skip
            comparisons.clear()
            x = torch.ones(1, 2, 4, 3, dtype=torch.float64)
            hybrid_attention(attn, x, x, x, mesh, 2)  # agrees: compared once, not per exchange
    finally:
        consistency._gather_signatures = gather  # type: ignore[assignment]
    return shape, degree, len(comparisons)


@pytest.mark.timeout(120)
def test_hybrid_attention_ranks_that_disagree_raise_on_every_rank():
    from hyper_parallel.dtensor.testing import run_distributed

    os.environ.pop("HP_CHECK_CONSISTENCY", None)
    results = run_distributed(_hybrid_case, 4, timeout=90)
    assert all(r == results[0] for r in results), results
    shape, degree, comparisons = results[0]
    assert comparisons == 1  # the 3 all-to-alls, 2 all-gathers and 1 inverse inside: none
    field, msg = degree
    assert field == "ulysses_degree" and "ranks [1]: 3" in msg, msg
    field, msg = shape
    assert field == "k", msg  # q, k and v all differ: the first in name order is reported
    assert msg.startswith("hybrid_attention") and "ranks [0, 1, 2]: Tensor[1, 2, 4, 3]" in msg
    assert "ranks [3]: Tensor[1, 3, 4, 3]" in msg
