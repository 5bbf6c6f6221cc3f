"""The ``npu`` local backend through a torch_npu double (``_moe_npu_double``): permute, unpermute
and the expert GEMMs equal the ``torch`` reference backend forward and backward; the whole
expert-parallel forward on 2 gloo ranks through ``impl="npu"`` equals the stock module; the
backend's own backward stands in for npu_grouped_matmul's missing derivative; ``select_impl``
says why ``npu`` is or is not chosen, and the default provider never imports torch_npu on a
machine without it."""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _moe_npu_double import NpuMoeOpsDouble
from _moe_testutil import (
    TIMEOUT,
    E,
    H,
    ep_mesh,
    local_grad,
    routing,
    serial_reference,
    stock_experts,
)

from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.moe import (
    IMPLS,
    ExpertsShape,
    NpuExperts,
    TorchNpuOps,
    current_npu_ops,
    experts_info,
    parallelize_experts,
    select_impl,
    use_npu_ops,
)
from hyper_parallel.moe.local import TorchExperts

TORCH, NPU = TorchExperts(), NpuExperts()
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _index(n: int, k: int, experts: int, seed: int) -> torch.Tensor:
    g = _gen(seed)
    rows = [torch.randperm(experts, generator=g)[:k] for _ in range(n)]
    return torch.stack(rows).reshape(n, k) if rows else torch.zeros(0, k, dtype=torch.long)


# --- (a) single process: NpuExperts (through the double) vs TorchExperts ------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(7, 2), (5, 4), (1, 1)])
def test_permute_gives_the_reference_rows_order_and_gradient(n, k, dtype):
    hidden = torch.randn(n, H, generator=_gen(1)).to(dtype)
    idx = _index(n, k, E, seed=2)
    dy = torch.randn(n * k, H, generator=_gen(3)).to(dtype)
    double = NpuMoeOpsDouble()
    got = {}
    for name, backend in (("torch", TORCH), ("npu", NPU)):
        h = hidden.clone().requires_grad_(True)
        with use_npu_ops(double):
            rows, order = backend.permute(h, idx)
        rows.backward(dy)
        got[name] = (rows.detach(), order, h.grad)
    assert double.ops() == ["npu_moe_token_permute"]
    assert torch.equal(got["npu"][1], got["torch"][1])  # ties keep (token, slot) order
    assert torch.equal(got["npu"][0], got["torch"][0])
    _close(got["npu"][2], got["torch"][2], TOL[dtype])


@pytest.mark.parametrize(
    "rows_dtype,weights_dtype,out_dtype",
    [
        (torch.float32, torch.float32, torch.float32),
        (torch.bfloat16, torch.float32, torch.float32),  # autocast: bf16 rows, fp32 model
        (torch.bfloat16, torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float64, torch.float32),  # fp64 weights: combined in fp32
    ],
)
def test_unpermute_weights_and_sums_like_the_reference(rows_dtype, weights_dtype, out_dtype):
    n, k = 9, 3
    idx = _index(n, k, E, seed=4)
    _, order = TORCH.permute(torch.zeros(n, H), idx)
    rows0 = torch.randn(n * k, H, generator=_gen(5)).to(rows_dtype)
    w0 = torch.rand(n, k, generator=_gen(6), dtype=torch.float64).to(weights_dtype)
    dy = torch.randn(n, H, generator=_gen(7)).to(out_dtype)
    double = NpuMoeOpsDouble()
    got = {}
    for name, backend in (("torch", TORCH), ("npu", NPU)):
        rows, w = rows0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        with use_npu_ops(double):
            out = backend.unpermute(rows, order, w, out_dtype)
        out.backward(dy)
        got[name] = (out.detach(), rows.grad, w.grad)
    assert double.ops() == ["npu_moe_token_unpermute"]
    assert double.calls[0].kwargs == {"probs": True, "padded_mode": False}
    tol = max(TOL[rows_dtype], TOL[out_dtype])
    for a, b in zip(got["npu"], got["torch"]):
        _close(a, b, tol)


def _experts_run(backend, x0, counts, gu0, dn0, dy, double):
    x, gu, dn = (t.clone().requires_grad_(True) for t in (x0, gu0, dn0))
    with use_npu_ops(double):
        y = backend.experts(x, counts, gu, dn, F.silu)
        y.backward(dy)
    return y.detach(), x.grad, gu.grad, dn.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [4], [0, 0, 6], [1, 1]])
def test_grouped_matmul_experts_equal_the_reference_forward_and_backward(counts, dtype):
    i = 8
    m = sum(counts)
    x0 = torch.randn(m, H, generator=_gen(8)).to(dtype)
    gu0 = (torch.randn(len(counts), 2 * i, H, generator=_gen(9)) * 0.3).to(dtype)
    dn0 = (torch.randn(len(counts), H, i, generator=_gen(10)) * 0.3).to(dtype)
    dy = torch.randn(m, H, generator=_gen(11)).to(dtype)
    double = NpuMoeOpsDouble()
    want = _experts_run(TORCH, x0, counts, gu0, dn0, dy, NpuMoeOpsDouble())
    got = _experts_run(NPU, x0, counts, gu0, dn0, dy, double)
    for a, b in zip(got, want):
        _close(a, b, TOL[dtype])
    # two grouped matmuls forward (transposed weight views), two for dx in backward
    assert double.ops() == ["npu_grouped_matmul"] * 4
    assert [c.weight_transposed for c in double.calls] == [True, True, False, False]
    for c in double.calls:
        assert c.kwargs == {
            "split_item": 3,
            "group_type": 0,
            "group_list_type": 0,
            "group_list": "Tensor",
        }
    assert got[2].is_contiguous() and got[3].is_contiguous()  # weight gradients


def test_the_double_grouped_matmul_has_no_derivative_like_torch_npu():
    double = NpuMoeOpsDouble()
    x = torch.randn(4, H, requires_grad=True)
    w = torch.randn(2, H, 8)
    y = double.npu_grouped_matmul(
        [x], [w], group_list=torch.tensor([1, 4]), split_item=3, group_type=0
    )[0]
    with pytest.raises(RuntimeError, match="derivative for npu_grouped_matmul is not implemented"):
        y.sum().backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_permute_experts_unpermute_end_to_end_equal_the_reference(dtype):
    n, k, e_l, i = 11, 2, 4, 8
    idx = _index(n, k, e_l, seed=12)
    h0 = torch.randn(n, H, generator=_gen(13)).to(dtype)
    w0 = torch.rand(n, k, generator=_gen(14))
    gu0 = (torch.randn(e_l, 2 * i, H, generator=_gen(15)) * 0.3).to(dtype)
    dn0 = (torch.randn(e_l, H, i, generator=_gen(16)) * 0.3).to(dtype)
    dy = torch.randn(n, H, generator=_gen(17)).to(dtype)
    counts = torch.bincount(idx.reshape(-1), minlength=e_l).tolist()
    got = {}
    for name, backend in (("torch", TORCH), ("npu", NPU)):
        h, w, gu, dn = (t.clone().requires_grad_(True) for t in (h0, w0, gu0, dn0))
        with use_npu_ops(NpuMoeOpsDouble()):
            rows, order = backend.permute(h, idx)
            y = backend.experts(rows, counts, gu, dn, F.silu)
            out = backend.unpermute(y, order, w, dtype)
        out.backward(dy)
        got[name] = (out.detach(), h.grad, w.grad, gu.grad, dn.grad)
    for a, b in zip(got["npu"], got["torch"]):
        _close(a, b, 4 * TOL[dtype])


def test_calls_outside_the_ops_limits_run_the_reference_without_calling_them():
    double = NpuMoeOpsDouble()
    with use_npu_ops(double):
        # no tokens, no rows
        rows, order = NPU.permute(torch.zeros(0, H), torch.zeros(0, 2, dtype=torch.long))
        assert rows.shape == (0, H) and order.shape == (0,)
        out = NPU.unpermute(rows, order, torch.zeros(0, 2), torch.float32)
        assert out.shape == (0, H)
        gu = torch.randn(2, 16, H, requires_grad=True)
        dn = torch.randn(2, H, 8, requires_grad=True)
        y = NPU.experts(torch.zeros(0, H), [0, 0], gu, dn, F.silu)
        y.sum().backward()  # the weights stay in the graph (zero gradients)
        assert gu.grad is not None and not gu.grad.any()
        # more slots than the token ops take (K > 512)
        k = 513
        idx = torch.arange(k).reshape(1, k)
        h = torch.randn(1, H)
        rows, order = NPU.permute(h, idx)
        ref_rows, ref_order = TORCH.permute(h, idx)
        assert torch.equal(rows, ref_rows) and torch.equal(order, ref_order)
        w = torch.rand(1, k)
        _close(
            NPU.unpermute(rows, order, w, torch.float32),
            TORCH.unpermute(rows, order, w, torch.float32),
            1e-5,
        )
    assert double.calls == []


def test_the_double_checks_what_the_docs_state():
    d = NpuMoeOpsDouble()
    tok, idx = torch.randn(3, H), torch.zeros(3, 2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="npu_moe_token_permute: tokens must be float16"):
        d.npu_moe_token_permute(tok.double(), idx)
    with pytest.raises(RuntimeError, match="padded_mode=True is not supported"):
        d.npu_moe_token_permute(tok, idx, padded_mode=True)
    with pytest.raises(RuntimeError, match="indices must be int32 or int64"):
        d.npu_moe_token_permute(tok, idx.short())
    rows, s = d.npu_moe_token_permute(tok, idx, num_out_tokens=-2)
    assert rows.shape == (4, H) and s.shape == (6,) and s.dtype == torch.int32
    assert d.npu_moe_token_permute(tok, idx, num_out_tokens=5)[0].shape == (5, H)
    with pytest.raises(RuntimeError, match="sorted_indices must be int32"):
        d.npu_moe_token_unpermute(torch.randn(6, H), s.long(), probs=torch.rand(3, 2))
    with pytest.raises(RuntimeError, match="a permutation of"):
        d.npu_moe_token_unpermute(torch.randn(6, H), torch.zeros(6, dtype=torch.int32))
    # probs may have another float dtype than the tokens; the output has the tokens' dtype
    out = d.npu_moe_token_unpermute(torch.randn(6, H).bfloat16(), s, probs=torch.rand(3, 2))
    assert out.dtype == torch.bfloat16 and out.shape == (3, H)
    x, w = torch.randn(5, H), torch.randn(2, H, 8)
    ends = torch.tensor([2, 5])
    with pytest.raises(RuntimeError, match="npu_grouped_matmul: x must be float16"):
        d.npu_grouped_matmul(
            [x.double()], [w.double()], group_list=ends, split_item=3, group_type=0
        )
    with pytest.raises(RuntimeError, match="must equal m=5"):
        d.npu_grouped_matmul([x], [w], group_list=torch.tensor([2, 4]), split_item=3, group_type=0)
    with pytest.raises(RuntimeError, match="not just one"):
        d.npu_grouped_matmul(
            [x], [w[:1]], group_list=torch.tensor([5]), split_item=3, group_type=0,
            group_list_type=1,
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="x must not be transposed"):
        xt = torch.randn(H, 5).t()
        d.npu_grouped_matmul([xt], [w], group_list=ends, split_item=3, group_type=0)
    y = d.npu_grouped_matmul(
        [x], [w], group_list=torch.tensor([2, 3]), split_item=2, group_type=0, group_list_type=1
    )[0]
    _close(y, torch.cat([x[:2] @ w[0], x[2:] @ w[1]]), 1e-5)


# --- (b) the expert-parallel forward through impl="npu" on 2 gloo ranks -------------------------


def _ep_rank(cases: list) -> list[dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for sizes, chunks, seed in cases:
        inputs = [
            tuple(
                t.float() if t.is_floating_point() else t for t in routing(s, sizes[s], seed=seed)
            )
            for s in range(world)
        ]
        g = torch.Generator().manual_seed(seed + 77)
        grads = [torch.randn(n, H, generator=g) for n in sizes]
        ref = serial_reference(
            stock_experts(),
            [tuple(t.double() if t.is_floating_point() else t for t in x) for x in inputs],
            [gr.double() for gr in grads],
        )
        got = {}
        for impl in ("npu", "torch"):
            double = NpuMoeOpsDouble()
            with use_npu_ops(double):
                m = parallelize_experts(
                    stock_experts(dtype=torch.float32), ep_mesh(), impl=impl, chunks=chunks
                )
                h, i, w = inputs[rank]
                h, w = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
                out = m(h, i, w)
                out.backward(grads[rank])
            got[impl] = {
                "out": out.detach(),
                "dh": h.grad,
                "dw": w.grad,
                "gate_up_proj": local_grad(m.gate_up_proj),
                "down_proj": local_grad(m.down_proj),
                "impl": experts_info(m)["impl"],
                "ops": sorted(set(double.ops())),
            }
        e_l = E // world
        own = slice(rank * e_l, (rank + 1) * e_l)
        want = {
            "out": ref["out"][rank],
            "dh": ref["dh"][rank],
            "dw": ref["dw"][rank],
            "gate_up_proj": ref["gate_up_proj"][own],
            "down_proj": ref["down_proj"][own],
        }
        results.append({"got": got, "want": want})
    return results


EP_CASES = [([6, 9], 2, 0), ([7, 0], "auto", 1)]  # (tokens per rank, chunks, seed)


def test_expert_parallel_forward_through_npu_equals_the_stock_module():
    ranks = run_distributed(_ep_rank, 2, EP_CASES, timeout=TIMEOUT)
    for rank, results in enumerate(ranks):
        for (sizes, _, _), res in zip(EP_CASES, results):
            npu, torch_ep, want = res["got"]["npu"], res["got"]["torch"], res["want"]
            assert npu["impl"] == "npu" and torch_ep["impl"] == "torch"
            assert torch_ep["ops"] == []
            # every rank runs the grouped matmuls (it holds experts that receive rows); the token
            # ops run where the rank has tokens
            expect = {"npu_grouped_matmul"}
            if sizes[rank]:
                expect |= {"npu_moe_token_permute", "npu_moe_token_unpermute"}
            assert set(npu["ops"]) == expect, (rank, sizes, npu["ops"])
            for key in ("out", "dh", "dw", "gate_up_proj", "down_proj"):
                assert npu[key].dtype == torch.float32, key
                _close(npu[key].double(), want[key], 1e-4)
                _close(npu[key], torch_ep[key], 1e-5)


# --- (c) select_impl and the default provider --------------------------------------------------

SHAPE = ExpertsShape(E, H, 8)


def test_auto_on_cpu_never_picks_npu_even_with_ops_installed():
    assert "npu" in IMPLS and isinstance(IMPLS["npu"], NpuExperts)
    for provider in (current_npu_ops(), NpuMoeOpsDouble()):
        with use_npu_ops(provider):
            backend, why = select_impl("auto", "cpu", torch.float32, SHAPE)
        assert backend.name == "torch", why
        assert "no fused local backend on cpu" in why


def test_npu_requested_without_its_ops_raises_naming_why():
    with pytest.raises(
        ValueError, match="impl='npu' cannot run here: its ops take npu tensors, not cpu"
    ):
        select_impl("npu", "cpu", torch.float32, SHAPE)
    with use_npu_ops(NpuMoeOpsDouble(unavailable_reason="no NPU in this test")):
        with pytest.raises(ValueError, match="no NPU in this test"):
            select_impl("npu", "cpu", torch.float32, SHAPE)


@pytest.mark.parametrize(
    "dtype,shape,phrase",
    [
        (torch.float64, SHAPE, "take float16/bfloat16/float32, not torch.float64"),
        (torch.float32, ExpertsShape(E, 65536, 8), "inner dims < 65536 (H=65536)"),
        (torch.bfloat16, ExpertsShape(E, H, 32768), "inner dims < 65536 (2I=65536)"),
    ],
)
def test_each_constraint_refuses_npu_with_its_reason_and_auto_falls_back(dtype, shape, phrase):
    with use_npu_ops(NpuMoeOpsDouble()):
        assert select_impl("npu", "cpu", torch.float32, SHAPE)[0].name == "npu"
        with pytest.raises(ValueError, match=re.escape(phrase)):
            select_impl("npu", "cpu", dtype, shape)
    with use_npu_ops(NpuMoeOpsDouble(device_type="npu")):  # as on an NPU machine
        backend, why = select_impl("auto", "npu", torch.bfloat16, SHAPE)
        assert backend.name == "npu" and "constraints hold" in why
        backend, why = select_impl("auto", "npu", dtype, shape)
        assert backend.name == "torch" and phrase in why


@pytest.mark.skipif(
    importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed here"
)
def test_default_provider_reports_torch_npu_missing_without_importing_it():
    assert isinstance(current_npu_ops(), TorchNpuOps)
    assert TorchNpuOps().available() == "torch_npu is not installed"
    with pytest.raises(ValueError, match="impl='npu' cannot run here: torch_npu is not installed"):
        select_impl("npu", "npu", torch.bfloat16, SHAPE)
    backend, why = select_impl("auto", "npu", torch.bfloat16, SHAPE)
    assert backend.name == "torch" and "torch_npu is not installed" in why
    assert "torch_npu" not in sys.modules
