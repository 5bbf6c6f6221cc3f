"""parallelize_gated_deltanet on the stock Hugging Face Qwen3NextGatedDeltaNet (and Qwen3.5's
Qwen3_5GatedDeltaNet): the parallel layer on 2 and 4 gloo ranks equals the stock serial layer
on the whole sequence (float64 inputs and weights; the stock recurrence runs in fp32): output,
input gradient and every parameter gradient, for every protocol, with grouped value heads
(4 value heads over 2 q/k heads), B = 2, blocks shorter than the convolution window and
empty; packed documents (``cu_seqlens`` and a sequence context) against the stock layer run
on each document alone; ``gated_deltanet_context_parallel`` with an initial state against
transformers' ``torch_chunk_gated_delta_rule``. Bad inputs raise on every rank before any
communication. One ``run_distributed`` call per world size carries every case."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _kda_hf import QWEN3_NEXT, gdn_layer
from _kda_testutil import compare_blocks, max_rel_err
from torch.distributed.tensor.parallel import parallelize_module

from hyper_parallel.dtensor import comm as comm_mod
from hyper_parallel.dtensor import consistency_checks, init_device_mesh, sequence_context
from hyper_parallel.dtensor.testing import (
    assert_same_inconsistency,
    caught_inconsistency,
    run_distributed,
)
from hyper_parallel.kda import (
    SUPPORTED_GDN_CLASSES,
    ContextParallelGatedDeltaNet,
    gated_deltanet_context_parallel,
    is_gated_deltanet_parallel,
    parallelize_gated_deltanet,
    parallelize_kda,
    unparallelize_gated_deltanet,
)
from hyper_parallel.kda.testing import import_torch_path

D = 32
# (kind, B, T, protocol, group_size, block cuts or None for even blocks, documents or None).
# Conv kernel 4: blocks of fewer than 3 rows make the halo span several ranks.
DOCS = [0, 5, 6, 12, 14, 24]  # inside rank 0's block, one token, at a boundary (P = 2, 4), ...
CASES: dict[int, list[tuple[str, int, int, str, int | None, Any, Any]]] = {
    2: [("next", 2, 13, "p2p", None, None, None), ("next", 2, 13, "allgather", None, None, None),
        ("next", 2, 13, "grouped", None, None, None), ("3.5", 2, 13, "auto", None, None, None),
        ("next", 1, 5, "p2p", None, [0, 2, 5], None),
        ("next", 1, 24, "p2p", None, None, DOCS), ("3.5", 1, 24, "allgather", None, None, "ctx")],
    4: [("next", 2, 13, "p2p", None, None, None), ("next", 2, 13, "grouped", 2, None, None),
        ("next", 2, 13, "auto", None, None, None),
        ("3.5", 2, 6, "grouped", 2, None, None),
        ("next", 2, 7, "allgather", None, [0, 3, 3, 5, 7], None),
        ("next", 1, 24, "grouped", 2, None, DOCS), ("next", 1, 24, "auto", None, None, "ctx")],
}  # fmt: skip


def _cuts(T: int, P: int, cuts: Any) -> list[int]:
    return cuts if isinstance(cuts, list) else [T * i // P for i in range(P + 1)]


def _docs(docs: Any) -> list[int] | None:
    return DOCS if docs == "ctx" else docs


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: p.grad if p.grad is not None else torch.zeros_like(p)
        for n, p in module.named_parameters()
    }


def _layer_case(mesh: Any, r: int, case: tuple[Any, ...]) -> tuple[Any, ...]:
    kind, B, T, protocol, width, cuts, docs = case
    layer = gdn_layer(kind)
    params = {n: id(p) for n, p in layer.named_parameters()}
    parallelize_gated_deltanet(layer, mesh, protocol=protocol, group_size=width)
    assert is_gated_deltanet_parallel(layer)
    assert {n: id(p) for n, p in layer.named_parameters()} == params
    lo, hi = _cuts(T, mesh.size(), cuts)[r : r + 2]
    x = _randn(T, B, T, D)[:, lo:hi].clone().requires_grad_()
    kwargs: dict[str, Any] = {}
    if docs == "ctx":
        lengths = [
            b - a for a, b in zip(_cuts(T, mesh.size(), cuts), _cuts(T, mesh.size(), cuts)[1:])
        ]
        kwargs["sequence_context"] = sequence_context(mesh, lengths, cu_seqlens=torch.tensor(DOCS))
    elif docs is not None:
        kwargs["cu_seqlens"] = torch.tensor(docs)
    out = layer(x, **kwargs)
    (out * _randn(100 + r, *out.shape)).sum().backward()
    unparallelize_gated_deltanet(layer)
    assert type(layer).__name__ in SUPPORTED_GDN_CLASSES and not is_gated_deltanet_parallel(layer)
    return out.detach(), x.grad, _grads(layer)


def _functional(mesh: Any, r: int) -> tuple[Any, ...]:
    """gated_deltanet_context_parallel: grouped heads, B = 2, an initial state, the final state;
    also through a stock-layer ParallelStyle (torch's parallelize_module)."""
    P, T = mesh.size(), 11
    lo, hi = T * r // P, T * (r + 1) // P
    q, k, v, g, beta, h0 = _functional_inputs(T)
    q, k, v, g, beta = (t[:, lo:hi].clone().requires_grad_() for t in (q, k, v, g, beta))
    h0.requires_grad_()
    o, final = gated_deltanet_context_parallel(
        q, k, v, g, beta, mesh, protocol="p2p", initial_state=h0, output_final_state=True
    )
    loss = (o * _randn(200 + r, *o.shape)).sum()
    if final is not None:
        loss = loss + (final * _randn(300, *final.shape)).sum()
    loss.backward()
    grads = [t.grad for t in (q, k, v, g, beta)]
    style = parallelize_module(gdn_layer(), mesh, ContextParallelGatedDeltaNet("allgather"))
    return (
        o.detach(),
        None if final is None else final.detach(),
        grads,
        h0.grad,
        type(style).__name__,
    )


def _functional_inputs(T: int) -> tuple[torch.Tensor, ...]:
    q = torch.nn.functional.normalize(_randn(1, 2, T, 2, 8), dim=-1)
    k = torch.nn.functional.normalize(_randn(2, 2, T, 2, 8), dim=-1)
    v = _randn(3, 2, T, 4, 8)
    g = -torch.rand(2, T, 4, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 0.3
    beta = torch.rand(2, T, 4, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    return q, k, v, g, beta, _randn(6, 2, 4, 8, 8)


def _comm_spy() -> tuple[list[str], Callable[[], None]]:
    names = ["send", "recv", "isend", "irecv", "broadcast", "all_reduce", "all_gather",
             "all_gather_into_tensor", "new_group", "barrier"]  # fmt: skip
    calls: list[str] = []
    saved = {n: getattr(dist, n) for n in names}
    saved_gather = comm_mod.all_gather_single

    def spy(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return fn(*args, **kwargs)

        return wrapped

    for n, fn in saved.items():
        setattr(dist, n, spy(n, fn))
    comm_mod.all_gather_single = spy("all_gather_single", saved_gather)

    def restore() -> None:
        for n, fn in saved.items():
            setattr(dist, n, fn)
        comm_mod.all_gather_single = saved_gather

    return calls, restore


def _errors(mesh: Any) -> dict[str, Any]:
    """Every bad input: the exception on this rank, and whether anything communicated."""
    layer = parallelize_gated_deltanet(gdn_layer(), mesh, protocol="p2p")
    x = _randn(0, 1, 5, D)
    q, k, v, g, beta, _ = _functional_inputs(4)
    cases: dict[str, Callable[[], object]] = {
        "cache": lambda: layer(x, cache_params=object()),
        "mask": lambda: layer(x, attention_mask=torch.ones(1, 5)),
        "seq_idx": lambda: layer(x, seq_idx=torch.zeros(1, 5, dtype=torch.int32)),
        "cu_seq_lens_q": lambda: layer(x, cu_seq_lens_q=torch.tensor([0, 10])),
        "table start": lambda: layer(x, cu_seqlens=torch.tensor([1, 10])),
        "table B>1": lambda: layer(x.expand(2, 5, D), cu_seqlens=torch.tensor([0, 10])),
        "hidden size": lambda: layer(x[..., :8]),
        "wrong class": lambda: parallelize_gated_deltanet(torch.nn.Linear(2, 2), mesh),
        "kda layer": lambda: parallelize_kda(gdn_layer(), mesh),
        "twice": lambda: parallelize_gated_deltanet(layer, mesh),
        "not a mesh": lambda: parallelize_gated_deltanet(gdn_layer(), "cp"),
        "protocol": lambda: parallelize_gated_deltanet(gdn_layer(), mesh, protocol="ring"),
        "undo twice": lambda: unparallelize_gated_deltanet(
            unparallelize_gated_deltanet(
                parallelize_gated_deltanet(gdn_layer(), mesh, protocol="p2p")
            )
        ),
        "channel gate": lambda: gated_deltanet_context_parallel(
            q, k, v, g.unsqueeze(-1).expand(*g.shape, 8), beta, mesh
        ),
        "heads": lambda: gated_deltanet_context_parallel(q, k, v[:, :, :3], g[..., :3],
                                                         beta[..., :3], mesh),
    }  # fmt: skip
    calls, restore = _comm_spy()
    raised = {}
    try:
        for name, call in cases.items():
            try:
                call()
                raised[name] = "NO ERROR"
            except (ValueError, TypeError, RuntimeError) as exc:
                raised[name] = f"{type(exc).__name__}: {exc}"
    finally:
        restore()
    # still usable afterwards
    out = layer(_randn(0, 1, 4, D))
    return {"raised": raised, "calls": calls, "after": out.shape[1]}


def _consistency(mesh: Any, r: int) -> dict[str, Any]:
    """Consistency mode: every field of a forward's signature is computed (none raises),
    uneven blocks still run, and ranks that disagree raise the same error everywhere."""
    from types import SimpleNamespace

    from hyper_parallel.kda._signatures import GDN_FORWARD_FIELDS

    res: dict[str, Any] = {}
    with consistency_checks():
        layer = parallelize_gated_deltanet(gdn_layer("3.5"), mesh)
        x = _randn(7, 1, 3 + 2 * r, D)
        args = SimpleNamespace(self=layer, hidden_states=x, cache_params=None,
                               attention_mask=None, kwargs={})  # fmt: skip
        res["fields"] = {name: repr(f(args)) for name, f in GDN_FORWARD_FIELDS.items()}
        res["uneven"] = tuple(layer(x).shape)
        res["protocol"] = caught_inconsistency(
            lambda: parallelize_gated_deltanet(gdn_layer(), mesh, protocol="p2p" if r else "auto")
        )
        res["dtype"] = caught_inconsistency(lambda: layer(x.float() if r else x))
        table = torch.tensor([0, 3 + r, 8])
        x4 = _randn(8, 1, 4, D)
        res["table"] = caught_inconsistency(lambda: layer(x4, cu_seqlens=table))
    return res


def _rank(P: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (P,), mesh_dim_names=("cp",))
    r = dist.get_rank()
    out: dict[str, Any] = {"layers": [_layer_case(mesh, r, c) for c in CASES[P]]}
    if P == 2:
        out["functional"] = _functional(mesh, r)
        out["errors"] = _errors(mesh)
        out["consistency"] = _consistency(mesh, r)
    return out


def _reference(case: tuple[Any, ...], P: int) -> tuple[Any, ...]:
    kind, B, T, _, _, cuts, docs = case
    layer = gdn_layer(kind)
    x = _randn(T, B, T, D).requires_grad_()
    table = _docs(docs)
    if table is None:
        out = layer(x)
    else:  # the stock layer on each document alone
        out = torch.cat([layer(x[:, a:b]) for a, b in zip(table, table[1:])], dim=1)
    c = _cuts(T, P, cuts)
    loss = sum((out[:, c[r] : c[r + 1]] * _randn(100 + r, B, c[r + 1] - c[r], D)).sum()
               for r in range(P))  # fmt: skip
    loss.backward()  # type: ignore[union-attr]
    return out.detach(), x.grad, _grads(layer)


_compare = compare_blocks


def _check_functional(results: list[Any]) -> None:
    stock = import_torch_path(QWEN3_NEXT).torch_chunk_gated_delta_rule
    q, k, v, g, beta, h0 = (t.requires_grad_() for t in _functional_inputs(11))
    o, final = stock(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    P = len(results)
    loss = (final * _randn(300, *final.shape)).sum()
    for r in range(P):
        lo, hi = 11 * r // P, 11 * (r + 1) // P
        loss = loss + (o[:, lo:hi] * _randn(200 + r, *o[:, lo:hi].shape)).sum()
    loss.backward()
    assert max_rel_err(torch.cat([res[0] for res in results], 1), o) < 1e-5
    assert results[-1][1] is not None and results[0][1] is None
    assert max_rel_err(results[-1][1], final) < 1e-5
    for i, want in enumerate(t.grad for t in (q, k, v, g, beta)):
        assert max_rel_err(torch.cat([res[2][i] for res in results], 1), want) < 1e-5, i
    assert max_rel_err(results[0][3], h0.grad) < 1e-5  # h0 is read on the first rank
    assert all(res[4] == "ContextParallelQwen3NextGatedDeltaNet" for res in results)


ERRORS = {
    "cache": "ValueError: parallelize_gated_deltanet: cache_params (a generation cache)",
    "mask": "ValueError: parallelize_gated_deltanet: an attention_mask (padding)",
    "seq_idx": "ValueError: parallelize_gated_deltanet: seq_idx is not supported",
    "cu_seq_lens_q": "ValueError: parallelize_gated_deltanet: cu_seq_lens_q is not supported",
    "table start": "cu_seqlens must start at 0",
    "table B>1": "batch size 1",
    "hidden size": "hidden_states has 8 features, the layer expects 32",
    "wrong class": "TypeError: parallelize_gated_deltanet supports Qwen3NextGatedDeltaNet, "
    "Qwen3_5GatedDeltaNet, Qwen3_5MoeGatedDeltaNet (Hugging Face transformers), got Linear",
    "kda layer": "TypeError: parallelize_kda supports KimiLinearDeltaAttention",
    "twice": "RuntimeError: parallelize_gated_deltanet was already applied",
    "not a mesh": "TypeError: cp_mesh must be a 1-D torch DeviceMesh, got str",
    "protocol": "ValueError: unknown protocol 'ring'",
    "undo twice": "RuntimeError: module is not context-parallel (parallelize_gated_deltanet",
    "channel gate": "ValueError: g must be the per-head scalar gate [B, T, H]",
    "heads": "ValueError: the value heads (3) must be a multiple of the q/k heads (2)",
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("P", [2, 4])
def test_parallel_stock_gated_deltanet_equals_serial_output_and_every_gradient(P: int) -> None:
    """Every protocol, grouped value heads, B = 2, short and empty blocks, packed documents
    (cu_seqlens and a sequence context), Qwen3.5's layer; on 2 ranks also the functional form
    with an initial state, every bad input, raised on every rank before communicating, and
    consistency mode (disagreeing ranks raise the same error everywhere)."""
    ranks = run_distributed(_rank, P, P, timeout=280)
    for i, case in enumerate(CASES[P]):
        _compare([res["layers"][i] for res in ranks], _reference(case, P), (P, *case))
    if P == 2:
        _check_functional([res["functional"] for res in ranks])
        for r, res in enumerate(ranks):
            errors = res["errors"]
            assert errors["calls"] == [], f"rank {r} communicated: {errors['calls']}"
            assert errors["after"] == 4  # a 4-row block, after every error
            for name, match in ERRORS.items():
                got = errors["raised"][name]
                assert match in got, f"rank {r}: {name}: expected {match!r}, got {got!r}"
                assert got == ranks[0]["errors"]["raised"][name]
        forward = "parallelize_gated_deltanet (Qwen3_5GatedDeltaNet) forward"
        assert_same_inconsistency(
            [res["consistency"] for res in ranks],
            {"protocol": ("protocol", "parallelize_gated_deltanet"), "dtype": ("dtype", forward),
             "table": ("cu_seqlens", forward)},
        )  # fmt: skip
        for r, res in enumerate(ranks):
            fields = res["consistency"]["fields"]
            assert not any("Error" in v for v in fields.values()), fields
            assert fields["layer"] == ranks[0]["consistency"]["fields"]["layer"]
            assert res["consistency"]["uneven"] == (1, 3 + 2 * r, D)
