"""Packed documents (``cu_seqlens``) under context parallelism, against each document run alone.

Serial: ``chunk_kda`` / ``naive_recurrent_kda`` with ``cu_seqlens`` equal the per-document
references. Distributed (2 and 4 gloo ranks, one spawn each): ``kda_context_parallel`` with a
table, every protocol, the torch and the Triton fold (``TRITON_INTERPRET=1`` on CPU), with an
initial state (only the first document starts from it), output and every gradient; the stock
``KimiLinearDeltaAttention`` under ``parallelize_kda`` given ``cu_seqlens`` equals the stock
serial layer run on each document alone, output, input gradient and every parameter gradient,
with documents starting at a rank boundary, inside a block, spanning ranks, shorter than the
convolution window and of length 1 (each rank's projections see only its block); bad tables
raise ``ValueError`` on every rank; a block containing a document start sends ``M = 0``."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _kda_hf import kda_layer
from _kda_testutil import kda_inputs, max_rel_err

from hyper_parallel.dtensor import init_device_mesh
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.kda import (
    chunk_kda,
    kda_context_parallel,
    naive_recurrent_kda,
    parallelize_kda,
    state_summary,
)
from hyper_parallel.kda.chunk import chunk_terms, compose_chunks

D = 32
# (T, document offsets): conv kernel 4; on 2 ranks the blocks are [0, T/2), [T/2, T)
TABLES: dict[int, list[tuple[int, list[int]]]] = {
    2: [(12, [0, 6, 12]),  # a start at the rank boundary
        (12, [0, 1, 3, 8, 9, 12]),  # length 1, shorter than the window, inside a block
        (12, [0, 12])],  # one document
    4: [(16, [0, 2, 3, 11, 16]),  # shorter than the window; one spanning three ranks
        (16, [0, 4, 5, 6, 13, 16]),  # at a boundary, length 1 twice, inside a block
        (12, [0, 7, 12])],  # 3 tokens a rank: a document starts inside rank 2's block
}  # fmt: skip
# (table, protocol, fold backend) of the kernel runs: every protocol and both folds once
RUNS = [(0, "p2p", "torch"), (0, "allgather", "triton"), (1, "grouped", "torch"),
        (2, "auto", "torch"), (2, "allgather", "torch")]  # fmt: skip
LAYER_PROTOCOLS = ("auto", "p2p", "grouped")  # the stock layer's exchange, per table


def _backend(name: str) -> str:
    return name if name == "torch" or os.environ.get("TRITON_INTERPRET") == "1" else "torch"


def _weights(shape: Any, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _docs(offsets: list[int]) -> list[tuple[int, int]]:
    return list(zip(offsets[:-1], offsets[1:]))


def _kernel_reference(T: int, offsets: list[int]) -> tuple[Any, ...]:
    """naive_recurrent_kda on each document alone (the first from h0): o and every grad."""
    inputs = [x.clone().requires_grad_() for x in kda_inputs(1, T, 2, 16, 16, seed=T)]
    q, k, v, g, beta, h0 = inputs
    outs = []
    for i, (a, b) in enumerate(_docs(offsets)):
        o, _ = naive_recurrent_kda(
            q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b],
            initial_state=h0 if i == 0 else None,
        )  # fmt: skip
        outs.append(o)
    o = torch.cat(outs, dim=1)
    (o * _weights(o.shape, 7)).sum().backward()
    return o.detach(), [x.grad for x in inputs]


def test_serial_chunk_kda_with_documents_equals_each_document_alone() -> None:
    for T, offsets in TABLES[2] + TABLES[4] + [(70, [0, 1, 30, 64, 65, 70])]:
        ref, ref_grads = _kernel_reference(T, offsets)
        cu = torch.tensor(offsets)
        for chunk in (4, 64):
            inputs = [x.clone().requires_grad_() for x in kda_inputs(1, T, 2, 16, 16, seed=T)]
            o, _ = chunk_kda(*inputs[:5], initial_state=inputs[5], chunk_size=chunk, cu_seqlens=cu)
            (o * _weights(o.shape, 7)).sum().backward()
            assert max_rel_err(o, ref) < 1e-12, (T, offsets, chunk)
            for x, want in zip(inputs, ref_grads):
                assert max_rel_err(x.grad, want) < 1e-11, (T, offsets, chunk)
        naive, _ = naive_recurrent_kda(*kda_inputs(1, T, 2, 16, 16, seed=T)[:5],
                                       initial_state=kda_inputs(1, T, 2, 16, 16, seed=T)[5],
                                       cu_seqlens=cu)  # fmt: skip
        assert max_rel_err(naive, ref) < 1e-12
    # a chunk holding a document start: its summary does not depend on the incoming state
    q, k, v, g, beta, _ = kda_inputs(1, 8, 2, 16, 16)
    resets = torch.zeros(1, 8)
    resets[0, 5] = 1
    _, M = compose_chunks(chunk_terms(q, k, v, g, beta, 0.25, 64, resets))
    assert M.abs().max() == 0
    S_alone, _ = state_summary(k[:, 5:], v[:, 5:], g[:, 5:], beta[:, 5:])
    S, _ = compose_chunks(chunk_terms(q, k, v, g, beta, 0.25, 64, resets))
    assert max_rel_err(S, S_alone) < 1e-12


def _layer_reference(T: int, offsets: list[int], P: int) -> tuple[Any, ...]:
    """The stock serial layer on each document alone, outputs concatenated; the loss weights
    each rank's rows as the parallel run does."""
    layer = kda_layer()
    x = _input(T).requires_grad_()
    out = torch.cat([layer(x[:, a:b]) for a, b in _docs(offsets)], dim=1)
    s = T // P
    sum((out[:, r * s : (r + 1) * s] * _weights((1, s, D), r)).sum() for r in range(P)).backward()
    return out.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


def _input(T: int) -> torch.Tensor:
    return torch.randn(1, T, D, generator=torch.Generator().manual_seed(T), dtype=torch.float64)


def _rank(P: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (P,), mesh_dim_names=("cp",))
    r = dist.get_rank()
    kernels, layers, errors = [], [], []
    for j, protocol, backend in RUNS:
        T, offsets = TABLES[P][j]
        s = T // P
        full = [x.clone() for x in kda_inputs(1, T, 2, 16, 16, seed=T)]
        inputs = [x[:, r * s : (r + 1) * s].clone().requires_grad_() for x in full[:5]]
        h0 = full[5].clone().requires_grad_()
        o, _ = kda_context_parallel(
            *inputs, mesh, protocol=protocol, initial_state=h0, kernel=_backend(backend),
            cu_seqlens=torch.tensor(offsets),
        )  # fmt: skip
        (o * _weights((1, T, 2, 16), 7)[:, r * s : (r + 1) * s]).sum().backward()
        kernels.append((o.detach(), [x.grad for x in inputs], h0.grad))
    for (T, offsets), protocol in zip(TABLES[P], LAYER_PROTOCOLS):
        s = T // P
        layer = parallelize_kda(kda_layer(), mesh, protocol=protocol)
        seen: list[tuple[int, ...]] = []

        def record(m: Any, a: Any, o: Any, seen: list[tuple[int, ...]] = seen) -> None:
            seen.append(tuple(a[0].shape))

        hook = layer.q_proj.register_forward_hook(record)
        x = _input(T)[:, r * s : (r + 1) * s].clone().requires_grad_()
        out = layer(x, cu_seqlens=torch.tensor(offsets, dtype=torch.int32))
        (out * _weights(out.shape, r)).sum().backward()
        hook.remove()
        layers.append((out.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}))
        assert seen == [(1, s, D)], seen  # the projections see only this rank's block
    layer = parallelize_kda(kda_layer(), mesh, protocol="p2p")
    x = _input(4 * P)[:, :4]
    bad = {
        "start": [1, 4 * P], "end": [0, 3, 4 * P - 1], "order": [0, 5, 5, 4 * P],
        "float": torch.tensor([0.0, 4.0 * P]), "2-D": [[0, 4 * P]],
    }  # fmt: skip
    for name, table in bad.items():
        cu = table if isinstance(table, torch.Tensor) else torch.tensor(table)
        try:
            layer(x, cu_seqlens=cu)
            errors.append((name, "NO ERROR"))
        except ValueError as exc:
            errors.append((name, str(exc)))
    try:
        layer(_input(4 * P)[:, :4].expand(2, 4, D), cu_seqlens=torch.tensor([0, 4 * P]))
        errors.append(("B>1", "NO ERROR"))
    except ValueError as exc:
        errors.append(("B>1", str(exc)))
    # the exchange after the bad calls still pairs up: a good call works
    layer(x, cu_seqlens=torch.tensor([0, 2, 4 * P]))
    return {"kernels": kernels, "layers": layers, "errors": errors}


@pytest.mark.parametrize("P", [2, 4])
def test_packed_documents_under_context_parallelism_equal_each_document_alone(P: int) -> None:
    ranks = run_distributed(_rank, P, P, timeout=300)
    for i, (j, protocol, backend) in enumerate(RUNS):
        T, offsets = TABLES[P][j]
        ref, ref_grads = _kernel_reference(T, offsets)
        got = [res["kernels"][i] for res in ranks]
        tag = (P, T, offsets, protocol, backend)
        assert max_rel_err(torch.cat([g[0] for g in got], 1), ref) < 1e-5, tag
        for n in range(5):
            assert max_rel_err(torch.cat([g[1][n] for g in got], 1), ref_grads[n]) < 1e-5, tag
        h0_grad = sum(g[2] if g[2] is not None else 0 for g in got)
        assert max_rel_err(h0_grad, ref_grads[5]) < 1e-5, tag
    for j, (T, offsets) in enumerate(TABLES[P]):
        out, x_grad, grads = _layer_reference(T, offsets, P)
        got = [res["layers"][j] for res in ranks]
        assert max_rel_err(torch.cat([g[0] for g in got], 1), out) < 1e-5, (P, offsets)
        assert max_rel_err(torch.cat([g[1] for g in got], 1), x_grad) < 1e-5, (P, offsets)
        for name, want in grads.items():
            assert want.abs().max() > 0, name
            assert max_rel_err(sum(g[2][name] for g in got), want) < 1e-5, (P, offsets, name)
    for res in ranks:
        messages = dict(res["errors"])
        assert "must start at 0" in messages["start"]
        assert "must end at the sequence length" in messages["end"]
        assert "strictly increasing" in messages["order"]
        assert "integer" in messages["float"]
        assert "1-D" in messages["2-D"]
        assert "batch size 1" in messages["B>1"]
