"""Every rejected input, in one place. Each raises a clear error on every rank before any
communication (the collective helpers and the process group count no traffic), and the group
still works afterwards."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from _mc2_testutil import group_still_works, max_err, rank_and_size, seeded
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

import hyper_parallel.mc2._collectives as collectives
from hyper_parallel.dtensor import init_device_mesh
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.mc2 import (
    MC2ColwiseParallel,
    MC2Linear,
    MC2RowwiseParallel,
    all_gather_matmul,
    matmul_reduce_scatter,
)

TIMEOUT = 90.0


def _mesh():
    return init_device_mesh("cpu", (rank_and_size()[1],))


def _row_module(seq_dim: int = 1) -> nn.Module:
    torch.manual_seed(0)
    return parallelize_module(nn.Linear(8, 6), _mesh(), MC2RowwiseParallel(seq_dim))


def _col_module(seq_dim: int = 1) -> nn.Module:
    torch.manual_seed(0)
    return parallelize_module(nn.Linear(6, 8), _mesh(), MC2ColwiseParallel(seq_dim))


f32, f64 = torch.float32, torch.float64
# name -> (builder of the module under test or None, the call that must fail, expected
# exception type, phrase of its message). Building a module communicates (distribute_tensor),
# so it runs before the traffic count of the failing call starts.
CASES: dict[str, tuple[Callable | None, Callable, str, str]] = {
    "non_linear_module": (
        None,
        lambda _: parallelize_module(nn.Conv1d(4, 4, 1), _mesh(), MC2ColwiseParallel()),
        "TypeError",
        "only applies to nn.Linear",
    ),
    "from_linear_non_linear": (
        None,
        lambda _: MC2Linear.from_linear(nn.Embedding(4, 4)),
        "TypeError",
        "needs an nn.Linear",
    ),
    "sequence_dim_not_int": (None, lambda _: MC2ColwiseParallel("1"), "TypeError", "sequence_dim"),
    "sequence_dim_out_of_range": (
        lambda: _col_module(3),
        lambda m: m(torch.ones(2, 3, 6)),
        "ValueError",
        "sequence_dim=3 is out of range for a 3-D input",
    ),
    "sequence_dim_is_feature_dim": (
        lambda: _col_module(2),
        lambda m: m(torch.ones(2, 3, 6)),
        "ValueError",
        "sequence_dim=2 is out of range for a 3-D input",
    ),
    "sequence_not_divisible_module": (
        _row_module,
        lambda m: m(torch.ones(2, 3, 8 // rank_and_size()[1])),
        "ValueError",
        "sequence length 3 (dim 1) is not divisible",
    ),
    "rows_not_divisible_functional": (
        None,
        lambda _: matmul_reduce_scatter(
            torch.ones(2 * rank_and_size()[1] + 1, 4), torch.ones(3, 4)
        ),
        "ValueError",
        "not divisible by the group size",
    ),
    "inner_dims_differ_functional": (
        None,
        lambda _: all_gather_matmul(torch.ones(4, 8), torch.ones(6, 7)),
        "ValueError",
        "inner dims differ",
    ),
    "inner_dims_differ_module": (
        _col_module,
        lambda m: m(torch.ones(2, 3, 5)),
        "ValueError",
        "input has 5 features",
    ),
    "bias_wrong_size_column": (
        None,
        lambda _: all_gather_matmul(torch.ones(4, 8), torch.ones(6, 8), bias=torch.ones(12)),
        "ValueError",
        "bias must be the local shard [n_local] = (6,)",
    ),
    "bias_wrong_size_row": (
        None,
        lambda _: matmul_reduce_scatter(torch.ones(4, 8), torch.ones(6, 8), bias=torch.ones(3)),
        "ValueError",
        "bias must be the full, replicated [n] = (6,)",
    ),
    "dtype_mix_weight": (
        None,
        lambda _: all_gather_matmul(torch.ones(4, 8), torch.ones(6, 8, dtype=f64)),
        "TypeError",
        "x is fp32 but weight is fp64",
    ),
    "dtype_mix_bias": (
        None,
        lambda _: matmul_reduce_scatter(
            torch.ones(4, 8), torch.ones(6, 8), bias=torch.ones(6, dtype=torch.bfloat16)
        ),
        "TypeError",
        "x is fp32 but bias is bf16",
    ),
    "dtype_mix_module": (
        _col_module,
        lambda m: m(torch.ones(2, 3, 6, dtype=torch.bfloat16)),
        "TypeError",
        "input is bf16 but the weight/bias are fp32",
    ),
    "x_not_2d": (
        None,
        lambda _: all_gather_matmul(torch.ones(2, 4, 8), torch.ones(6, 8)),
        "ValueError",
        "x must be 2-D",
    ),
    "unknown_backend": (
        None,
        lambda _: all_gather_matmul(torch.ones(4, 8), torch.ones(6, 8), backend="cuda"),
        "ValueError",
        "backend must be one of",
    ),
    "forced_npu_on_cpu": (
        None,
        lambda _: all_gather_matmul(torch.ones(4, 8), torch.ones(6, 8), backend="npu"),
        "ValueError",
        "backend='npu' cannot run all_gather_matmul: tensors are on cpu, not npu",
    ),
    "zero_chunks": (
        None,
        lambda _: matmul_reduce_scatter(torch.ones(4, 8), torch.ones(6, 8), chunks=0),
        "ValueError",
        "chunks must be a positive int",
    ),
}


def _reject_all(names: list[str]) -> dict:
    traffic = {"n": 0}

    def counting(fn):
        def wrapped(*args, **kwargs):
            traffic["n"] += 1
            return fn(*args, **kwargs)

        return wrapped

    collectives.all_gather_single = counting(collectives.all_gather_single)
    collectives.reduce_scatter_single = counting(collectives.reduce_scatter_single)
    outcome = {}
    for name in names:
        build, call, _, _ = CASES[name]
        module = build() if build is not None else None
        before = traffic["n"]
        try:
            call(module)
            outcome[name] = ("no error", "", 0)
        except Exception as exc:
            outcome[name] = (type(exc).__name__, str(exc), traffic["n"] - before)
    # the group still works: a collective and a real overlapped call
    r, ws = rank_and_size()
    X, W = seeded(1, 4 * ws, 8), seeded(2, 6 * ws, 8)
    y = all_gather_matmul(X[4 * r : 4 * r + 4], W[6 * r : 6 * r + 6], None, chunks=2)
    ok = group_still_works() and max_err(y, X.double() @ W[6 * r : 6 * r + 6].double().t()) < 1e-5
    return {"outcome": outcome, "group_ok": ok, "traffic_total": traffic["n"]}


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_bad_input_raises_on_every_rank_before_communicating(world_size):
    names = list(CASES)
    results = run_distributed(_reject_all, world_size, names, timeout=TIMEOUT)
    for rank, res in enumerate(results):
        for name in names:
            _, _, want_type, phrase = CASES[name]
            got_type, msg, traffic = res["outcome"][name]
            assert got_type == want_type, (rank, name, got_type, msg)
            assert phrase in msg, (rank, name, msg)
            assert traffic == 0, (rank, name, "communicated before raising")
        assert res["group_ok"], rank
        # the successful call afterwards did communicate through the counted helpers
        assert res["traffic_total"] > 0
    assert all(r["outcome"] == results[0]["outcome"] for r in results)
