"""hp-mc2's implementations behind one interface (``hyper_parallel.mc2.impls``): a further
implementation is one class in the registry, and every entry point (both duals, both blocks,
forward and backward) runs it through the interface's methods; ``impl="auto"`` walks
``AUTO_ORDER`` and says why it skipped each; the registry's own two satisfy the protocol; and
the former ``hyper_parallel.mc2.backend`` module is a deprecated alias."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _mc2_testutil import max_err, rank_and_size, seeded

import hyper_parallel.mc2 as mc2
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.mc2 import (
    all_gather_matmul,
    gated_mlp,
    matmul_reduce_scatter,
    mlp_block,
    select_backend,
)
from hyper_parallel.mc2 import impls as impls_mod
from hyper_parallel.mc2._torch_impl import TorchChunkedImpl

TIMEOUT = 90.0
M, D, FL = 4, 8, 6  # rows per rank, hidden, ffn features per rank


class _Recording(TorchChunkedImpl):
    """A third implementation: the torch one's arithmetic, every method call logged, and a
    constraint that fails on request."""

    name = "recording"
    requested_reason = "impl='recording' requested"
    auto_reason = "the recording implementation runs anything"

    def __init__(self, refuse: str | None = None) -> None:
        self.log: list[str] = []
        self.refuse = refuse

    def failure(self, op: Any, x: torch.Tensor, weight: torch.Tensor, group: Any) -> str | None:
        return self.refuse

    def __getattribute__(self, name: str) -> Any:
        attr = super().__getattribute__(name)
        if name.endswith(("_forward", "_backward")):
            super().__getattribute__("log").append(name)
        return attr


def _entry_points(impl: str) -> dict[str, list[torch.Tensor]]:
    """Output and every gradient of each public entry point on this rank's operands."""
    r, ws = rank_and_size()
    x = seeded(10 + r, M, D, dtype=torch.float64)
    out: dict[str, list[torch.Tensor]] = {}

    def run(name: str, fn: Any, *ops: torch.Tensor, **kw: Any) -> None:
        leaves = [t.clone().requires_grad_() for t in ops]
        y = fn(*leaves, impl=impl, chunks=2, **kw)
        y.backward(seeded(30, *y.shape, dtype=torch.float64))
        out[name] = [y.detach(), *(t.grad for t in leaves)]

    w, b = seeded(1, FL, D, dtype=torch.float64), seeded(2, FL, dtype=torch.float64)
    run("all_gather_matmul", lambda a, c, d, **kw: all_gather_matmul(a, c, bias=d, **kw), x, w, b)
    xr, wr = seeded(3, ws * M, FL, dtype=torch.float64), seeded(4, D, FL, dtype=torch.float64)
    bd = seeded(5, D, dtype=torch.float64)
    run("matmul_reduce_scatter",
        lambda a, c, d, **kw: matmul_reduce_scatter(a, c, bias=d, **kw), xr, wr, bd)  # fmt: skip
    wg, wu = seeded(6, FL, D, dtype=torch.float64), seeded(7, FL, D, dtype=torch.float64)
    run("gated_mlp", lambda *t, **kw: gated_mlp(*t, act_fn=F.silu, **kw), x, wg, wu, wr)
    run("mlp_block", lambda *t, **kw: mlp_block(*t, act_fn=F.gelu, **kw), x, wu, wr)
    return out


def _third_implementation() -> dict[str, Any]:
    recording = _Recording()
    impls_mod.IMPLS["recording"] = recording
    try:
        got, want = _entry_points("recording"), _entry_points("torch")
        errs = {k: max(max_err(a, b) for a, b in zip(got[k], want[k])) for k in got}
        x, w = seeded(1, M, D), seeded(2, FL, D)
        forced = select_backend("all_gather_matmul", x, w, impl="recording")
        recording.refuse = "not on this machine"
        try:
            select_backend("all_gather_matmul", x, w, impl="recording")
            refused = ""
        except ValueError as exc:
            refused = str(exc)
        order = impls_mod.AUTO_ORDER
        impls_mod.AUTO_ORDER = ("recording", "npu", "torch")
        try:
            auto = select_backend("all_gather_matmul", x, w)
            recording.refuse = None
            auto_first = select_backend("all_gather_matmul", x, w)
        finally:
            impls_mod.AUTO_ORDER = order
        return {
            "errs": errs, "log": recording.log, "forced": forced, "refused": refused,
            "auto": auto, "auto_first": auto_first,
        }  # fmt: skip
    finally:
        del impls_mod.IMPLS["recording"]


@pytest.mark.timeout(TIMEOUT)
def test_a_third_implementation_is_one_class_in_the_registry():
    for res in run_distributed(_third_implementation, 2, timeout=TIMEOUT - 10):
        assert all(e < 1e-12 for e in res["errs"].values()), res["errs"]
        # every entry point ran through the interface, forward then backward
        assert res["log"] == [
            "column_forward", "column_backward", "row_forward", "row_backward",
            "block_forward", "block_backward", "block_forward", "block_backward",
        ]  # fmt: skip
        assert res["forced"] == ("recording", "impl='recording' requested")
        assert res["refused"] == (
            "impl='recording' cannot run all_gather_matmul: not on this machine"
        )
        # auto skips each implementation whose constraints fail, and says why
        assert res["auto"] == (
            "torch",
            "recording: not on this machine; npu: tensors are on cpu, not npu",
        )
        assert res["auto_first"] == ("recording", "the recording implementation runs anything")


def test_the_registry_holds_torch_and_npu_and_auto_tries_npu_first():
    assert list(impls_mod.IMPLS) == ["torch", "npu"]
    assert impls_mod.impl_choices() == ("auto", "torch", "npu")
    assert impls_mod.AUTO_ORDER == ("npu", "torch")
    for name, impl in impls_mod.IMPLS.items():
        assert impl.name == name
        for method in ("failure", "column_forward", "column_backward", "row_forward",
                       "row_backward", "block_forward", "block_backward"):  # fmt: skip
            assert callable(getattr(impl, method)), (name, method)
    with pytest.raises(ValueError, match=r"impl must be one of \('auto', 'torch', 'npu'\)"):
        impls_mod.check_impl_choice("cuda")


def test_backend_module_is_a_deprecated_alias():
    import importlib
    import sys

    sys.modules.pop("hyper_parallel.mc2.backend", None)
    with pytest.warns(DeprecationWarning, match=r"hyper_parallel.mc2.backend is deprecated"):
        old = importlib.import_module("hyper_parallel.mc2.backend")
    for name in ("select_backend", "npu_constraint_failure", "default_chunks"):
        assert getattr(old, name) is getattr(mc2, name), name
    assert old.BACKENDS == ("auto", "torch", "npu")
    assert old.OPS == ("all_gather_matmul", "matmul_reduce_scatter")
