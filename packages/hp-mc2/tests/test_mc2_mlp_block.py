"""The fused plain MLP block (``mlp_block``, ``MC2MLPParallel``): ``down(act(up(x)))`` as one
pipeline over row chunks. Real gloo ranks, float64: the output and every gradient (x, W_u, W_d,
b_u, b_d) against the serial module on the full sequence and against the blocking twin, at
chunks 1/2/3/4; bitwise equal with and without the modeled link; each rank computes only its
F/ws columns (its shards and a flop count); the style's layouts; the npu path through the
kernel double; and the rejected inputs, refused on every rank before any collective."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _mc2_npu_double import GlooMC2Double
from _mc2_testutil import group_still_works, max_err, rank_and_size, seeded
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils.flop_counter import FlopCounterMode

from hyper_parallel.dtensor import init_device_mesh
from hyper_parallel.dtensor.testing import compare_under_link, run_distributed
from hyper_parallel.mc2 import (
    MC2MLPParallel,
    is_mc2_parallel,
    mlp_block,
    mlp_block_reference,
    unparallelize_mc2,
    use_npu_ops,
)

TIMEOUT = 150
M, D, FL = 6, 8, 4  # rows per rank, hidden, ffn features per rank
TOL = 1e-12


def _serial(X, Wu, Wd, bu, bd, act, dY):
    """Float64 serial block on full tensors: Y and (dX, dW_u, dW_d, db_u, db_d)."""
    leaves = [t.clone().requires_grad_() for t in (X, Wu, Wd, bu, bd)]
    y = F.linear(act(F.linear(leaves[0], leaves[1], leaves[3])), leaves[2], leaves[4])
    y.backward(dY)
    return y.detach(), [t.grad for t in leaves]


def _full_operands(ws: int):
    X = seeded(1, M * ws, D, dtype=torch.float64)
    Wu = seeded(2, FL * ws, D, dtype=torch.float64) / 2
    Wd = seeded(3, D, FL * ws, dtype=torch.float64) / 2
    bu, bd = seeded(4, FL * ws, dtype=torch.float64), seeded(5, D, dtype=torch.float64)
    dY = seeded(6, M * ws, D, dtype=torch.float64)
    return X, Wu, Wd, bu, bd, dY


def _functional() -> dict[str, Any]:
    r, ws = rank_and_size()
    X, Wu, Wd, bu, bd, dY = _full_operands(ws)
    rows, cols = slice(r * M, (r + 1) * M), slice(r * FL, (r + 1) * FL)
    res: dict[str, Any] = {}
    for label, act in (("gelu", F.gelu), ("silu", nn.SiLU()), ("identity", nn.Identity())):
        want_y, want_g = _serial(X, Wu, Wd, bu, bd, act, dY)
        want = [want_y[rows], want_g[0][rows], want_g[1][cols], want_g[2][:, cols],
                want_g[3][cols], want_g[4]]  # fmt: skip
        for bias in (True, False):
            for name, fn, chunks in [("twin", mlp_block_reference, None)] + [
                ("ours", mlp_block, c) for c in (1, 2, 3, 4)
            ]:
                leaves = [t.clone().requires_grad_() for t in (X[rows], Wu[cols], Wd[:, cols])]
                b = [t.clone().requires_grad_() for t in (bu[cols], bd)] if bias else [None] * 2
                y = fn(*leaves, act_fn=act, up_bias=b[0], down_bias=b[1], impl="torch",
                       chunks=chunks)  # fmt: skip
                y.backward(dY[rows])
                got = [
                    y.detach(),
                    *(t.grad for t in leaves),
                    *(t.grad if bias else None for t in b),
                ]
                if not bias:
                    # the serial reference with zero biases has the same y and weight grads
                    _, g0 = _serial(X, Wu, Wd, 0 * bu, 0 * bd, act, dY)
                    ref = [_serial(X, Wu, Wd, 0 * bu, 0 * bd, act, dY)[0][rows], g0[0][rows],
                           g0[1][cols], g0[2][:, cols]]  # fmt: skip
                    errs = [max_err(a, w) for a, w in zip(got[:4], ref)]
                    errs.append(0.0 if got[4:] == [None, None] else float("inf"))
                else:
                    errs = [max_err(a, w) for a, w in zip(got, want)]
                res[f"{label}/{name}/chunks={chunks}/bias={bias}"] = errs
    return res


@pytest.mark.timeout(TIMEOUT)
def test_mlp_block_equals_serial_and_twin_every_gradient_every_chunk_count():
    for res in run_distributed(_functional, 2, timeout=TIMEOUT - 20):
        assert len(res) == 3 * 2 * 5
        for case, errs in res.items():
            assert len(errs) == (6 if case.endswith("True") else 5), case
            assert max(errs) < TOL, (case, errs)


class _HFLike(nn.Module):
    """An fc1/fc2 + activation_fn MLP (CLIPMLP, PhiMLP)."""

    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.fc1, self.fc2, self.activation_fn = nn.Linear(d, f), nn.Linear(f, d), nn.GELU("tanh")

    def forward(self, x):
        return self.fc2(self.activation_fn(self.fc1(x)))


class _UpDown(nn.Module):
    """up_proj/down_proj + act_fn, no biases."""

    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.up_proj(x)))


class _BenchMLP(nn.Module):
    """The benchmark's MLP: children up/down and a function activation."""

    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, f), nn.Linear(f, d)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


def _style_case(base: nn.Module, mesh: Any, style: MC2MLPParallel) -> dict[str, Any]:
    r, ws = rank_and_size()
    par = parallelize_module(copy.deepcopy(base), mesh, style)
    xf = seeded(7, 2, M * ws // 2, D, dtype=torch.float64)
    dyf = seeded(8, 2, M * ws // 2, D, dtype=torch.float64)
    ref = copy.deepcopy(base)
    xr = xf.clone().requires_grad_()
    yr = ref(xr)
    yr.backward(dyf)
    blk = M // 2
    x = xf[:, r * blk : (r + 1) * blk].clone().requires_grad_()
    y = par(x)
    y.backward(dyf[:, r * blk : (r + 1) * blk])
    errs = [
        max_err(y, yr[:, r * blk : (r + 1) * blk]),
        max_err(x.grad, xr.grad[:, r * blk : (r + 1) * blk]),
    ]
    shapes = {}
    for (name, p), (_, q) in zip(par.named_parameters(), ref.named_parameters()):
        assert isinstance(p, DTensor)
        errs.append(max_err(p.grad.full_tensor(), q.grad))
        shapes[name] = tuple(p.to_local().shape)
    with FlopCounterMode(display=False) as fc:
        par(x.detach())
    with FlopCounterMode(display=False) as fs:
        ref(xf)
    is_par = is_mc2_parallel(par)
    unparallelize_mc2(par)
    return {
        "errs": errs, "shapes": shapes, "flops": (fc.get_total_flops(), fs.get_total_flops()),
        "is": (is_par, is_mc2_parallel(par), type(par) is type(base)),
    }  # fmt: skip


def _styles() -> dict[str, Any]:
    ws = rank_and_size()[1]
    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    f = FL * ws
    out = {}
    for name, base, style in (
        ("fc1", _HFLike(D, f), MC2MLPParallel(chunks=2)),
        ("up_proj", _UpDown(D, f), MC2MLPParallel(chunks=3, impl="torch")),
        ("bench", _BenchMLP(D, f), MC2MLPParallel(up="up", down="down", act=F.gelu)),
    ):
        out[name] = _style_case(base.double(), mesh, style)
    return out


@pytest.mark.timeout(TIMEOUT)
def test_style_equals_serial_module_splits_work_and_undoes():
    for res in run_distributed(_styles, 2, timeout=TIMEOUT - 20):
        for name, r in res.items():
            assert max(r["errs"]) < TOL and len(r["errs"]) >= 4, (name, r["errs"])
            ours, serial = r["flops"]
            assert serial > 0 and ours * 2 == serial, (name, r["flops"])  # half each, not all
            assert r["is"] == (True, False, True), name
        assert res["fc1"]["shapes"] == {
            "fc1.weight": (FL, D), "fc1.bias": (FL,), "fc2.weight": (D, FL), "fc2.bias": (D,),
        }  # fmt: skip
        assert res["up_proj"]["shapes"] == {"up_proj.weight": (FL, D), "down_proj.weight": (D, FL)}


def _link() -> dict[str, Any]:
    r, ws = rank_and_size()
    mesh = init_device_mesh("cpu", (ws,))
    X, Wu, Wd, bu, bd, dY = _full_operands(ws)
    rows, cols = slice(r * M, (r + 1) * M), slice(r * FL, (r + 1) * FL)

    def fn(chunks: int) -> list[torch.Tensor]:
        leaves = [
            t.clone().requires_grad_() for t in (X[rows], Wu[cols], Wd[:, cols], bu[cols], bd)
        ]
        y = mlp_block(*leaves[:3], act_fn=F.gelu, up_bias=leaves[3], down_bias=leaves[4],
                      impl="torch", chunks=chunks)  # fmt: skip
        y.backward(dY[rows])
        return [y.detach(), *(t.grad for t in leaves)]

    torch.manual_seed(0)
    base = _BenchMLP(D, FL * ws).double()

    def style() -> list[torch.Tensor]:
        par = parallelize_module(
            copy.deepcopy(base),
            mesh,
            MC2MLPParallel(act=F.gelu, up="up", down="down", chunks=2, sequence_dim=0),
        )
        x = X[rows].clone().requires_grad_()
        par(x).backward(dY[rows])
        return [x.grad, *(p.grad.to_local() for p in par.parameters())]

    cases = {f"chunks={c}": (lambda c=c: fn(c)) for c in (1, 2, 3, 4)}
    cases["style"] = style
    return compare_under_link(cases, 1e-3)


@pytest.mark.timeout(TIMEOUT)
def test_bitwise_identical_under_the_modeled_link():
    for res in run_distributed(_link, 2, timeout=TIMEOUT - 20):
        assert len(res) == 5
        for name, r in res.items():
            assert r["count"] >= 5 and all(r["equal"]), (name, r["equal"])
            assert r["collectives"] >= 4 and r["modeled_s"] >= 4e-3, (name, r)
        for c in (1, 2, 3, 4):
            # per chunk: X and dY gathered, Y and dx reduce-scattered; X is kept for backward,
            # not gathered again
            assert res[f"chunks={c}"]["collectives"] == 4 * c, res[f"chunks={c}"]


def _npu_double() -> dict[str, Any]:
    r = rank_and_size()[0]
    d, fl, m = 256, 256, 4  # the kernels' smallest contraction dim
    ops = [seeded(30 + i, *s) / 8 for i, s in enumerate([(m, d), (fl, d), (d, fl), (fl,), (d,)])]
    dy = seeded(40 + r, m, d)
    double = GlooMC2Double()
    out = {}
    for impl in ("npu", "torch"):
        leaves = [o.to(torch.bfloat16).clone().requires_grad_() for o in ops]
        with use_npu_ops(double):
            y = mlp_block(*leaves[:3], act_fn=F.silu, up_bias=leaves[3], down_bias=leaves[4],
                          impl=impl)  # fmt: skip
            y.backward(dy.to(torch.bfloat16))
        out[impl] = [y.detach(), *(t.grad for t in leaves)]
    return {
        "errs": [max_err(a, b) for a, b in zip(out["npu"], out["torch"])],
        "calls": [(c.op, c.x2_shape, c.kwargs.get("gather_output")) for c in double.calls],
    }


@pytest.mark.timeout(TIMEOUT)
def test_npu_path_through_kernel_double_equals_torch_impl():
    for res in run_distributed(_npu_double, 2, timeout=TIMEOUT - 20):
        assert len(res["errs"]) == 6 and max(res["errs"]) < 5e-2, res["errs"]
        assert res["calls"] == [
            ("npu_all_gather_base_mm", (256, 256), True),  # X kept for dW_u: no third gather
            ("npu_mm_reduce_scatter_base", (256, 256), None),
            ("npu_all_gather_base_mm", (256, 256), True),
            ("npu_mm_reduce_scatter_base", (256, 256), None),
        ]


class _Dropout(_UpDown):
    def __init__(self, d: int, f: int) -> None:
        super().__init__(d, f)
        self.dropout = nn.Dropout(0.1)


class _Nameless(nn.Module):
    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.w1, self.w2, self.act = nn.Linear(d, f), nn.Linear(f, d), nn.GELU()


def _rejections() -> dict[str, Any]:
    ws = rank_and_size()[1]
    mesh = init_device_mesh("cpu", (ws,))
    x = seeded(1, M, D, dtype=torch.float64)
    wu, wd = seeded(2, FL, D, dtype=torch.float64), seeded(3, D, FL, dtype=torch.float64)
    bu, bd = seeded(4, FL, dtype=torch.float64), seeded(5, D, dtype=torch.float64)
    dwd = distribute_tensor(wd, mesh, [Replicate()])
    calls = {
        "down weight shape": lambda: mlp_block(x, wu, wd.t(), act_fn=F.gelu),
        "down weight DTensor": lambda: mlp_block(x, wu, dwd, act_fn=F.gelu),
        "down bias shape": lambda: mlp_block(x, wu, wd, act_fn=F.gelu, down_bias=bu),
        "up bias shape": lambda: mlp_block(x, wu, wd, act_fn=F.gelu, up_bias=bd),
        "dtype": lambda: mlp_block(x, wu, wd.float(), act_fn=F.gelu),
        "impl": lambda: mlp_block(x, wu, wd, act_fn=F.gelu, impl="cuda"),
        "chunks": lambda: mlp_block(x, wu, wd, act_fn=F.gelu, chunks=0),
        "softmax": lambda: mlp_block(x, wu, wd, act_fn=nn.Softmax(dim=-1)),
        "inplace": lambda: mlp_block(x, wu, wd, act_fn=nn.ReLU(inplace=True)),
        "npu on cpu": lambda: mlp_block(x, wu, wd, act_fn=F.gelu, impl="npu"),
        "twin: down weight shape": lambda: mlp_block_reference(x, wu, wd.t(), act_fn=F.gelu),
        "style: no layout": lambda: parallelize_module(_Nameless(D, 8), mesh, MC2MLPParallel()),
        "style: dropout": lambda: parallelize_module(_Dropout(D, 8), mesh, MC2MLPParallel()),
        "style: F % tp": lambda: parallelize_module(_UpDown(D, 7), mesh, MC2MLPParallel()),
        "style: no act": lambda: parallelize_module(
            _Nameless(D, 8), mesh, MC2MLPParallel(up="w1", down="w2", act="act_fn")
        ),
        "style: not a linear": lambda: parallelize_module(
            _Nameless(D, 8), mesh, MC2MLPParallel(up="w1", down="act")
        ),
        "style: chunks": lambda: MC2MLPParallel(chunks=0),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except (ValueError, TypeError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    par = parallelize_module(_UpDown(D, 8).double(), mesh, MC2MLPParallel())
    for name, bad in (("style: input dtype", torch.zeros(2, M, D)), ("style: DTensor input",
                      distribute_tensor(torch.zeros(2, M, D, dtype=torch.float64), mesh,
                                        [Replicate()]))):  # fmt: skip
        try:
            par(bad)
            out[name] = None
        except (ValueError, TypeError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    out["group ok"] = group_still_works()
    return out


@pytest.mark.timeout(TIMEOUT)
def test_rejected_inputs_raise_on_every_rank_before_any_collective():
    res = run_distributed(_rejections, 2, timeout=TIMEOUT - 20)
    assert res[0] == res[1]  # the same error on every rank
    got = res[0]
    assert got.pop("group ok") is True
    expect = {
        "down weight shape": "ValueError: mlp_block: down weight must be [D, F/ws]",
        "down weight DTensor": "TypeError: mlp_block: down weight is a DTensor",
        "down bias shape": "ValueError: mlp_block: down bias must be the full, replicated",
        "up bias shape": "ValueError",
        "dtype": "TypeError: mlp_block: x is fp64 but down weight is fp32",
        "impl": "ValueError: impl must be one of",
        "chunks": "ValueError",
        "softmax": "ValueError: mlp_block: act_fn Softmax(dim=-1) is not known to be per-element",
        "inplace": "ValueError: mlp_block: act_fn ReLU(inplace=True) is in-place",
        "npu on cpu": "ValueError: impl='npu' cannot run mlp_block",
        "twin: down weight shape": "ValueError: mlp_block: down weight must be [D, F/ws]",
        "style: no layout": "ValueError: MC2MLPParallel: _Nameless has none of the known",
        "style: dropout": "ValueError: MC2MLPParallel: _Dropout.dropout is a dropout (p=0.1)",
        "style: F % tp": "ValueError: MC2MLPParallel: the intermediate size 7 is not divisible",
        "style: no act": "ValueError: MC2MLPParallel: _Nameless has no activation attribute",
        "style: not a linear": "TypeError: MC2MLPParallel: _Nameless.act (down) must be",
        "style: chunks": "ValueError: MC2MLPParallel: chunks must be a positive int",
        "style: input dtype": "TypeError: MC2MLPParallel: input is fp32",
        "style: DTensor input": "TypeError: MC2MLPParallel: the input must be this rank's",
    }
    assert set(got) == set(expect)
    for name, prefix in expect.items():
        assert got[name] is not None and got[name].startswith(prefix), (name, got[name])


SUBSETS = {  # which of (x, W_u, W_d, b_u, b_d) need a gradient
    "x": (True, False, False, False, False),
    "weights": (False, True, True, False, False),
    "down": (False, False, True, False, True),
    "up_bias": (False, False, False, True, False),
}


def _run_subset(fn: Any, chunks: int, need: tuple[bool, ...]) -> list[Any]:
    r, ws = rank_and_size()
    X, Wu, Wd, bu, bd, dY = _full_operands(ws)
    rows, cols = slice(r * M, (r + 1) * M), slice(r * FL, (r + 1) * FL)
    ops = (X[rows], Wu[cols], Wd[:, cols], bu[cols], bd)
    leaves = [o.clone().requires_grad_(n) for o, n in zip(ops, need)]
    y = fn(*leaves[:3], act_fn=F.silu, up_bias=leaves[3], down_bias=leaves[4], impl="torch",
           chunks=chunks)  # fmt: skip
    y.backward(dY[rows])
    return [y.detach(), *(t.grad for t in leaves)]


def _subsets_and_order() -> dict[str, Any]:
    import hyper_parallel.mc2._chunked as chunked_mod
    import hyper_parallel.mc2._pipeline as pipeline_mod

    res: dict[str, Any] = {}
    for chunks in (1, 2, 3, 5):
        for name, need in SUBSETS.items():
            got = _run_subset(mlp_block, chunks, need)
            want = _run_subset(mlp_block_reference, None, need)
            res[f"{name}/chunks={chunks}"] = [
                (a is None) == (b is None) and (a is None or max_err(a, b) < TOL)
                for a, b in zip(got, want)
            ]
    order: list[str] = []
    ag, rs = chunked_mod.all_gather_async, pipeline_mod.reduce_scatter_async

    def rec(kind: str, fn: Any) -> Any:
        return lambda *a: (order.append(kind), fn(*a))[1]

    chunked_mod.all_gather_async, pipeline_mod.reduce_scatter_async = rec("ag", ag), rec("rs", rs)
    try:
        _run_subset(mlp_block, 3, (True,) * 5)
    finally:
        chunked_mod.all_gather_async, pipeline_mod.reduce_scatter_async = ag, rs
    res["order"] = order
    return res


@pytest.mark.timeout(TIMEOUT)
def test_every_gradient_subset_equals_twin_and_the_collectives_interleave():
    for res in run_distributed(_subsets_and_order, 2, timeout=TIMEOUT - 20):
        order = res.pop("order")
        for case, ok in res.items():
            assert len(ok) == 6 and all(ok), (case, ok)
        # forward: 3 gathers of X, 3 reduce-scatters of Y; backward: 3 of dY, 3 of dx (X kept)
        assert order.count("ag") == 6 and order.count("rs") == 6, order
        fwd, bwd = order[:6], order[6:]
        assert fwd.index("rs") < max(i for i, o in enumerate(fwd) if o == "ag"), fwd
        assert bwd.index("rs") < max(i for i, o in enumerate(bwd) if o == "ag"), bwd
