"""Consistency mode: ranks that disagree on a shape, a dtype or a chosen option raise the same
InconsistentRanksError on every rank (naming the field and the ranks) instead of hanging;
with the checks off (the default) the layers run as before."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from _mc2_testutil import column_reference, max_err, seeded
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

from hyper_parallel.dtensor import consistency_checks, init_device_mesh
from hyper_parallel.dtensor.testing import (
    assert_same_inconsistency,
    caught_inconsistency,
    run_distributed,
)
from hyper_parallel.mc2 import (
    MC2ColwiseParallel,
    MC2GatedMLPParallel,
    all_gather_matmul,
    gated_mlp,
    matmul_reduce_scatter,
)

TIMEOUT = 60.0
D, F = 8, 8  # per-rank feature sizes (F: the local shard)


class _Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(D, 2 * F, bias=False)
        self.up_proj = nn.Linear(D, 2 * F, bias=False)
        self.down_proj = nn.Linear(2 * F, D, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


_caught = caught_inconsistency


def _cases() -> dict[str, Any]:
    rank = torch.distributed.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    w = seeded(1, F, D)
    res: dict[str, Any] = {}
    with consistency_checks():
        # a different sequence length (rows) on rank 1
        x = seeded(2, 4 + 2 * rank, D)
        res["rows"] = _caught(lambda: all_gather_matmul(x, w))
        # a different dtype on rank 1 (x and weight together: a dtype-consistent rank)
        dt = torch.float64 if rank else torch.float32
        xr, wr = seeded(3, 4, D, dtype=dt), seeded(4, D, D, dtype=dt)
        res["dtype"] = _caught(lambda: matmul_reduce_scatter(xr, wr))
        # a different chunk count on rank 1
        x4 = seeded(5, 4, D)
        res["chunks"] = _caught(lambda: all_gather_matmul(x4, w, chunks=1 + rank))
        gw, uw, dw = seeded(6, F, D), seeded(7, F, D), seeded(8, D, F)
        res["gated_chunks"] = _caught(
            lambda: gated_mlp(x4, gw, uw, dw, act_fn=torch.sigmoid, chunks=2 - rank)
        )
        # styles: an option that differs on one rank is caught where the style is applied
        lin = nn.Linear(D, 2 * F)
        res["style"] = _caught(
            lambda: parallelize_module(lin, mesh, MC2ColwiseParallel(chunks=None if rank else 2))
        )
        g = _Gated()
        res["gated_style"] = _caught(
            lambda: parallelize_module(
                g, mesh, MC2GatedMLPParallel(impl="torch" if rank else "auto")
            )
        )
        # the parallelized modules' forwards: a different sequence length on rank 1
        col = parallelize_module(nn.Linear(D, 2 * F), mesh, MC2ColwiseParallel())
        xb = seeded(9, 2, 3 + rank, D)
        res["linear_seq"] = _caught(lambda: col(xb))
        gm = parallelize_module(_Gated(), mesh, MC2GatedMLPParallel())
        res["gated_seq"] = _caught(lambda: gm(xb))
        # consistent input passes the checks and computes as usual
        ok = gm(seeded(10, 2, 3, D))
        res["consistent_shape"] = tuple(ok.shape)
    # checks off (the default): the layer runs normally, no extra collective
    X, W, dY = seeded(11, 8, D), seeded(12, 2 * F, D), seeded(13, 8, 2 * F)
    rows, cols = slice(4 * rank, 4 * rank + 4), slice(F * rank, F * rank + F)
    xs, wl = X[rows].clone().requires_grad_(), W[cols].clone().requires_grad_()
    y = all_gather_matmul(xs, wl, chunks=2)
    y.backward(dY[:, cols])
    ref_y, ref_dx, ref_dw, _ = column_reference(X, W, None, dY)
    errs = (
        max_err(y, ref_y[:, cols]),
        max_err(xs.grad, ref_dx[rows]),
        max_err(wl.grad, ref_dw[cols]),
    )
    res["off_err"] = max(errs)
    return res


# case -> (field named in the error, the call named in it)
EXPECTED = {
    "rows": ("x", "all_gather_matmul"),
    "dtype": ("weight", "matmul_reduce_scatter"),
    "chunks": ("chunks", "all_gather_matmul"),
    "gated_chunks": ("chunks", "gated_mlp"),
    "style": ("style", "MC2ColwiseParallel"),
    "gated_style": ("style", "MC2GatedMLPParallel"),
    "linear_seq": ("input", "MC2Linear (column)"),
    "gated_seq": ("input", "MC2GatedMLPParallel (_Gated)"),
}


@pytest.mark.timeout(90)
def test_disagreeing_ranks_raise_on_every_rank_and_consistent_calls_still_run():
    os.environ.pop("HP_CHECK_CONSISTENCY", None)
    results = run_distributed(_cases, 2, timeout=TIMEOUT)
    assert_same_inconsistency(results, EXPECTED)
    assert "float32" in results[0]["dtype"][1] and "float64" in results[0]["dtype"][1]
    assert "Tensor[4, 8]" in results[0]["rows"][1] and "Tensor[6, 8]" in results[0]["rows"][1]
    assert "ranks [0]: 2; ranks [1]: 1" in results[0]["gated_chunks"][1]
    for r in results:
        assert r["consistent_shape"] == (2, 3, D)
        assert r["off_err"] < 1e-5


def _count_checks() -> dict[str, Any]:
    """Per public call with the checks on: how many signature comparisons ran (each is one
    pair of all-gathers), counted by wrapping the real comparison."""
    from torch.distributed.tensor import DTensor, Replicate

    import hyper_parallel.dtensor.consistency as consistency

    rank = torch.distributed.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    real, calls = consistency._gather_signatures, []

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    consistency._gather_signatures = counting  # type: ignore[assignment]
    counts: dict[str, Any] = {}

    def count(name: str, fn: Any) -> None:
        calls.clear()
        fn()
        counts[name] = len(calls)

    try:
        with consistency_checks():
            x, w = seeded(1, 4, D), seeded(2, F, D)
            count("all_gather_matmul", lambda: all_gather_matmul(x, w))
            count("matmul_reduce_scatter", lambda: matmul_reduce_scatter(seeded(3, 4, D), w))
            gw, uw, dw = seeded(6, F, D), seeded(7, F, D), seeded(8, D, F)
            count("gated_mlp", lambda: gated_mlp(x, gw, uw, dw, act_fn=torch.sigmoid))
            lin = nn.Linear(D, 2 * F)
            count("style", lambda: parallelize_module(lin, mesh, MC2ColwiseParallel()))
            xb = seeded(9, 2, 3, D)
            count("linear_forward", lambda: lin(xb))
            X = seeded(10, 2, 6, D)
            rep = DTensor.from_local(X, mesh, [Replicate()], run_check=False)
            count("linear_dtensor_forward", lambda: lin(rep))  # redistributes first
            g = _Gated()
            count("gated_style", lambda: parallelize_module(g, mesh, MC2GatedMLPParallel()))
            count("gated_forward", lambda: g(xb))
            # a replicated DTensor input whose global shapes differ: caught before the
            # redistribution (the first collective)
            bad = DTensor.from_local(seeded(11, 2, 6 + 2 * rank, D), mesh, [Replicate()],
                                     run_check=False)  # fmt: skip
            counts["dtensor_caught"] = _caught(lambda: lin(bad))
        # checks off: no comparison at all
        count("off", lambda: lin(xb))
    finally:
        consistency._gather_signatures = real  # type: ignore[assignment]
    return counts


@pytest.mark.timeout(90)
def test_each_public_call_is_checked_once_even_when_it_calls_another_entry_point():
    os.environ.pop("HP_CHECK_CONSISTENCY", None)
    results = run_distributed(_count_checks, 2, timeout=TIMEOUT)
    assert_same_inconsistency(results, {"dtensor_caught": ("input", "MC2Linear (column)")})
    for r in results:
        caught = r.pop("dtensor_caught")
        assert "DTensor[2, 6, 8]" in caught[1] and "DTensor[2, 8, 8]" in caught[1]
        assert r.pop("off") == 0
        assert r == dict.fromkeys(r, 1) and len(r) == 8, r
