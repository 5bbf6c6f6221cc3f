"""The overlapped-exchange node pair (``overlap.launch`` / ``wait`` / ``blocking``) on 2 gloo
ranks: an uneven all-to-all exchange and an all-gather exchange give the serial reference's
output and input gradient (float64) with a computation between launch and wait, the pair and
its one-node twin agree bit for bit, the gradient's collective starts before it is finished and
around the computation's backward, and an anchor keeps a rank whose input needs no gradient
in the backward collective its peer's gradient needs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from hyper_parallel.dtensor import comm, init_device_mesh, overlap
from hyper_parallel.dtensor.testing import run_distributed

P = 2
D = 3  # row width
TOL = {"rtol": 1e-12, "atol": 1e-12}
# ROWS[i][j]: rows rank i sends to rank j (rank 1 keeps none of its own)
ROWS = [[2, 3], [4, 0]]


class A2AV:
    """An uneven all-to-all of rows; its gradient goes back along the transposed splits. Logs
    each method call into ``log``."""

    def __init__(self, g: comm.Group, rows: list[list[int]], log: list[str]) -> None:
        me = g.rank
        self.g, self.log = g, log
        self.send = rows[me]
        self.recv = [rows[j][me] for j in range(g.size)]
        self.fwd: comm.Work | None = None
        self.bwd: comm.Work | None = None

    def start(self, x: torch.Tensor) -> None:
        self.log.append("start")
        self.fwd = comm.start_all_to_all_v(
            x, self.send, self.recv, self.g, "a2av:x", "forward", "test"
        )

    def finish(self) -> torch.Tensor:
        self.log.append("finish")
        work, self.fwd = self.fwd, None
        assert work is not None
        return work.wait()

    def start_grad(self, grad: torch.Tensor) -> None:
        self.log.append("start_grad")
        self.bwd = comm.start_all_to_all_v(
            grad, self.recv, self.send, self.g, "a2av:dx", "backward", "test"
        )

    def finish_grad(self) -> torch.Tensor:
        self.log.append("finish_grad")
        work, self.bwd = self.bwd, None
        assert work is not None
        return work.wait()


class Gather:
    """An all-gather along dim 0; its gradient is the reduce-scatter (sum)."""

    def __init__(self, g: comm.Group, log: list[str]) -> None:
        self.g, self.log = g, log
        self.fwd: comm.Work | None = None
        self.bwd: comm.Work | None = None

    def start(self, x: torch.Tensor) -> None:
        self.log.append("start")
        self.fwd = comm.start_all_gather(x, 0, self.g, "all_gather:x", "forward", "test")

    def finish(self) -> torch.Tensor:
        self.log.append("finish")
        work, self.fwd = self.fwd, None
        assert work is not None
        return work.wait()

    def start_grad(self, grad: torch.Tensor) -> None:
        self.log.append("start_grad")
        self.bwd = comm.start_reduce_scatter(
            grad, 0, self.g, "reduce_scatter:dx", "backward", "test"
        )

    def finish_grad(self) -> torch.Tensor:
        self.log.append("finish_grad")
        work, self.bwd = self.bwd, None
        assert work is not None
        return work.wait()


class _Marked(torch.autograd.Function):
    """The identity; logs when its forward and its backward run."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, log: list[str]) -> torch.Tensor:  # type: ignore[override]
        log.append("compute")
        ctx.log = log
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.log.append("compute backward")
        return grad, None


# ---- the problem: every rank's data from seeds, so the test process can run it serially ----
def _data(rank: int, rows: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return {
        "a": torch.randn(rows, D, dtype=torch.float64, generator=g),
        "w": torch.randn(D, D, dtype=torch.float64, generator=g),
        "b": torch.randn(4, D, dtype=torch.float64, generator=g),
        "c": torch.randn(16, D, dtype=torch.float64, generator=g),  # loss weights (rows ≥ any)
    }


def _x(d: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.tanh(d["a"] @ d["w"])


def _local(d: dict[str, torch.Tensor], y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """This rank's loss from the exchange's result ``y`` and the overlapped computation ``z``."""
    return (y * d["c"][: y.shape[0]]).sum() + z.square().sum()


def _rank_run(kind: str, mode: str) -> dict[str, Any]:
    """One forward and backward of ``kind`` ("a2av" / "gather") run as ``mode`` ("pair" /
    "blocking"); the computation between launch and wait does not depend on the exchange."""
    rank = dist.get_rank()
    g = comm.resolve_group(init_device_mesh("cpu", (P,), mesh_dim_names=("x",)))
    rows = sum(ROWS[rank]) if kind == "a2av" else 2
    d = _data(rank, rows)
    d["a"].requires_grad_()
    d["b"].requires_grad_()
    log: list[str] = []
    ex = A2AV(g, ROWS, log) if kind == "a2av" else Gather(g, log)
    x = _x(d)
    if mode == "pair":
        token = overlap.launch(ex, x)
        z = torch.tanh(_Marked.apply(d["b"], log) @ d["w"])  # while the exchange is in flight
        y = overlap.wait(ex, token)
        structure = {
            "token": (tuple(token.shape), token.requires_grad),
            # the token is the wait node's only tensor input: it orders the two nodes
            "wait_after_launch": [f[0] for f in y.grad_fn.next_functions if f[0] is not None]
            == [token.grad_fn],
        }
    else:
        y = overlap.blocking(ex, x)
        z = torch.tanh(_Marked.apply(d["b"], log) @ d["w"])
        structure = {}
    _local(d, y, z).backward()
    return {
        "y": y.detach(),
        "da": d["a"].grad,
        "db": d["b"].grad,
        "log": log,
        "structure": structure,
        "pending": comm.pending_collectives(),
    }


def _rank_anchor() -> dict[str, Any]:
    """Rank 1 has no rows to send and its (empty) input needs no gradient; an empty slice of
    its weight anchors the pair, so its backward runs the gradient's collective that carries
    rank 0's gradient back."""
    rank = dist.get_rank()
    g = comm.resolve_group(init_device_mesh("cpu", (P,), mesh_dim_names=("x",)))
    rows = [[1, 3], [0, 0]]
    d = _data(rank, sum(rows[rank]))
    w = d["w"].clone().requires_grad_()
    log: list[str] = []
    if rank == 0:
        a = d["a"].clone().requires_grad_()
        x, anchors = torch.tanh(a @ w), ()
    else:
        a, x = None, d["a"]  # [0, D], no gradient
        anchors = (w[:0],)
    unanchored = overlap.blocking(A2AV(g, rows, []), x)
    ex = A2AV(g, rows, log)
    y = overlap.wait(ex, overlap.launch(ex, x, *anchors))
    (y * d["c"][: y.shape[0]]).sum().backward()
    return {
        "y": y.detach(),
        "needs_grad": (unanchored.requires_grad, y.requires_grad),
        "da": None if a is None else a.grad,
        "dw": w.grad,
        "log": log,
        "pending": comm.pending_collectives(),
    }


CASES = [("a2av", "pair"), ("a2av", "blocking"), ("gather", "pair"), ("gather", "blocking")]


def _rank_all() -> dict[Any, Any]:
    out: dict[Any, Any] = {case: _rank_run(*case) for case in CASES}
    out["anchor"] = _rank_anchor()
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[Any, Any]]:
    """Every check's results, by rank (one spawn for the module)."""
    return run_distributed(_rank_all, P, timeout=120)


# ---- serial references (the test process, every rank's data) --------------------------------
def _serial(kind: str) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Every rank's exchange result, input gradient ``da`` and ``db``, computed in one process."""
    data = []
    for r in range(P):
        rows = sum(ROWS[r]) if kind == "a2av" else 2
        d = _data(r, rows)
        d["a"].requires_grad_()
        d["b"].requires_grad_()
        data.append(d)
    xs = [_x(d) for d in data]
    if kind == "a2av":
        pieces = [x.split(ROWS[i]) for i, x in enumerate(xs)]
        ys = [torch.cat([pieces[j][r] for j in range(P)]) for r in range(P)]
    else:
        ys = [torch.cat(xs)] * P
    zs = [torch.tanh(d["b"] @ d["w"]) for d in data]
    sum(_local(d, y, z) for d, y, z in zip(data, ys, zs)).backward()  # type: ignore[union-attr]
    return [y.detach() for y in ys], [d["a"].grad for d in data], [d["b"].grad for d in data]


@pytest.mark.parametrize("kind", ["a2av", "gather"])
@pytest.mark.parametrize("mode", ["pair", "blocking"])
def test_exchange_through_the_nodes_gives_the_serial_output_and_input_gradient(
    kind, mode, two_ranks
):
    ys, das, dbs = _serial(kind)
    for rank, r in enumerate(res[kind, mode] for res in two_ranks):
        torch.testing.assert_close(r["y"], ys[rank], **TOL)
        torch.testing.assert_close(r["da"], das[rank], **TOL)
        torch.testing.assert_close(r["db"], dbs[rank], **TOL)
        assert r["pending"] == []
    # rank 1 keeps none of its rows and rank 0 receives 6: the uneven split really ran
    if kind == "a2av":
        assert [tuple(res[kind, mode]["y"].shape) for res in two_ranks] == [(6, D), (3, D)]


@pytest.mark.parametrize("kind", ["a2av", "gather"])
def test_launch_wait_pair_equals_its_blocking_twin_bit_for_bit(kind, two_ranks):
    for res in two_ranks:
        pair, one = res[kind, "pair"], res[kind, "blocking"]
        for key in ("y", "da", "db"):
            assert torch.equal(pair[key], one[key]), (kind, key)


@pytest.mark.parametrize("kind", ["a2av", "gather"])
def test_computation_runs_between_launch_and_wait_in_forward_and_backward(kind, two_ranks):
    for res in two_ranks:
        # forward: start, the computation, finish; backward: the wait node starts the
        # gradient's collective, the computation's backward runs, the launch node finishes it
        assert res[kind, "pair"]["log"] == [
            "start", "compute", "finish", "start_grad", "compute backward", "finish_grad",
        ]  # fmt: skip
        # the blocking twin starts and finishes at once, both ways
        log = [e for e in res[kind, "blocking"]["log"] if not e.startswith("compute")]
        assert log == ["start", "finish", "start_grad", "finish_grad"]


def test_the_token_is_an_empty_tensor_that_orders_the_wait_after_the_launch(two_ranks):
    for res in two_ranks:
        for kind in ("a2av", "gather"):
            assert res[kind, "pair"]["structure"] == {
                "token": ((0,), True),
                "wait_after_launch": True,
            }


def test_an_anchor_runs_the_gradient_collective_on_a_rank_whose_input_needs_no_gradient(
    two_ranks,
):
    r0, r1 = (res["anchor"] for res in two_ranks)
    # without the anchor rank 1's result would leave the graph (its backward would never run
    # the collective rank 0 waits for); with it, it stays in
    assert r1["needs_grad"] == (False, True)
    assert r0["needs_grad"] == (True, True)
    for r in (r0, r1):
        assert r["log"] == ["start", "finish", "start_grad", "finish_grad"]
        assert r["pending"] == []
    # rank 0's gradient: its own kept row plus the 3 rows rank 1 received, whose gradient
    # only rank 1's backward collective brings back
    d0, d1 = _data(0, 4), _data(1, 0)
    a = d0["a"].clone().requires_grad_()
    x = torch.tanh(a @ d0["w"])
    ((x[:1] * d0["c"][:1]).sum() + (x[1:] * d1["c"][:3]).sum()).backward()
    torch.testing.assert_close(r0["da"], a.grad, **TOL)
    assert r0["y"].shape == (1, D) and r1["y"].shape == (3, D)
    torch.testing.assert_close(r1["y"], x.detach()[1:], **TOL)
    # the anchor's gradient is None: rank 1's weight gets none
    assert r1["dw"] is None and r0["dw"] is not None


class _Local:
    """An exchange without communication (identity), logging into ``log``: the in-flight
    points' order needs no process group."""

    def __init__(self, log: list[str]) -> None:
        self.log, self.x, self.g = log, None, None

    def start(self, x: torch.Tensor) -> None:
        self.log.append("start")
        self.x = x

    def finish(self) -> torch.Tensor:
        self.log.append("finish")
        return self.x.clone()

    def start_grad(self, grad: torch.Tensor) -> None:
        self.log.append("start_grad")
        self.g = grad

    def finish_grad(self) -> torch.Tensor:
        self.log.append("finish_grad")
        return self.g.clone()


def test_in_flight_hook_runs_between_each_start_and_its_wait_both_ways() -> None:
    log: list[str] = []
    ex = _Local(log)
    x = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    with overlap.in_flight_hook(lambda: log.append("hook")):
        with pytest.raises(RuntimeError, match="already installed"):
            with overlap.in_flight_hook(lambda: None):
                pass
        y = overlap.wait(ex, overlap.launch(ex, x))
        z = overlap.blocking(ex, y)  # the one-node twin has no in-flight point
        (z * 2).sum().backward()
    assert log == [
        "start", "hook", "finish", "start", "finish",
        "start_grad", "finish_grad", "start_grad", "hook", "finish_grad",
    ]  # fmt: skip
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))
    overlap.in_flight()  # no hook installed: nothing runs
    assert log[-1] == "finish_grad"
