"""What one call costs beyond its own work: a ``parallelize_kda``-ed module's forward (and
backward) neither builds nor looks up a state-exchange executor (the module keeps the one
``parallelize_kda`` built); the functional ``kda_context_parallel`` takes it from the
world-scoped cache. The parallel results still equal the serial stock layer."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _kda_hf import kda_layer
from _kda_testutil import kda_inputs, max_rel_err

from hyper_parallel.dtensor import init_device_mesh
from hyper_parallel.dtensor.cache import WorldCache
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.kda import exchange, kda_context_parallel, parallelize_kda

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
    }


@pytest.mark.timeout(120)
def test_module_forward_uses_its_own_executor_and_equals_the_serial_layer() -> None:
    results = run_distributed(_executor_rank, P, timeout=90)
    ref_x = _input().requires_grad_()
    ref = kda_layer()(ref_x)
    ref.sum().backward()
    assert ref_x.grad is not None
    for res in results:
        assert res["module"] == {"StateExchange.__init__": 0, "WorldCache.get_or_create": 0}
        assert res["functional"]["WorldCache.get_or_create"] == 1
    assert max_rel_err(torch.cat([res["out"] for res in results], dim=1), ref) < 1e-5
    # two backwards accumulate twice the serial input gradient
    got = torch.cat([res["x_grad"] for res in results], dim=1)
    assert max_rel_err(got, 2 * ref_x.grad) < 1e-5
