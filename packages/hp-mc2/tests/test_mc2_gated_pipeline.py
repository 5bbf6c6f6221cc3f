"""The gated block's pipelined ``torch`` schedule (one pipeline over the row chunks, forward and
backward): output and every gradient equal the reference twin (blocking collectives + plain
autograd) in float64 for chunk counts 1, 2, 3, 5 and more chunks than rows, with every subset
of operands needing a gradient; and the collectives really interleave (the first
reduce-scatter is launched before the last all-gather, forward and backward)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _mc2_testutil import rank_and_size, seeded

import hyper_parallel.mc2._chunked as chunked_mod
import hyper_parallel.mc2._pipeline as pipeline_mod
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.mc2 import default_chunks, gated_mlp, gated_mlp_reference

M, D, F = 5, 8, 3  # rows per rank, hidden, ffn features per rank
SHAPES = [(M, D), (F, D), (F, D), (D, F), (F,), (F,), (D,)]
NAMES = ["x", "wg", "wu", "wd", "bg", "bu", "bd"]
# which operands need a gradient: all, input only, weights only, down only, biases only
NEEDS = {
    "all": set(NAMES),
    "x": {"x"},
    "weights": {"wg", "wu", "wd"},
    "down": {"wd", "bd"},
    "gate_up_biases": {"bg", "bu"},
}


def _run(fn: Any, chunks: int, need: set[str]) -> list[torch.Tensor | None]:
    r = rank_and_size()[0]
    ops = [seeded(10 + i, *s, dtype=torch.float64) for i, s in enumerate(SHAPES)]
    ops[0] = seeded(30 + r, M, D, dtype=torch.float64)  # this rank's rows
    leaves = [o.clone().requires_grad_(n in need) for o, n in zip(ops, NAMES)]
    x, wg, wu, wd, bg, bu, bd = leaves
    y = fn(
        x, wg, wu, wd, act_fn=torch.nn.functional.silu, gate_bias=bg, up_bias=bu, down_bias=bd,
        impl="torch", chunks=chunks,
    )  # fmt: skip
    y.backward(seeded(20 + r, M, D, dtype=torch.float64))
    return [y.detach(), *(leaf.grad for leaf in leaves)]


def _errors(chunks: int, need: set[str]) -> list[float]:
    got, want = _run(gated_mlp, chunks, need), _run(gated_mlp_reference, chunks, need)
    out = []
    for a, b in zip(got, want):
        if a is None or b is None:
            out.append(0.0 if a is None and b is None else float("inf"))
        else:
            out.append((a - b).abs().max().item() / max(1.0, b.abs().max().item()))
    return out


def _launch_order(chunks: int) -> list[str]:
    """The sequence of collectives one forward + backward launches ("ag" / "rs")."""
    order: list[str] = []
    ag, rs = chunked_mod.all_gather_async, pipeline_mod.reduce_scatter_async

    def rec_ag(*a: Any) -> Any:
        order.append("ag")
        return ag(*a)

    def rec_rs(*a: Any) -> Any:
        order.append("rs")
        return rs(*a)

    chunked_mod.all_gather_async, pipeline_mod.reduce_scatter_async = rec_ag, rec_rs
    try:
        _run(gated_mlp, chunks, set(NAMES))
    finally:
        chunked_mod.all_gather_async, pipeline_mod.reduce_scatter_async = ag, rs
    return order


def _rank_body() -> dict[str, Any]:
    res: dict[str, Any] = {"errors": {}}
    for chunks in (1, 2, 3, 5, 9):
        for name, need in NEEDS.items():
            res["errors"][f"chunks={chunks}/{name}"] = _errors(chunks, need)
    res["order"] = _launch_order(3)
    res["world_size"] = dist.get_world_size()
    return res


@pytest.mark.timeout(120)
def test_pipelined_gated_schedule_equals_reference_and_interleaves():
    for res in run_distributed(_rank_body, 2, timeout=100):
        for case, errs in res["errors"].items():
            assert max(errs) <= 1e-12, (case, errs)
        order = res["order"]
        # forward: 3 gathers of X, 3 reduce-scatters of Y; backward: 3 of dY, 3 of X, 3 of dx
        assert order.count("ag") == 9 and order.count("rs") == 6, order
        fwd, bwd = order[:6], order[6:]
        assert fwd.index("rs") < max(i for i, o in enumerate(fwd) if o == "ag"), fwd
        assert bwd.index("rs") < max(i for i, o in enumerate(bwd) if o == "ag"), bwd


def test_default_chunks_rule_at_the_benchmark_shapes():
    # the benchmark's blocks, 2 ranks, 2048 local rows: gated (gate+up n = 2·1408), MLP up, down
    for k, n in ((1024, 2816), (1024, 2048), (2048, 1024)):
        assert default_chunks(2048, k, n, 2, "cpu") == 8
        assert default_chunks(2048, k, n, 2, "cuda") == default_chunks(2048, k, n, 2, "npu") == 4
    # each chunk keeps >= 64 rows and >= 2**27 flops; tiny shapes run unchunked
    assert default_chunks(256, 1024, 2816, 2, "cpu") == 4
    assert default_chunks(2048, 128, 256, 2, "cpu") == 2  # 2·2048·2·128·256 = 2·2**27 flops
    assert default_chunks(5, 8, 6, 2, "cpu") == 1
