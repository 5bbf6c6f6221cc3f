"""``impl=`` is the matmul+collective implementation keyword of every public API; the old
``backend=`` still works with a DeprecationWarning and gives identical results; both given is
a TypeError naming both."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from _mc2_testutil import rank_and_size, seeded

from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.mc2 import (
    MC2ColwiseParallel,
    MC2GatedMLPParallel,
    MC2MLPParallel,
    MC2Parallel,
    MC2RowwiseParallel,
    all_gather_matmul,
    all_gather_matmul_reference,
    gated_mlp,
    gated_mlp_reference,
    matmul_reduce_scatter,
    matmul_reduce_scatter_reference,
    mlp_block,
    mlp_block_reference,
    select_backend,
)

TIMEOUT = 60.0
D, F = 8, 8


def _old_and_new(fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """``fn`` with ``impl="torch"`` and with ``backend="torch"``: outputs, input gradients,
    the warnings of the old call, and the error of both keywords at once."""
    out = {}
    for key in ("impl", "backend"):
        x = args[0].clone().requires_grad_()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            y = fn(x, *args[1:], **kwargs, **{key: "torch"})
        y.backward(torch.ones_like(y))
        out[key] = (y.detach(), x.grad)
        out[f"{key}_warnings"] = [
            (w.category.__name__, str(w.message)) for w in caught if "impl" in str(w.message)
        ]
    try:
        fn(*args, **kwargs, impl="torch", backend="torch")
        out["both"] = None
    except TypeError as exc:
        out["both"] = str(exc)
    return out


def _functional() -> dict[str, Any]:
    r, _ = rank_and_size()
    x, w = seeded(1 + r, 4, D), seeded(10 + r, F, D)
    gw, uw, dw = seeded(20 + r, F, D), seeded(30 + r, F, D), seeded(40 + r, D, F)
    act = torch.nn.functional.silu
    return {
        "all_gather_matmul": _old_and_new(all_gather_matmul, x, w, chunks=2),
        "matmul_reduce_scatter": _old_and_new(matmul_reduce_scatter, x, w),
        "gated_mlp": _old_and_new(gated_mlp, x, gw, uw, dw, act_fn=act, chunks=2),
        "all_gather_matmul_reference": _old_and_new(all_gather_matmul_reference, x, w),
        "matmul_reduce_scatter_reference": _old_and_new(matmul_reduce_scatter_reference, x, w),
        "gated_mlp_reference": _old_and_new(gated_mlp_reference, x, gw, uw, dw, act_fn=act),
        "mlp_block": _old_and_new(mlp_block, x, uw, dw, act_fn=act, chunks=2),
        "mlp_block_reference": _old_and_new(mlp_block_reference, x, uw, dw, act_fn=act),
    }


@pytest.mark.timeout(90)
def test_old_backend_keyword_warns_and_gives_identical_results_in_every_functional_form():
    for res in run_distributed(_functional, 2, timeout=TIMEOUT):
        for name, out in res.items():
            assert torch.equal(out["impl"][0], out["backend"][0]), name
            assert torch.equal(out["impl"][1], out["backend"][1]), name
            assert out["impl_warnings"] == [], name
            assert len(out["backend_warnings"]) == 1, (name, out["backend_warnings"])
            category, message = out["backend_warnings"][0]
            assert category == "DeprecationWarning" and message.startswith(name), name
            assert "backend= is deprecated, use impl=" in message, name
            assert out["both"] is not None and "impl=" in out["both"], name
            assert "backend=" in out["both"] and out["both"].startswith(name), name


@pytest.mark.parametrize(
    "make",
    [
        lambda **kw: MC2ColwiseParallel(1, chunks=2, **kw),
        lambda **kw: MC2RowwiseParallel(0, **kw),
        lambda **kw: MC2GatedMLPParallel(sequence_dim=1, **kw),
        lambda **kw: MC2MLPParallel(sequence_dim=1, **kw),
        lambda **kw: MC2Parallel("row", None, 1, **kw),
    ],
    ids=["colwise", "rowwise", "gated", "mlp", "MC2Parallel"],
)
def test_styles_and_config_take_impl_and_still_accept_backend(make):
    new = make(impl="torch")
    with pytest.warns(DeprecationWarning, match="backend= is deprecated, use impl="):
        old = make(backend="torch")
    assert repr(old) == repr(new) and "impl='torch'" in repr(new)
    assert old.impl == new.impl == "torch"
    with pytest.raises(TypeError, match=r"both impl= and backend="):
        make(impl="torch", backend="torch")
    with pytest.raises(ValueError, match="impl must be one of"):
        make(impl="cuda")


def test_config_backend_attribute_is_a_deprecated_alias():
    cfg = MC2Parallel("column", None, impl="torch")
    with pytest.warns(DeprecationWarning, match="use .impl"):
        assert cfg.backend == "torch"


def test_select_backend_takes_impl():
    x, w = torch.ones(4, 8), torch.ones(6, 8)
    assert select_backend("all_gather_matmul", x, w, impl="torch") == (
        "torch",
        "impl='torch' requested",
    )
    with pytest.warns(DeprecationWarning):
        old = select_backend("all_gather_matmul", x, w, backend="torch")
    assert old == ("torch", "impl='torch' requested")
    with pytest.raises(TypeError, match="select_backend: got both impl= and backend="):
        select_backend("all_gather_matmul", x, w, impl="torch", backend="torch")


def test_reference_module_is_a_deprecated_alias_of_blocking():
    import importlib
    import sys

    import hyper_parallel.mc2 as mc2
    from hyper_parallel.mc2 import blocking

    sys.modules.pop("hyper_parallel.mc2.reference", None)
    with pytest.warns(DeprecationWarning, match=r"hyper_parallel.mc2.reference is deprecated"):
        old = importlib.import_module("hyper_parallel.mc2.reference")
    assert old.__all__ == blocking.__all__
    for name in blocking.__all__:
        assert getattr(old, name) is getattr(blocking, name) is getattr(mc2, name), name
