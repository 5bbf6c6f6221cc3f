"""One way to install and undo a parallel forward: the class swap, the state, undo, deep copy,
one rewrite per module, and a failure half-way leaving the module as it was."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hyper_parallel.dtensor import rewrite
from hyper_parallel.dtensor.rewrite import (
    install_forward,
    is_parallelized,
    parallel_state,
    uninstall_forward,
)


def _doubled(cls: type):
    def forward(self, x):
        return 2 * cls.forward(self, x) + parallel_state(self, "double").offset

    return forward


class _State:
    offset = 1.0


def test_install_undo_and_deep_copy():
    lin = nn.Linear(3, 3)
    x = torch.randn(2, 3)
    plain = lin(x)
    state = _State()
    install_forward(lin, "double", state, _doubled, prefix="Doubled")
    assert type(lin).__name__ == "DoubledLinear" and isinstance(lin, nn.Linear)
    assert torch.equal(lin(x), 2 * plain + 1.0)
    assert is_parallelized(lin) and is_parallelized(lin, "double")
    assert not is_parallelized(lin, "other") and parallel_state(lin, "other") is None
    twin = copy.deepcopy(lin)  # rewritten too, sharing the state, with its own parameters
    assert type(twin) is type(lin) and parallel_state(twin, "double") is state
    assert twin.weight is not lin.weight and torch.equal(twin(x), lin(x))
    assert "_hp_parallel" not in lin.state_dict()
    with pytest.raises(RuntimeError, match="already parallelized by double"):
        install_forward(lin, "other", _State(), _doubled, prefix="Other")
    with pytest.raises(RuntimeError, match="other: module was parallelized by double"):
        uninstall_forward(lin, "other")
    assert uninstall_forward(lin, "double") is state
    assert type(lin) is nn.Linear and not is_parallelized(lin) and torch.equal(lin(x), plain)
    with pytest.raises(RuntimeError, match="double: module is not parallelized"):
        uninstall_forward(lin, "double")
    # one subclass per (class, layer), made once
    other = nn.Linear(3, 3)
    install_forward(other, "double", state, _doubled, prefix="Doubled")
    assert type(other) is type(twin)


def test_a_failed_install_leaves_the_module_as_it_was(monkeypatch):
    lin = nn.Linear(3, 3)

    class Refuses(nn.Linear):  # a class swap torch refuses (object layout differs)
        __slots__ = ("extra",)

    monkeypatch.setitem(rewrite._CLASSES, (nn.Linear, "slots"), Refuses)
    with pytest.raises(TypeError):
        install_forward(lin, "slots", _State(), _doubled, prefix="X")
    assert type(lin) is nn.Linear and not is_parallelized(lin)
    assert "_hp_parallel" not in lin.__dict__


def test_members_are_methods_of_the_class_so_copies_use_their_own():
    def shown(module: nn.Module) -> str:
        return f"{nn.Linear.extra_repr(module)}, offset={parallel_state(module, 'shown').offset}"

    lin = nn.Linear(3, 2, bias=False)

    def weight_sum(module: nn.Module) -> float:
        return float(module.weight.sum())

    members = {"extra_repr": shown, "weight_sum": weight_sum}
    install_forward(lin, "shown", _State(), _doubled, prefix="Shown", members=members)
    assert repr(lin) == "ShownLinear(in_features=3, out_features=2, bias=False, offset=1.0)"
    twin = copy.deepcopy(lin)
    with torch.no_grad():
        twin.weight.add_(1.0)
    assert twin.weight_sum() == pytest.approx(lin.weight_sum() + 6.0)  # reads the copy
    uninstall_forward(lin, "shown")
    assert repr(lin) == "Linear(in_features=3, out_features=2, bias=False)"
