"""Undo and query of every hp-mc2 style (hp-dtensor's rewrite underneath): install -> is ->
undo -> is-not -> install again; deep copies, isinstance, repr and state_dict of a
parallelized linear; undoing a module that is not parallelized raises."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from _mc2_testutil import max_err, rank_and_size, seeded
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from hyper_parallel.dtensor import init_device_mesh
from hyper_parallel.dtensor.rewrite import is_parallelized, parallel_state
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.mc2 import (
    MC2ColwiseParallel,
    MC2GatedMLPParallel,
    MC2Linear,
    MC2Parallel,
    MC2RowwiseParallel,
    is_mc2_parallel,
    unparallelize_mc2,
)

TIMEOUT = 60.0
D, F = 8, 16


class _Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(D, F)
        self.up_proj = nn.Linear(D, F)
        self.down_proj = nn.Linear(F, D)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _full_params(module: nn.Module) -> None:
    """Put full (unsharded) parameters back in place of a style's DTensor shards."""
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if isinstance(p, DTensor):
                sub.register_parameter(name, nn.Parameter(p.full_tensor()))


def _cfg(module: nn.Module) -> Any:
    return parallel_state(module, "MC2Linear")


def _round_trip() -> dict[str, Any]:
    r, ws = rank_and_size()
    mesh = init_device_mesh("cpu", (ws,))
    res: dict[str, Any] = {}
    X = seeded(1, 2, 4 * ws, D)
    x = X.chunk(ws, dim=1)[r]

    # colwise on a plain nn.Linear: install -> is -> undo -> is-not -> install again
    torch.manual_seed(0)
    serial = nn.Linear(D, F)
    lin = parallelize_module(copy.deepcopy(serial), mesh, MC2ColwiseParallel())
    res["lin_is"] = (is_mc2_parallel(lin), isinstance(lin, MC2Linear), isinstance(lin, nn.Linear))
    res["lin_class"] = type(lin).__name__
    res["lin_repr"] = repr(lin)
    res["lin_state_dict"] = sorted((k, type(v).__name__) for k, v in lin.state_dict().items())
    y1 = lin(x)
    cols = slice(F // ws * r, F // ws * (r + 1))
    res["lin_err"] = max_err(y1, serial(X)[..., cols])
    twin = copy.deepcopy(lin)
    res["copy"] = (
        is_mc2_parallel(twin),
        _cfg(twin) is _cfg(lin) is not None,
        max_err(twin(x), y1),
        twin.weight is lin.weight,
    )
    unparallelize_mc2(lin)
    res["lin_undone"] = (
        is_mc2_parallel(lin), isinstance(lin, MC2Linear), type(lin) is nn.Linear,
        isinstance(lin.weight, DTensor), is_parallelized(lin),
    )  # fmt: skip
    res["copy_after_undo"] = (is_mc2_parallel(twin), max_err(twin(x), y1))
    _full_params(lin)
    res["plain_err"] = max_err(lin(X), serial(X))
    parallelize_module(lin, mesh, MC2ColwiseParallel())
    res["again"] = (is_mc2_parallel(lin), max_err(lin(x), y1))

    # rowwise, and an MC2Linear built with a config: undo gives back the MC2Linear class
    row = parallelize_module(nn.Linear(F, D), mesh, MC2RowwiseParallel())
    res["row"] = (is_mc2_parallel(row), unparallelize_mc2(row) is row, is_mc2_parallel(row))
    built = MC2Linear(D, F, parallel=MC2Parallel("column", mesh.get_group()))
    res["built"] = (is_mc2_parallel(built), "mode=column" in repr(built))
    unparallelize_mc2(built)
    res["built_undone"] = (type(built) is MC2Linear, built.mc2 is None, is_mc2_parallel(built))

    # the gated style
    torch.manual_seed(0)
    gserial = _Gated()
    gm = parallelize_module(copy.deepcopy(gserial), mesh, MC2GatedMLPParallel())
    yg = gm(x)
    res["gated_is"] = is_mc2_parallel(gm)
    unparallelize_mc2(gm)
    res["gated_undone"] = (is_mc2_parallel(gm), type(gm) is _Gated, is_parallelized(gm))
    _full_params(gm)
    res["gated_plain_err"] = max_err(gm(X), gserial(X))
    parallelize_module(gm, mesh, MC2GatedMLPParallel())
    res["gated_again"] = (is_mc2_parallel(gm), max_err(gm(x), yg))
    res["gated_ref_err"] = max_err(yg, gserial(X).chunk(ws, dim=1)[r])
    return res


@pytest.mark.timeout(90)
def test_every_style_can_be_undone_queried_and_installed_again():
    for res in run_distributed(_round_trip, 2, timeout=TIMEOUT):
        assert res["lin_is"] == (True, True, True)
        assert res["lin_class"] == "MC2Linear"
        # the style's options show, as they did before the forward moved onto hp-dtensor's rewrite
        assert res["lin_repr"].startswith(
            "MC2Linear(in_features=8, out_features=16, bias=True, mode=column, sequence_dim="
        ), res["lin_repr"]
        assert "impl=auto, chunks=" in res["lin_repr"], res["lin_repr"]
        assert res["lin_state_dict"] == [("bias", "DTensor"), ("weight", "DTensor")]
        assert res["lin_err"] < 1e-6
        assert res["copy"] == (True, True, 0.0, False)
        assert res["lin_undone"] == (False, False, True, True, False)
        assert res["copy_after_undo"] == (True, 0.0)
        assert res["plain_err"] < 1e-6
        assert res["again"] == (True, 0.0)
        assert res["row"] == (True, True, False)
        assert res["built"] == (True, True)
        assert res["built_undone"] == (True, True, False)
        assert res["gated_is"] is True
        assert res["gated_undone"] == (False, True, False)
        assert res["gated_plain_err"] < 1e-6
        assert res["gated_again"] == (True, 0.0)
        assert res["gated_ref_err"] < 1e-6


@pytest.mark.parametrize(
    "module",
    [nn.Linear(4, 4), MC2Linear(4, 4), MC2Linear.from_linear(nn.Linear(4, 4)), _Gated()],
    ids=["linear", "mc2linear-no-config", "from-linear-no-config", "gated"],
)
def test_undo_of_a_module_that_is_not_parallel_raises(module):
    assert not is_mc2_parallel(module)
    with pytest.raises(RuntimeError, match="is not parallelized by hp-mc2"):
        unparallelize_mc2(module)
