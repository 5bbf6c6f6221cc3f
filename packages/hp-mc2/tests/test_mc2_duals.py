"""Both duals, every implementation and chunk count, against a float64 single-process reference:
outputs, dX, dW and db, at 2 and 4 gloo ranks."""

from __future__ import annotations

import pytest
from _mc2_testutil import column_reference, max_err, rank_and_size, seeded

from hyper_parallel.dtensor.recorder import record_events
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.mc2 import (
    all_gather_matmul,
    all_gather_matmul_reference,
    matmul_reduce_scatter,
    matmul_reduce_scatter_reference,
)

TIMEOUT = 90.0
# (name, chunks): chunk counts cover 1 (no overlap), even and uneven splits, more chunks than
# rows (clamped) and the shape-chosen default; "reference" is the blocking reference twin.
VARIANTS = [
    ("torch", 1),
    ("torch", 2),
    ("torch", 3),
    ("torch", 9),
    ("torch", None),
    ("reference", None),
]
TOL = 1e-5


def _column_errors(with_bias: bool, m: int, k: int, n_local: int) -> dict[str, dict[str, float]]:
    r, ws = rank_and_size()
    X, W, B = seeded(1, ws * m, k), seeded(2, ws * n_local, k), seeded(3, ws * n_local)
    dY = seeded(4, ws * m, ws * n_local)
    Y, dX, dW, dB = column_reference(X, W, B if with_bias else None, dY)
    rows, cols = slice(r * m, (r + 1) * m), slice(r * n_local, (r + 1) * n_local)
    errors = {}
    for impl, chunks in VARIANTS:
        x = X[rows].clone().requires_grad_()
        w = W[cols].clone().requires_grad_()
        b = B[cols].clone().requires_grad_() if with_bias else None
        fn = all_gather_matmul_reference if impl == "reference" else all_gather_matmul
        y = fn(x, w, None, bias=b, impl="torch", chunks=chunks)
        y.backward(dY[:, cols])
        errors[f"{impl}/chunks={chunks}"] = {
            "y": max_err(y, Y[:, cols]),
            "dx": max_err(x.grad, dX[rows]),
            "dw": max_err(w.grad, dW[cols]),
            "db": max_err(b.grad, dB[cols]) if with_bias else 0.0,
        }
    return errors


def _row_errors(with_bias: bool, m_out: int, k_local: int, n: int) -> dict[str, dict[str, float]]:
    r, ws = rank_and_size()
    X, W, B = seeded(1, ws * m_out, ws * k_local), seeded(2, n, ws * k_local), seeded(3, n)
    dY = seeded(4, ws * m_out, n)
    Y, dX, dW, dB = column_reference(X, W, B if with_bias else None, dY)
    rows, cols = slice(r * m_out, (r + 1) * m_out), slice(r * k_local, (r + 1) * k_local)
    errors = {}
    for impl, chunks in VARIANTS:
        x = X[:, cols].clone().requires_grad_()
        w = W[:, cols].clone().requires_grad_()
        b = B.clone().requires_grad_() if with_bias else None
        fn = matmul_reduce_scatter_reference if impl == "reference" else matmul_reduce_scatter
        y = fn(x, w, None, bias=b, impl="torch", chunks=chunks)
        y.backward(dY[rows])
        errors[f"{impl}/chunks={chunks}"] = {
            "y": max_err(y, Y[rows]),
            "dx": max_err(x.grad, dX[:, cols]),
            "dw": max_err(w.grad, dW[:, cols]),
            "db": max_err(b.grad, dB) if with_bias else 0.0,
        }
    return errors


def _assert_all_small(results: list[dict[str, dict[str, float]]]) -> None:
    bad = {
        (rank, variant, what): err
        for rank, per_rank in enumerate(results)
        for variant, errs in per_rank.items()
        for what, err in errs.items()
        if not err <= TOL
    }
    assert not bad, f"errors above {TOL}: {bad}"
    assert len(results[0]) == len(VARIANTS)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
def test_all_gather_matmul_matches_float64_reference_for_every_chunk_count(world_size, with_bias):
    results = run_distributed(_column_errors, world_size, with_bias, 7, 12, 5, timeout=TIMEOUT)
    _assert_all_small(results)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
def test_matmul_reduce_scatter_matches_float64_reference_for_every_chunk_count(
    world_size, with_bias
):
    results = run_distributed(_row_errors, world_size, with_bias, 7, 6, 10, timeout=TIMEOUT)
    _assert_all_small(results)


def _grads_only_where_needed() -> list[bool]:
    """Only x or only weight requiring grad still gives correct partial gradients; the
    collectives are tagged forward / backward by the phase they start in."""
    r, ws = rank_and_size()
    X, W, dY = seeded(1, ws * 4, 8), seeded(2, ws * 3, 8), seeded(4, ws * 4, ws * 3)
    _, dX, dW, _ = column_reference(X, W, None, dY)
    rows, cols = slice(r * 4, (r + 1) * 4), slice(r * 3, (r + 1) * 3)
    ok = []
    for x_grad in (True, False):
        x = X[rows].clone().requires_grad_(x_grad)
        w = W[cols].clone().requires_grad_(not x_grad)
        with record_events() as rec:
            y = all_gather_matmul(x, w, None, impl="torch", chunks=2)
            forward = len(rec.events)
            y.backward(dY[:, cols])
        ok.append(max_err(x.grad, dX[rows]) < TOL if x_grad else max_err(w.grad, dW[cols]) < TOL)
        ok.append((w.grad is None) if x_grad else (x.grad is None))
        if x_grad:  # the collectives are tagged with the autograd phase they run in
            phases = [(e.phase, i < forward) for i, e in enumerate(rec.events)]
            ok.append(
                forward > 0
                and len(phases) > forward
                and all((p == "forward") == before for p, before in phases)
            )
    return ok


def test_column_backward_computes_only_the_requested_gradients():
    assert run_distributed(_grads_only_where_needed, 2, timeout=TIMEOUT) == [[True] * 5] * 2


def _empty_chunks_are_fine() -> float:
    # m=1 row per rank with chunks=4: the chunk count clamps to the rows available.
    r, ws = rank_and_size()
    X, W = seeded(1, ws, 8), seeded(2, ws * 3, 8)
    y = all_gather_matmul(X[r : r + 1], W[r * 3 : (r + 1) * 3], None, impl="torch", chunks=4)
    return max_err(y, (X.double() @ W.double().t())[:, r * 3 : (r + 1) * 3])


def test_chunk_count_above_row_count_is_clamped():
    errs = run_distributed(_empty_chunks_are_fine, 2, timeout=TIMEOUT)
    assert max(errs) < TOL
