"""The attention seam (``attention.attend``): the NPU branch through
``torch_npu.npu_fusion_attention`` equals the sdpa reference, forward and every gradient,
float64, driven on CPU by a test double of the op (``_npu_attention_double``: it computes the
attention from its arguments, per sequence, and checks the layout, the cumulative offsets
and the causal mode it is given).

- Direct calls: plain causal (BSND, B = 2) and packed documents (TND; documents of length 1,
  inside the sequence, a single one), dq != dv (the narrower operand zero-padded).
- ``parallelize_mla`` on the stock Hugging Face modules, 2 gloo ranks (one spawn), both
  strategies, overlap on and off, with the branch forced to npu inside the ranks: output,
  input gradient and every parameter gradient equal the same run on the sdpa branch and the
  serial module on each document alone (documents at the rank boundary, inside a block, of
  length 1); the double saw TND with the documents' end offsets, or BSND for plain causal.
- The choice: npu only for float16/bfloat16/float32 on an ``npu`` device; torch_npu is never
  imported on the sdpa branch.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from _cp_hf import build, call, cp_mesh, rope_tables
from _npu_attention_double import Call, NpuFusionAttentionDouble
from test_context_parallel_packed import _inputs, _positions, _reference

from hyper_parallel.context_parallel import attention, parallelize_mla
from hyper_parallel.dtensor.testing import run_distributed

SEQ = 16
TOL = {"rtol": 1e-10, "atol": 1e-10}


def _qkv(b: int, s: int, h: int = 3, dq: int = 10, dv: int = 5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(b, s, h, dq), (b, s, h, dq), (b, s, h, dv)]
    return [torch.randn(*sh, dtype=torch.float64, generator=g).requires_grad_() for sh in shapes]


def _fwd_bwd(qkv: list[torch.Tensor], cu: torch.Tensor | None) -> tuple[torch.Tensor, list]:
    out = attention.attend(*qkv, 0.3, cu)
    g = torch.Generator().manual_seed(1)
    grads = torch.autograd.grad(out, qkv, torch.randn(out.shape, dtype=out.dtype, generator=g))
    return out.detach(), list(grads)


@pytest.mark.parametrize(
    "batch, offsets",
    [(2, None), (1, [0, 1, 5, 6, 11, 12]), (1, [0, 12]), (1, [0, 3, 12])],
)
@pytest.mark.parametrize("dims", [(10, 5), (4, 7), (6, 6)])
def test_npu_branch_equals_sdpa(monkeypatch, batch, offsets, dims) -> None:
    double = NpuFusionAttentionDouble()
    monkeypatch.setitem(sys.modules, "torch_npu", double.module())
    cu = None if offsets is None else torch.tensor(offsets)
    qkv = _qkv(batch, 12, dq=dims[0], dv=dims[1])
    want, want_grads = _fwd_bwd(qkv, cu)  # sdpa (cpu tensors)
    assert double.calls == []
    with attention._force_backend("npu"):
        got, got_grads = _fwd_bwd(qkv, cu)
    torch.testing.assert_close(got, want, **TOL)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, **TOL)
    (c,) = double.calls
    d = max(dims)
    if offsets is None:
        assert (c.layout, c.actual_seq_qlen, c.actual_seq_kvlen) == ("BSND", None, None)
        assert c.shapes == ((batch, 12, 3, d),) * 3
    else:
        assert c.layout == "TND"
        assert c.actual_seq_qlen == c.actual_seq_kvlen == offsets[1:]  # cumulative ends
        assert c.shapes == ((12, 3, d),) * 3
    assert (c.head_num, c.sparse_mode, c.scale) == (3, 3, 0.3)
    if offsets is not None and len(offsets) > 2:  # the documents change the answer
        assert not torch.allclose(got, _fwd_bwd(qkv, None)[0])


def test_backend_choice_and_no_torch_npu_import_on_sdpa(monkeypatch) -> None:
    assert attention.attention_backend("npu", torch.bfloat16) == "npu"
    assert attention.attention_backend("npu", torch.float16) == "npu"
    assert attention.attention_backend("npu", torch.float32) == "npu"
    assert attention.attention_backend("npu", torch.float64) == "sdpa"  # the op has no fp64
    assert attention.attention_backend("cpu", torch.float32) == "sdpa"
    assert attention.attention_backend("cuda", torch.bfloat16) == "sdpa"
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    attention.attend(*_qkv(1, 4), 0.5, torch.tensor([0, 1, 4]))
    attention.attend(*_qkv(2, 4), 0.5)
    assert "torch_npu" not in sys.modules
    with pytest.raises(ValueError, match="backend must be one of"):
        with attention._force_backend("cuda"):
            pass


def test_double_rejects_what_the_op_rejects() -> None:
    """The double is strict: a non-cumulative or tensor table, a missing mask fail."""
    op = NpuFusionAttentionDouble().npu_fusion_attention
    q = torch.randn(6, 2, 4, dtype=torch.float64)
    mask = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    kw: dict[str, Any] = {"atten_mask": mask, "sparse_mode": 3}
    ok = op(q, q, q, 2, "TND", actual_seq_qlen=[2, 6], actual_seq_kvlen=[2, 6], **kw)[0]
    assert ok.shape == (6, 2, 4)
    with pytest.raises(RuntimeError, match="strictly increasing cumulative"):
        op(q, q, q, 2, "TND", actual_seq_qlen=[2, 4], actual_seq_kvlen=[2, 4], **kw)
    with pytest.raises(RuntimeError, match="host int list"):
        t = torch.tensor([2, 6])
        op(q, q, q, 2, "TND", actual_seq_qlen=t, actual_seq_kvlen=t, **kw)
    with pytest.raises(RuntimeError, match="compressed causal"):
        op(q, q, q, 2, "TND", actual_seq_qlen=[6], actual_seq_kvlen=[6], sparse_mode=3)


# ---- through parallelize_mla on 2 ranks -----------------------------------------------------
TABLES = ([0, 8, 16], [0, 1, 3, 12, 13, 16], None)  # rank boundary, inside + length 1, causal
# (variant, strategy, overlap, table)
CASES = [
    ("deepseek_interleave", "expanded", True, 1),
    ("deepseek_rotate_half_yarn_qlora", "latent", False, 0),
    ("kimi_qlora", "latent", True, 1),
    ("kimi_qlora", "expanded", False, 0),
    ("deepseek_interleave", "latent", True, 2),
    ("kimi_qlora", "expanded", True, 2),
]


def _run_case(case: tuple, mesh: Any, backend: str) -> dict[str, Any]:
    variant, strategy, overlap, t = case
    p, r = mesh.size(), mesh.get_local_rank()
    s = SEQ // p
    offsets = TABLES[t] or [0, SEQ]
    m = build(variant)
    parallelize_mla(m, mesh, strategy=strategy, overlap=overlap)
    x, dy = _inputs()
    xl = x[:, r * s : (r + 1) * s].clone().requires_grad_()
    pos = _positions(offsets)[r * s : (r + 1) * s]
    kw: dict[str, Any] = {}
    if TABLES[t] is not None:
        kw["cu_seqlens"] = torch.tensor(offsets, dtype=torch.int32)
    if variant.startswith("deepseek"):
        kw["position_embeddings"] = rope_tables(m, pos)
    with attention._force_backend(backend):
        out, _ = call(m, variant, xl, pos, **kw)
        out.backward(dy[:, r * s : (r + 1) * s])
    return {
        "out": out.detach(),
        "dx": xl.grad,
        "grads": {n: q.grad for n, q in m.named_parameters()},
    }


def _rank(cases: list[tuple]) -> list[dict[str, Any]]:
    mesh = cp_mesh()
    double = NpuFusionAttentionDouble()
    double.install()  # a fake torch_npu in this rank's sys.modules
    results = []
    for case in cases:
        double.calls.clear()
        npu = _run_case(case, mesh, "npu")
        calls: list[Call] = list(double.calls)
        sdpa = _run_case(case, mesh, "sdpa")
        results.append({"npu": npu, "sdpa": sdpa, "calls": calls, "after": len(double.calls)})
    return results


@pytest.mark.timeout(240)
def test_parallel_mla_npu_branch_equals_sdpa_and_each_document_alone() -> None:
    world = 2
    ranks = run_distributed(_rank, world, CASES, timeout=200)
    for i, (variant, strategy, overlap, t) in enumerate(CASES):
        tag = (variant, strategy, overlap, TABLES[t])
        offsets = TABLES[t] or [0, SEQ]
        ref = _reference(variant, offsets)
        got = [res[i] for res in ranks]
        for g in got:
            for key in ("out", "dx"):
                torch.testing.assert_close(g["npu"][key], g["sdpa"][key], **TOL)
            for name, want in g["sdpa"]["grads"].items():
                have = g["npu"]["grads"][name]
                assert (have is None) == (want is None), (tag, name)
                if want is not None:
                    torch.testing.assert_close(have, want, **TOL, msg=lambda m, n=name: f"{n} {m}")
            # one fused call per forward, on the rank's H/P heads of all S tokens
            (c,) = g["calls"]
            assert g["after"] == 1, tag  # the sdpa run did not reach the op
            h, d = 4 // world, 10  # heads per rank; max(dq = 6 + 4, dv = 5)
            if TABLES[t] is None:
                assert (c.layout, c.actual_seq_qlen) == ("BSND", None), tag
                assert c.shapes == ((1, SEQ, h, d),) * 3, tag
            else:
                assert c.layout == "TND", tag
                assert c.actual_seq_qlen == c.actual_seq_kvlen == offsets[1:], tag
                assert c.shapes == ((SEQ, h, d),) * 3, tag
            assert (c.head_num, c.sparse_mode) == (h, 3), tag
        npu = [g["npu"] for g in got]
        torch.testing.assert_close(torch.cat([g["out"] for g in npu], 1), ref["out"], **TOL)
        torch.testing.assert_close(torch.cat([g["dx"] for g in npu], 1), ref["dx"], **TOL)
        for name, want in ref["grads"].items():
            summed = sum(g["grads"][name] for g in npu if g["grads"][name] is not None)
            torch.testing.assert_close(
                summed, want, **TOL, msg=lambda m, n=name, t=tag: f"{t} {n} {m}"
            )
