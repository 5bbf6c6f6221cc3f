"""What one call costs beyond its own work: a ``parallelize_kda``-ed module's forward (and
backward) neither builds nor looks up a state-exchange executor (the module keeps the one
``parallelize_kda`` built); the functional ``kda_context_parallel`` takes it from the
world-scoped cache. The parallel results still equal the serial stock layer. With the
consistency checks on, each public entry point compares its signature once per call (one
forward and its backward: one comparison, not one per halo, placement and exchange).
``backend=``, the fold kernel's earlier keyword, still works everywhere with a
DeprecationWarning pointing at the caller and gives identical results; with ``kernel=`` as
well it is a TypeError naming both."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _kda_hf import kda_layer
from _kda_testutil import kda_inputs, max_rel_err

import hyper_parallel.dtensor.consistency as consistency
from hyper_parallel.dtensor import consistency_checks, init_device_mesh
from hyper_parallel.dtensor.cache import WorldCache
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.kda import (
    ContextParallelKDA,
    affine_merge,
    affine_scan,
    build_state_exchange,
    causal_conv_halo,
    choose_backend,
    choose_kernel,
    exchange,
    is_kda_parallel,
    kda_context_parallel,
    parallelize_kda,
)

P, B, T, D = 2, 1, 7, 32
CUTS = [0, 4, 7]


def _input() -> torch.Tensor:
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(5), dtype=torch.float64)


class _Counter:
    """Counts executor constructions and world-cache lookups while installed."""

    def __init__(self) -> None:
        self.counts = {"StateExchange.__init__": 0, "WorldCache.get_or_create": 0}
        self._saved = (exchange.StateExchange.__init__, WorldCache.get_or_create)

    def __enter__(self) -> _Counter:
        init, get_or_create = self._saved
        counts = self.counts

        def counted_init(ex: Any, *args: Any, **kwargs: Any) -> None:
            counts["StateExchange.__init__"] += 1
            init(ex, *args, **kwargs)

        def counted_lookup(cache: Any, *args: Any, **kwargs: Any) -> Any:
            counts["WorldCache.get_or_create"] += 1
            return get_or_create(cache, *args, **kwargs)

        exchange.StateExchange.__init__ = counted_init  # type: ignore[method-assign]
        WorldCache.get_or_create = counted_lookup  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        exchange.StateExchange.__init__, WorldCache.get_or_create = self._saved  # type: ignore[method-assign]


def _executor_rank() -> dict[str, Any]:
    r = dist.get_rank()
    mesh = init_device_mesh("cpu", (P,), mesh_dim_names=("cp",))
    layer = parallelize_kda(kda_layer(), mesh, protocol="auto")
    x = _input()[:, CUTS[r] : CUTS[r + 1]].clone().requires_grad_()
    with _Counter() as module_calls:
        for _ in range(2):
            out = layer(x)
            out.sum().backward()
    # the functional entry point looks its executor up (the counter does count)
    q, k, v, g, beta, _ = kda_inputs(B, 4, 2, 16, 16)
    with _Counter() as functional_calls:
        kda_context_parallel(q, k, v, g, beta, mesh, protocol="allgather")
    return {
        "module": module_calls.counts,
        "functional": functional_calls.counts,
        "out": out.detach(),
        "x_grad": x.grad,
        "comparisons": _comparisons(mesh, r),
        "renamed": _renamed_rank(mesh, x),
    }


def _deprecated(call: Callable[[], Any]) -> tuple[Any, list[tuple[str, str]]]:
    """``call()`` and the (message, file) of each DeprecationWarning it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = call()
    return out, [
        (str(w.message), w.filename) for w in caught if issubclass(w.category, DeprecationWarning)
    ]


def _type_error(call: Callable[[], Any]) -> str:
    try:
        call()
    except TypeError as exc:
        return str(exc)
    return "NO ERROR"


def _renamed_rank(mesh: Any, x: torch.Tensor) -> dict[str, Any]:
    """backend= against kernel= in the distributed entry points (fold kernel "torch")."""
    q, k, v, g, beta, _ = kda_inputs(B, 4, 2, 16, 16)
    res: dict[str, Any] = {}
    new, _ = kda_context_parallel(q, k, v, g, beta, mesh, kernel="torch")
    (old, _), res["kda_context_parallel"] = _deprecated(
        lambda: kda_context_parallel(q, k, v, g, beta, mesh, backend="torch")
    )
    res["kda_context_parallel equal"] = torch.equal(old, new)
    res["kda_context_parallel both"] = _type_error(
        lambda: kda_context_parallel(q, k, v, g, beta, mesh, kernel="torch", backend="torch")
    )
    ex, res["build_state_exchange"] = _deprecated(
        lambda: build_state_exchange(mesh, "p2p", backend="torch")
    )
    res["executor kernel"] = ex.kernel
    res["executor backend"] = _deprecated(lambda: ex.backend)
    layer_new = parallelize_kda(kda_layer(), mesh, kernel="torch")
    layer_old, res["parallelize_kda"] = _deprecated(
        lambda: parallelize_kda(kda_layer(), mesh, backend="torch")
    )
    res["parallelize_kda equal"] = torch.equal(layer_old(x), layer_new(x))
    untouched = kda_layer()
    res["parallelize_kda both"] = _type_error(
        lambda: parallelize_kda(untouched, mesh, kernel="torch", backend="torch")
    )
    res["parallelize_kda both untouched"] = not is_kda_parallel(untouched)
    style, res["ContextParallelKDA"] = _deprecated(lambda: ContextParallelKDA(backend="torch"))
    res["style kernel"] = style.kernel
    return res


def _comparisons(mesh: Any, r: int) -> dict[str, int]:
    """How many signature comparisons (all-gather pairs) each call makes with the checks on."""
    saved = consistency._gather_signatures
    count = [0]

    def counted(*args: Any) -> Any:
        count[0] += 1
        return saved(*args)

    def compared(call: Any) -> int:
        count[0] = 0
        call()
        return count[0]

    x = _input()[:, CUTS[r] : CUTS[r + 1]].clone().requires_grad_()
    q, k, v, g, beta, _ = (t.requires_grad_() for t in kda_inputs(B, 4, 2, 16, 16))
    table = torch.tensor([0, 3, 8])
    consistency._gather_signatures = counted  # type: ignore[assignment]
    try:
        with consistency_checks():
            layer = kda_layer()
            res = {"parallelize_kda": compared(lambda: parallelize_kda(layer, mesh))}
            res["module forward + backward"] = compared(lambda: layer(x).sum().backward())
            res["packed module forward + backward"] = compared(
                lambda: layer(x, cu_seqlens=torch.tensor([0, 2, 7])).sum().backward()
            )
            res["kda_context_parallel + backward"] = compared(
                lambda: (
                    kda_context_parallel(q, k, v, g, beta, mesh, cu_seqlens=table)[0]
                    .sum()
                    .backward()
                )
            )
            res["causal_conv_halo"] = compared(lambda: causal_conv_halo(x, 4, mesh))
            ex = build_state_exchange(mesh, "p2p")
            S, M = torch.zeros(1, 2, 16, 16), torch.zeros(1, 2, 16, 16)
            res["StateExchange.forward"] = compared(lambda: ex.forward(S, M))
    finally:
        consistency._gather_signatures = saved  # type: ignore[assignment]
    res["checks off"] = compared(lambda: layer(x).sum().backward())
    return res


@pytest.mark.timeout(120)
def test_module_forward_uses_its_own_executor_and_each_entry_point_compares_once() -> None:
    results = run_distributed(_executor_rank, P, timeout=90)
    ref_x = _input().requires_grad_()
    ref = kda_layer()(ref_x)
    ref.sum().backward()
    assert ref_x.grad is not None
    for res in results:
        assert res["module"] == {"StateExchange.__init__": 0, "WorldCache.get_or_create": 0}
        assert res["functional"]["WorldCache.get_or_create"] == 1
        # once per entry point call, the nested halo / placement / exchange / build included
        assert res["comparisons"] == {
            "parallelize_kda": 1,
            "module forward + backward": 1,
            "packed module forward + backward": 1,
            "kda_context_parallel + backward": 1,
            "causal_conv_halo": 1,
            "StateExchange.forward": 1,
            "checks off": 0,
        }
    for res in results:
        renamed = res["renamed"]
        for name in ("kda_context_parallel", "build_state_exchange", "parallelize_kda"):
            _assert_warned(renamed[name], name)
            assert renamed.get(f"{name} equal", True) is True, name
        for name in ("kda_context_parallel", "parallelize_kda"):
            assert "kernel=" in renamed[f"{name} both"], renamed[f"{name} both"]
            assert "backend=" in renamed[f"{name} both"], renamed[f"{name} both"]
        assert renamed["parallelize_kda both untouched"]
        assert renamed["executor kernel"] == "torch" == renamed["style kernel"]
        assert renamed["executor backend"][0] == "torch"
        _assert_warned(renamed["executor backend"][1], "StateExchange.backend")
        _assert_warned(renamed["ContextParallelKDA"], "ContextParallelKDA")
    assert max_rel_err(torch.cat([res["out"] for res in results], dim=1), ref) < 1e-5
    # two backwards accumulate twice the serial input gradient
    got = torch.cat([res["x_grad"] for res in results], dim=1)
    assert max_rel_err(got, 2 * ref_x.grad) < 1e-5


def _assert_warned(caught: list[tuple[str, str]], what: str) -> None:
    """One DeprecationWarning naming ``what``, attributed to the caller (this file)."""
    assert len(caught) == 1, (what, caught)
    message, filename = caught[0]
    assert what in message and "kernel" in message, message
    assert filename == __file__, (what, filename)


def test_backend_keyword_warns_and_gives_identical_results_both_is_a_type_error() -> None:
    S, M = torch.randn(3, 1, 2, 16, 16), torch.randn(3, 1, 2, 16, 16) / 4
    x = torch.randn(1, 2, 16, 16)
    calls: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
        "affine_merge": (
            lambda **kw: affine_merge(S, M, 2, **kw),
            lambda: affine_merge(S, M, 2, kernel="torch"),
        ),
        "affine_scan": (
            lambda **kw: affine_scan((S, M), x, range(3), prefix_count=1, **kw),
            lambda: affine_scan((S, M), x, range(3), prefix_count=1, kernel="torch"),
        ),
        "choose_backend": (
            lambda **kw: choose_backend("cpu", 16, 16, **kw),
            lambda: choose_kernel("cpu", 16, 16, "torch"),
        ),
    }
    for name, (call, new) in calls.items():
        old, caught = _deprecated(functools.partial(call, backend="torch"))
        _assert_warned(caught, name)
        want = new()
        pairs = zip(old, want) if isinstance(old, tuple) else [(old, want)]
        for got, expected in pairs:
            assert torch.equal(got, expected) if isinstance(got, torch.Tensor) else got == expected
        message = _type_error(functools.partial(call, backend="torch", kernel="torch"))
        assert name in message and "kernel=" in message and "backend=" in message, message
    # the positional fourth argument of choose_backend is kernel: with backend= too, both
    message = _type_error(lambda: choose_backend("cpu", 16, 16, "torch", backend="torch"))
    assert "kernel=" in message and "backend=" in message, message
    assert choose_backend("cpu", 16, 16, "torch") == choose_kernel("cpu", 16, 16, "torch")
