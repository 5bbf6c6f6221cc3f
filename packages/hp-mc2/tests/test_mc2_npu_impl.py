"""The ``npu`` implementation through the torch_npu test double: same results as the
``torch`` implementation forward and backward, the exact kernel calls the README documents,
every kernel constraint giving its clear error, ``auto`` falling back with the reason, and HCCL
comm-name lookup."""

from __future__ import annotations

import sys

import pytest
import torch
from _mc2_npu_double import GlooMC2Double
from _mc2_testutil import column_reference, group_still_works, max_err, rank_and_size, seeded

from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.mc2 import (
    TorchNpuOps,
    all_gather_matmul,
    hccl_comm_name,
    matmul_reduce_scatter,
    select_backend,
    use_npu_ops,
)

TIMEOUT = 90.0
K = 256  # smallest contraction dim the kernels accept


def _shard(op: str, X, W, B, dY):
    """This rank's operands of the column (all_gather_matmul) or row form."""
    r, ws = rank_and_size()
    if op == "column":
        m, nl = X.shape[0] // ws, W.shape[0] // ws
        rows, cols = slice(r * m, (r + 1) * m), slice(r * nl, (r + 1) * nl)
        return X[rows], W[cols], B[cols], dY[:, cols]
    kl, mo = X.shape[1] // ws, X.shape[0] // ws
    cols = slice(r * kl, (r + 1) * kl)
    return X[:, cols], W[:, cols], B, dY[r * mo : (r + 1) * mo]


def _run(op: str, impl: str, X, W, B, dY, dtype):
    x, w, b, dy = _shard(op, X, W, B, dY)
    x, w, b = (t.to(dtype).clone().requires_grad_() for t in (x, w, b))
    fn = all_gather_matmul if op == "column" else matmul_reduce_scatter
    y = fn(x, w, None, bias=b, impl=impl, chunks=2)
    y.backward(dy.to(dtype))
    return y, x.grad, w.grad, b.grad


def _npu_vs_torch(op: str, dtype: torch.dtype) -> dict:
    r, ws = rank_and_size()
    m = 4
    if op == "column":  # n_local = K
        X, W, B, dY = (
            seeded(1, ws * m, K),
            seeded(2, ws * K, K),
            seeded(3, ws * K),
            seeded(4, ws * m, ws * K),
        )
    else:  # k_local = K, n = 2K
        X, W, B, dY = (
            seeded(1, ws * m, ws * K),
            seeded(2, 2 * K, ws * K),
            seeded(3, 2 * K),
            seeded(4, ws * m, 2 * K),
        )
    X, W = X / 4, W / 4
    double = GlooMC2Double()
    with use_npu_ops(double):
        x, w, _, _ = _shard(op, X, W, B, dY)
        name = "all_gather_matmul" if op == "column" else "matmul_reduce_scatter"
        choice = select_backend(name, x.to(dtype), w.to(dtype), None)
        got_npu = _run(op, "auto", X, W, B, dY, dtype)  # auto picks npu through the double
    calls = [(c.op, c.x2_transposed_view, c.kwargs) for c in double.calls]
    got_torch = _run(op, "torch", X, W, B, dY, dtype)
    # float64 truth, sliced like the outputs of this rank
    Y, dX, dW, dB = column_reference(X, W, B, dY)
    if op == "column":
        nl = W.shape[0] // ws
        cols, rows = slice(r * nl, (r + 1) * nl), slice(r * m, (r + 1) * m)
        truth = (Y[:, cols], dX[rows], dW[cols], dB[cols])
    else:
        kl = X.shape[1] // ws
        cols, rows = slice(r * kl, (r + 1) * kl), slice(r * m, (r + 1) * m)
        truth = (Y[rows], dX[:, cols], dW[:, cols], dB)
    return {
        "choice": choice,
        "calls": calls,
        "npu_vs_torch": [max_err(a, b.double()) for a, b in zip(got_npu, got_torch)],
        "npu_vs_f64": [max_err(a, t) for a, t in zip(got_npu, truth)],
        "torch_vs_f64": [max_err(a, t) for a, t in zip(got_torch, truth)],
    }


@pytest.mark.parametrize(
    "op,dtype,world_size",
    [
        ("column", torch.bfloat16, 2),
        ("column", torch.bfloat16, 4),
        ("column", torch.float16, 2),
        ("row", torch.bfloat16, 2),
        ("row", torch.bfloat16, 4),
        ("row", torch.float16, 4),
    ],
    ids=lambda v: {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(v, str(v)),
)
def test_npu_impl_through_double_equals_torch_impl(op, dtype, world_size):
    results = run_distributed(_npu_vs_torch, world_size, op, dtype, timeout=TIMEOUT)
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    for res in results:
        assert res["choice"][0] == "npu", res["choice"]
        for key in ("npu_vs_torch", "npu_vs_f64", "torch_vs_f64"):
            assert max(res[key]) <= tol, (key, res[key])
        gather = (
            "npu_all_gather_base_mm",
            {"bias": None, "gather_index": 0, "gather_output": True},
        )
        scatter = ("npu_mm_reduce_scatter_base", {"bias": None, "reduce_op": "sum"})
        # forward passes w.t() (a transposed view), backward passes w itself.
        if op == "column":
            expected = [(gather[0], True, gather[1]), (scatter[0], False, scatter[1])]
        else:
            expected = [(scatter[0], True, scatter[1]), (gather[0], False, gather[1])]
        assert res["calls"] == expected


def _violation(case: str) -> dict:
    """Return select_backend's answer, the forced-npu error and the kernel double's own error
    for one violated constraint; prove the forced call communicated nothing."""
    _, ws = rank_and_size()
    bf, fp = torch.bfloat16, torch.float16
    double = GlooMC2Double()
    # op, x, w (as the public API takes them), kernel op, kernel operands
    m = 2 * ws
    if case == "fp32":
        op, x, w = "all_gather_matmul", torch.ones(m, K), torch.ones(K, K)
    elif case == "dtype_mix":
        op, x, w = "all_gather_matmul", torch.ones(m, K, dtype=bf), torch.ones(K, K, dtype=fp)
    elif case == "small_k":
        op, x, w = "all_gather_matmul", torch.ones(m, 128, dtype=bf), torch.ones(K, 128, dtype=bf)
    elif case == "small_backward_k":
        op, x, w = "all_gather_matmul", torch.ones(m, K, dtype=bf), torch.ones(128, K, dtype=bf)
    elif case == "world_size":
        op, x, w = "matmul_reduce_scatter", torch.ones(m, K, dtype=bf), torch.ones(K, K, dtype=bf)
    elif case == "m_not_divisible":
        op, x, w = (
            "matmul_reduce_scatter",
            torch.ones(m + 1, K, dtype=bf),
            torch.ones(K, K, dtype=bf),
        )
    else:
        raise AssertionError(case)
    with use_npu_ops(double):
        choice = select_backend(op, x, w, None)
        hcom = double.comm_name(None)
        forced_err = None
        try:
            (all_gather_matmul if op == "all_gather_matmul" else matmul_reduce_scatter)(
                x, w, None, impl="npu"
            )
        except (ValueError, TypeError) as exc:
            forced_err = f"{type(exc).__name__}: {exc}"
        forced_calls = len(double.calls)
        # The kernel itself, on the operands the npu implementation would hand it.
        if case == "small_backward_k":
            kx, kw, kop = torch.ones(ws * m, 128, dtype=bf), w, double.npu_mm_reduce_scatter_base
        elif op == "all_gather_matmul":
            kx, kw, kop = x, w.t(), double.npu_all_gather_base_mm
        else:
            kx, kw, kop = x, w.t(), double.npu_mm_reduce_scatter_base
        try:
            kop(kx, kw, hcom, ws)
            kernel_err = None
        except RuntimeError as exc:
            kernel_err = str(exc)
    return {
        "choice": choice,
        "forced": forced_err,
        "forced_calls": forced_calls,
        "kernel": kernel_err,
        "group_ok": group_still_works(),
    }


VIOLATIONS = [
    # case, world size, phrase in select_backend's reason and the kernel's error, forced error type
    ("fp32", 2, "fp32 is not supported by the NPU kernels", "ValueError"),
    ("dtype_mix", 2, "x is bf16 but weight is fp16", "TypeError"),
    ("small_k", 2, "k=128 outside [256, 65535)", "ValueError"),
    ("small_backward_k", 2, "k=128 outside [256, 65535)", "ValueError"),
    ("world_size", 3, "world size 3 not in {2, 4, 8}", "ValueError"),
    ("m_not_divisible", 2, "m=5 not divisible by world size 2", "ValueError"),
]


@pytest.mark.parametrize(
    "case,world_size,phrase,forced_type", VIOLATIONS, ids=[v[0] for v in VIOLATIONS]
)
def test_each_kernel_constraint_gives_its_error_and_auto_falls_back(
    case, world_size, phrase, forced_type
):
    for res in run_distributed(_violation, world_size, case, timeout=TIMEOUT):
        assert res["choice"][0] == "torch" and phrase in res["choice"][1], res["choice"]
        assert res["kernel"] is not None and phrase in res["kernel"], res["kernel"]
        assert res["forced"] is not None and res["forced"].startswith(forced_type), res["forced"]
        if forced_type == "ValueError" and case != "m_not_divisible":
            assert phrase in res["forced"], res["forced"]
        assert res["forced_calls"] == 0 and res["group_ok"]


def _without_provider() -> tuple:
    x, w = torch.ones(4, K, dtype=torch.bfloat16), torch.ones(K, K, dtype=torch.bfloat16)
    choice = select_backend("all_gather_matmul", x, w, None)
    try:
        all_gather_matmul(x, w, None, impl="npu")
        forced = None
    except ValueError as exc:
        forced = str(exc)
    return choice, forced, "torch_npu" in sys.modules, group_still_works()


def test_auto_on_cpu_without_npu_falls_back_and_never_imports_torch_npu():
    for choice, forced, imported, ok in run_distributed(_without_provider, 2, timeout=TIMEOUT):
        assert choice == ("torch", "tensors are on cpu, not npu")
        assert forced is not None and "impl='npu' cannot run all_gather_matmul" in forced
        assert "tensors are on cpu, not npu" in forced
        assert not imported and ok


class _NewBackend:
    def __init__(self, log):
        self.log = log

    def get_hccl_comm_name(self, rank):
        self.log.append(("backend", rank))
        return f"hcom-new-{rank}"


class _NewGroup:
    def __init__(self):
        self.log = []

    def _get_backend(self, device):
        self.log.append(("device", device.type))
        return _NewBackend(self.log)


class _OldGroup:
    def __init__(self):
        self.log = []

    def get_hccl_comm_name(self, rank):
        self.log.append(("group", rank))
        return f"hcom-old-{rank}"


def _comm_names() -> list:
    # torch.device("npu") needs a registered "npu" device type; name PrivateUse1 so in this
    # throwaway rank process only, as torch_npu does when imported.
    torch.utils.rename_privateuse1_backend("npu")
    out = []
    for version in ("2.1.0", "2.7.1", "2.12.0"):
        g = _NewGroup()
        out.append((hccl_comm_name(g, 3, torch_version=version), g.log))
    g = _OldGroup()
    out.append((hccl_comm_name(g, 5, torch_version="2.0.1"), g.log))
    out.append((hccl_comm_name(g, 1, torch_version="1.11.0"), g.log))
    try:
        hccl_comm_name(object(), 0, torch_version="2.7.1")
        out.append(None)
    except TypeError as exc:
        out.append(str(exc))
    return out


def test_hccl_comm_name_resolution_on_every_torch_npu_generation():
    (res,) = run_distributed(_comm_names, 1, timeout=TIMEOUT)
    new_log = [("device", "npu"), ("backend", 3)]
    # torch > 2.0.1: group._get_backend(npu).get_hccl_comm_name(rank)
    assert res[:3] == [("hcom-new-3", new_log)] * 3
    # torch <= 2.0.1: the group's own get_hccl_comm_name(rank)
    assert res[3][0] == "hcom-old-5" and res[4][0] == "hcom-old-1"
    assert res[4][1] == [("group", 5), ("group", 1)]
    assert res[5] is not None and "cannot get an HCCL communicator name" in res[5]


def test_default_provider_reports_missing_torch_npu_without_importing_it():
    ops = TorchNpuOps()
    reason = ops.available()
    assert reason is not None and reason.startswith("torch_npu is not")
    assert ops.device_type == "npu"


class _NoScatterDouble(GlooMC2Double):
    npu_mm_reduce_scatter_base = None  # a torch_npu without the second kernel


def _through_the_dtensor_seam() -> dict:
    """A double installed with hp-dtensor's ``use_npu_ops`` (not hp-mc2's name for it) is the
    provider hp-mc2's ``npu`` implementation calls."""
    import hyper_parallel.dtensor.npu as seam
    import hyper_parallel.mc2 as mc2

    x = torch.ones(2, K, dtype=torch.bfloat16)
    w = torch.ones(K, K, dtype=torch.bfloat16)
    double = GlooMC2Double()
    with seam.use_npu_ops(double):
        seen = mc2.current_npu_ops()
        choice = select_backend("all_gather_matmul", x, w, None)
        y = all_gather_matmul(x, w, None, impl="npu")
    with seam.use_npu_ops(_NoScatterDouble()):
        missing = select_backend("all_gather_matmul", x, w, None)
    return {
        "same_functions": (
            mc2.current_npu_ops is seam.current_npu_ops
            and mc2.use_npu_ops is seam.use_npu_ops
            and mc2.hccl_comm_name is seam.hccl_comm_name
        ),
        "seen": seen is double,
        "choice": choice,
        "ops": [c.op for c in double.calls],
        "y": y.float().unique().tolist(),
        "missing": missing,
    }


def test_a_double_installed_through_hp_dtensor_is_what_the_npu_impl_calls():
    for res in run_distributed(_through_the_dtensor_seam, 2, timeout=TIMEOUT):
        assert res["same_functions"] and res["seen"]
        assert res["choice"][0] == "npu", res["choice"]
        assert res["ops"] == ["npu_all_gather_base_mm"]
        assert res["y"] == [float(K)]
        # the availability check asks for both MC2 kernels by name
        assert res["missing"] == ("torch", "_NoScatterDouble has no npu_mm_reduce_scatter_base")
