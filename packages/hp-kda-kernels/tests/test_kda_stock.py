"""``local_kernel="stock"``: each rank runs the chunk function the stock layer itself calls
(here transformers' PyTorch reference, standing in for fla's fused kernel), twice a block:
the widened-value summary ``[S | M]`` and the outputs from the incoming state. On 4 gloo ranks
both stock layers (Kimi-Linear's KDA, Qwen3-Next's Gated DeltaNet) equal the serial stock
layer, output, input gradient and every parameter gradient, for every protocol, B = 2, uneven
and empty blocks and packed documents; the functional form with an initial and a final state;
``auto`` takes the stock kernel exactly when it is fla's (a stand-in that records its calls and
keeps documents apart through ``cu_seqlens``, as fla does)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _kda_hf import QWEN3_NEXT, gdn_layer, kda_layer, kimi
from _kda_testutil import compare_blocks, max_rel_err

from hyper_parallel.dtensor import init_device_mesh
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.kda import (
    build_state_exchange,
    parallelize_gated_deltanet,
    parallelize_kda,
    run_stock_with_executor,
    stock_kernel,
)
from hyper_parallel.kda.testing import import_torch_path

P = 4
DOCS = [0, 5, 6, 12, 14, 24]  # a start inside a block, a one-token document, at a boundary
# (layer, B, T, protocol, group_size, block cuts or None for even blocks, documents or None)
CASES: list[tuple[str, int, int, str, int | None, Any, Any]] = [
    ("kda", 2, 13, "p2p", None, None, None), ("kda", 2, 13, "allgather", None, None, None),
    ("kda", 2, 13, "grouped", 2, None, None), ("kda", 2, 7, "auto", None, [0, 3, 3, 5, 7], None),
    ("kda", 1, 24, "grouped", 2, None, DOCS),
    ("gdn", 2, 13, "p2p", None, None, None), ("gdn", 2, 13, "allgather", None, None, None),
    ("gdn", 2, 13, "auto", None, None, None), ("gdn", 2, 7, "grouped", 2, [0, 3, 3, 5, 7], None),
    ("gdn", 1, 24, "p2p", None, None, DOCS),
]  # fmt: skip
KIMI = "transformers.models.kimi_linear.modeling_kimi_linear"
KDA_KERNEL = "chunk_kimi_delta_attention"
GDN_KERNEL = "torch_chunk_gated_delta_rule"


def _layer(kind: str) -> torch.nn.Module:
    return kda_layer() if kind == "kda" else gdn_layer("next")


def _parallelize(kind: str) -> Callable[..., torch.nn.Module]:
    return parallelize_kda if kind == "kda" else parallelize_gated_deltanet


def _cuts(T: int, cuts: Any) -> list[int]:
    return cuts if isinstance(cuts, list) else [T * i // P for i in range(P + 1)]


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: p.grad if p.grad is not None else torch.zeros_like(p)
        for n, p in module.named_parameters()
    }


def _layer_case(mesh: Any, r: int, case: tuple[Any, ...], local_kernel: str) -> tuple[Any, ...]:
    kind, B, T, protocol, width, cuts, docs = case
    layer = _parallelize(kind)(
        _layer(kind), mesh, protocol=protocol, group_size=width, local_kernel=local_kernel
    )
    lo, hi = _cuts(T, cuts)[r : r + 2]
    x = _randn(T, B, T, 32)[:, lo:hi].clone().requires_grad_()
    kwargs = {} if docs is None else {"cu_seqlens": torch.tensor(docs)}
    out = layer(x, **kwargs)
    (out * _randn(100 + r, *out.shape)).sum().backward()
    return out.detach(), x.grad, _grads(layer)


def _reference(case: tuple[Any, ...]) -> tuple[Any, ...]:
    kind, B, T, _, _, cuts, docs = case
    layer = _layer(kind)
    x = _randn(T, B, T, 32).requires_grad_()
    if docs is None:
        out = layer(x)
    else:  # the stock layer on each document alone
        out = torch.cat([layer(x[:, a:b]) for a, b in zip(docs, docs[1:])], dim=1)
    c = _cuts(T, cuts)
    loss = sum((out[:, c[r] : c[r + 1]] * _randn(100 + r, B, c[r + 1] - c[r], 32)).sum()
               for r in range(P))  # fmt: skip
    loss.backward()  # type: ignore[union-attr]
    return out.detach(), x.grad, _grads(layer)


_compare = compare_blocks


def _functional_inputs(T: int) -> tuple[torch.Tensor, ...]:
    """Kimi-Linear kernel inputs (q, k before the kernel's l2-norm), B = 2, and ``h0``."""
    q, k, v = _randn(1, 2, T, 3, 16), _randn(2, 2, T, 3, 16), _randn(3, 2, T, 3, 16)
    g = -torch.rand(2, T, 3, 16, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    beta = torch.rand(2, T, 3, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    return q, k, v, g * 0.3, beta, _randn(6, 2, 3, 16, 16)


def _functional(mesh: Any, r: int) -> tuple[Any, ...]:
    """run_stock_with_executor with an initial state and the final state."""
    T = 11
    lo, hi = T * r // P, T * (r + 1) // P
    *inputs, h0 = _functional_inputs(T)
    q, k, v, g, beta = (t[:, lo:hi].clone().requires_grad_() for t in inputs)
    h0.requires_grad_()
    kernel = stock_kernel(kda_layer(), KDA_KERNEL)
    ex = build_state_exchange(mesh, "allgather")
    o, final = run_stock_with_executor(
        kernel, q, k, v, g, beta, ex, initial_state=h0, output_final_state=True
    )
    loss = (o * _randn(200 + r, *o.shape)).sum()
    if final is not None:
        loss = loss + (final * _randn(300, *final.shape)).sum()
    loss.backward()
    return o.detach(), None if final is None else final.detach(), [t.grad for t in (q, k, v, g,
            beta)], h0.grad  # fmt: skip


class _FusedStandIn:
    """Stands in for fla's fused kernel in a modeling module: its module is ``fla``'s (so
    ``auto`` takes it), it keeps documents apart through ``cu_seqlens`` with one initial state
    per document (fla's convention; here by calling the torch reference per document), and it
    records every call's value width, initial state and table."""

    def __init__(self, reference: Callable[..., Any]) -> None:
        self.reference = reference
        self.calls: list[dict[str, Any]] = []

        def chunk(q: Any, k: Any, v: Any, g: Any, beta: Any, **kw: Any) -> Any:
            return self(q, k, v, g, beta, **kw)

        chunk.__module__ = "fla.ops.kda.chunk"
        self.fn = chunk

    def __call__(self, q: Any, k: Any, v: Any, g: Any, beta: Any, **kw: Any) -> Any:
        h, cu = kw.pop("initial_state", None), kw.pop("cu_seqlens", None)
        self.calls.append({"width": v.shape[-1], "identity_start": _identity_start(h, v),
                           "cu_seqlens": None if cu is None else cu.tolist()})  # fmt: skip
        if cu is None:
            return self.reference(q, k, v, g=g, beta=beta, initial_state=h, **kw)
        outs, finals = [], []
        for i, (a, b) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
            parts = (x[:, a:b] for x in (q, k, v, g, beta))
            o, f = self.reference(*parts, initial_state=None if h is None else h[i : i + 1], **kw)
            outs.append(o)
            finals.append(f)
        return torch.cat(outs, dim=1), torch.cat(finals)


def _identity_start(h: Any, v: torch.Tensor) -> bool:
    """Whether ``h`` is the summary call's ``[0 | I]`` over values widened by K columns."""
    if h is None or h.shape[-1] == h.shape[-2]:
        return False
    K = h.shape[-2]
    eye = torch.eye(K, dtype=h.dtype).expand_as(h[..., -K:])
    return bool((h[..., :-K] == 0).all() and (h[..., -K:] == eye).all())


def _auto_picks_fla(mesh: Any, r: int) -> dict[str, Any]:
    """With the modeling module's chunk function bound to the stand-in, ``auto`` runs it
    (packed documents through its ``cu_seqlens``); with the torch reference, ``auto`` does
    not call the stock function at all."""
    home = sys.modules[KIMI]
    saved = getattr(home, KDA_KERNEL)
    fused = _FusedStandIn(saved)
    setattr(home, KDA_KERNEL, fused.fn)
    try:
        case = ("kda", 1, 24, "p2p", None, None, DOCS)
        result = _layer_case(mesh, r, case, "auto")
    finally:
        setattr(home, KDA_KERNEL, saved)
    plain = _FusedStandIn(saved)
    plain.fn.__module__ = KIMI  # not fla: auto keeps the project's path
    setattr(home, KDA_KERNEL, plain.fn)
    try:
        layer = parallelize_kda(kda_layer(), mesh)
        layer(_randn(0, 1, 4, 32)).sum().backward()
    finally:
        setattr(home, KDA_KERNEL, saved)
    return {"result": result, "calls": fused.calls, "plain_calls": len(plain.calls)}


def _rank() -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (P,), mesh_dim_names=("cp",))
    r = dist.get_rank()
    kimi()
    import_torch_path(QWEN3_NEXT)
    return {
        "layers": [_layer_case(mesh, r, c, "stock") for c in CASES],
        "functional": _functional(mesh, r),
        "auto": _auto_picks_fla(mesh, r),
        "errors": _errors(mesh),
    }


def _errors(mesh: Any) -> dict[str, str]:
    """Bad ``local_kernel`` options, refused before any communication (the module untouched)."""
    out: dict[str, str] = {}
    layer = kda_layer()
    for name, call in {
        "unknown kda": lambda: parallelize_kda(layer, mesh, local_kernel="fla"),
        "unknown gdn": lambda: parallelize_gated_deltanet(gdn_layer(), mesh, local_kernel=None),
    }.items():
        try:
            call()
            out[name] = "accepted"
        except ValueError as exc:
            out[name] = str(exc)
    home = sys.modules[KIMI]
    saved = getattr(home, KDA_KERNEL)
    delattr(home, KDA_KERNEL)  # a modeling module without the chunk function
    try:
        parallelize_kda(layer, mesh, local_kernel="stock")
        out["missing"] = "accepted"
    except TypeError as exc:
        out["missing"] = str(exc)
    finally:
        setattr(home, KDA_KERNEL, saved)
    out["untouched"] = type(layer).__name__
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(_rank, P, timeout=300)


@pytest.mark.parametrize("i", range(len(CASES)))
def test_stock_kernel_path_equals_serial_stock_layer(ranks: list[Any], i: int) -> None:
    case = CASES[i]
    _compare([res["layers"][i] for res in ranks], _reference(case), case)


def test_stock_kernel_path_carries_initial_and_final_state(ranks: list[Any]) -> None:
    kernel = import_torch_path(KIMI).chunk_kimi_delta_attention
    q, k, v, g, beta, h0 = (t.requires_grad_() for t in _functional_inputs(11))
    o, final = kernel(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                      use_qk_l2norm_in_kernel=True)  # fmt: skip
    loss = sum((o[:, 11 * r // P : 11 * (r + 1) // P] * _randn(200 + r, 2, 11 * (r + 1) // P
               - 11 * r // P, 3, 16)).sum() for r in range(P))  # fmt: skip
    (loss + (final * _randn(300, *final.shape)).sum()).backward()  # type: ignore[operator]
    got = [res["functional"] for res in ranks]
    assert max_rel_err(torch.cat([x[0] for x in got], dim=1), o) < 1e-5
    assert all(x[1] is None for x in got[:-1])
    assert max_rel_err(got[-1][1], final) < 1e-5
    for j, t in enumerate((q, k, v, g, beta)):
        assert max_rel_err(torch.cat([x[2][j] for x in got], dim=1), t.grad) < 1e-5, j
    assert max_rel_err(got[0][3], h0.grad) < 1e-5
    assert all(x[3] is None or x[3].abs().max() == 0 for x in got[1:])


def test_auto_runs_the_stock_kernel_when_it_is_fla_s(ranks: list[Any]) -> None:
    case = ("kda", 1, 24, "p2p", None, None, DOCS)
    _compare([res["auto"]["result"] for res in ranks], _reference(case), "auto")
    for r, res in enumerate(ranks):
        calls = res["auto"]["calls"]
        assert calls, r
        summary = [c for c in calls if c["identity_start"]]
        # a block without a document start sends [S | M] from one widened call; a block with
        # one (also at its first token) needs only its last document's final state (M = 0)
        lo, hi = 24 * r // P, 24 * (r + 1) // P
        starts = [o - lo for o in DOCS if lo < o < hi]
        fresh = 0 < lo in DOCS  # a document starts at the block's first token
        assert len(summary) == (0 if starts or fresh else 1), (r, calls)
        assert all(c["width"] == 32 for c in summary)
        varlen = [c["cu_seqlens"] for c in calls if c["cu_seqlens"] is not None]
        assert varlen == ([[0, *starts, hi - lo]] if starts else []), (r, calls)
        assert res["auto"]["plain_calls"] == 0


def test_bad_local_kernel_is_refused_on_every_rank_before_any_communication(
    ranks: list[Any],
) -> None:
    for res in ranks:
        err = res["errors"]
        assert "unknown local_kernel 'fla'" in err["unknown kda"], err
        assert "unknown local_kernel None" in err["unknown gdn"], err
        assert "no chunk function 'chunk_kimi_delta_attention'" in err["missing"], err
        assert err["untouched"] == "KimiLinearDeltaAttention"


def test_stock_kernel_is_found_and_classified() -> None:
    kernel = stock_kernel(kda_layer(), KDA_KERNEL)
    assert not kernel.fused and not kernel.varlen
    assert stock_kernel(gdn_layer("next"), GDN_KERNEL).fused is False
    from hyper_parallel.kda.stock import is_fused

    assert is_fused(_FusedStandIn(kernel.fn).fn)
    with pytest.raises(TypeError, match="no chunk function 'missing'"):
        stock_kernel(kda_layer(), "missing")
