"""KDA given hp-dtensor's sequence context (``sequence_context=``), and ranks given different
packed-document tables with consistency mode off, on 2 and 4 gloo ranks, float64.

- ``kda_context_parallel`` and the stock ``KimiLinearDeltaAttention`` under
  ``parallelize_kda`` given a context equal the same calls given ``cu_seqlens`` (output and
  every gradient, to rounding), with blocks of different lengths; a checked context makes them
  read nothing back to the host and gather nothing (no ``all_gather:block_lengths``: only the
  layer's own exchanges), an unchecked one costs one ``all_gather:sequence_fingerprint``, once.
- Different tables on different ranks (consistency mode off): ``kda_context_parallel`` and the
  layer given ``cu_seqlens``, and the layer given unchecked contexts, raise the same
  ``SequenceMismatchError`` on every rank; the exchange still pairs up afterwards.
- A context given with ``cu_seqlens``, or not describing the call's block: ``ValueError``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _kda_hf import kda_layer
from _kda_testutil import kda_inputs, max_rel_err

from hyper_parallel.dtensor import gather_sequence_context, init_device_mesh, sequence_context
from hyper_parallel.dtensor.recorder import record_events
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.kda import kda_context_parallel, parallelize_kda

D = 32


def _lengths(P: int) -> list[int]:
    return [3 + (i % 2) * 2 for i in range(P)]  # 3, 5, 3, 5: blocks of different lengths


def _table(total: int) -> list[int]:
    return [0, 1, 4, total - 2, total]


def _randn(seed: int, *shape: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=torch.float64, generator=gen)


def _grads(*xs: torch.Tensor) -> list[torch.Tensor]:
    return [x.grad.clone() if x.grad is not None else torch.zeros(()) for x in xs]


def _caught(fn: Any) -> str:
    try:
        fn()
    except ValueError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _rank(P: int) -> dict[str, Any]:
    r = dist.get_rank()
    mesh = init_device_mesh("cpu", (P,), mesh_dim_names=("cp",))
    lengths = _lengths(P)
    total = sum(lengths)
    a, b = sum(lengths[:r]), sum(lengths[: r + 1])
    table = torch.tensor(_table(total))
    res: dict[str, Any] = {}
    # the kernel: cu_seqlens vs a context (checked: gathered once by the caller)
    full = [x.clone() for x in kda_inputs(1, total, 2, 16, 16, seed=5)][:5]
    w = torch.randn(
        1, total, 2, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(9)
    )
    outs = []
    for how in ("table", "context"):
        xs = [x[:, a:b].clone().requires_grad_() for x in full]
        kw: dict[str, Any] = {"cu_seqlens": table}
        if how == "context":
            ctx = gather_sequence_context(mesh, b - a, cu_seqlens=table)
            kw = {"sequence_context": ctx}
        with record_events() as rec:
            o, _ = kda_context_parallel(*xs, mesh, protocol="p2p", **kw)
            (o * w[:, a:b]).sum().backward()
        outs.append((o.detach(), _grads(*xs), rec.names("launch", "forward")))
    res["kernel"] = outs
    # the stock layer: cu_seqlens vs a context built from known lengths (unchecked, then checked)
    layer = parallelize_kda(kda_layer(), mesh, protocol="p2p")
    x_full = torch.randn(
        1, total, D, dtype=torch.float64, generator=torch.Generator().manual_seed(3)
    )
    ctx = sequence_context(mesh, lengths, cu_seqlens=table)
    layers = []
    for how in ("table", "context", "context"):
        layer.zero_grad()
        x = x_full[:, a:b].clone().requires_grad_()
        kw = {"cu_seqlens": table} if how == "table" else {"sequence_context": ctx}
        with record_events() as rec:
            y = layer(x, **kw)
            (y * y).sum().backward()
        grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
        layers.append((y.detach(), x.grad.clone(), grads, rec.names("launch", "forward")))
    res["layer"] = layers
    # different tables on different ranks, consistency mode off
    mine = torch.tensor(_table(total) if r else [0, 2, total])
    xs = [x[:, a:b] for x in full]
    res["mismatch_kernel"] = _caught(lambda: kda_context_parallel(*xs, mesh, cu_seqlens=mine))
    x = x_full[:, a:b]
    res["mismatch_layer"] = _caught(lambda: layer(x, cu_seqlens=mine))
    bad = sequence_context(mesh, lengths, cu_seqlens=mine)
    res["mismatch_context"] = _caught(lambda: layer(x, sequence_context=bad))
    res["after"] = tuple(layer(x, cu_seqlens=table).shape)  # the exchanges still pair up
    res["both"] = _caught(lambda: layer(x, cu_seqlens=table, sequence_context=ctx))
    other = sequence_context(mesh, [total // P] * (P - 1) + [total - (P - 1) * (total // P)])
    res["wrong_block"] = _caught(lambda: layer(x, sequence_context=other))
    return res


@pytest.mark.parametrize("P", [2, 4])
def test_kda_given_a_sequence_context(P: int) -> None:
    ranks = run_distributed(_rank, P, P, timeout=300)
    for r, res in enumerate(ranks):
        (o_t, g_t, names_t), (o_c, g_c, names_c) = res["kernel"]
        assert max_rel_err(o_c, o_t) < 1e-12
        for x, y in zip(g_c, g_t):
            assert max_rel_err(x, y) < 1e-12
        assert "all_gather:block_lengths" in names_t
        assert not any(n.startswith("all_gather:") for n in names_c), names_c
        (y_t, x_t, p_t, n_t), (y_c, x_c, p_c, n_c), (y_2, x_2, p_2, n_2) = res["layer"]
        for y, xg, pg in ((y_c, x_c, p_c), (y_2, x_2, p_2)):
            assert max_rel_err(y, y_t) < 1e-12 and max_rel_err(xg, x_t) < 1e-12
            for name, want in p_t.items():
                assert max_rel_err(pg[name], want) < 1e-12, name
        assert n_t.count("all_gather:block_lengths") == 1
        assert n_c.count("all_gather:sequence_fingerprint") == 1  # unchecked: compared once
        assert not any(n.startswith("all_gather:") for n in n_2), n_2  # then nothing
        assert res["after"][1] == _lengths(P)[r]
        assert "not both" in res["both"]
        assert "the sequence context describes block" in res["wrong_block"]
    for key in ("mismatch_kernel", "mismatch_layer", "mismatch_context"):
        messages = {res[key] for res in ranks}
        assert len(messages) == 1, (key, messages)  # the same error on every rank
        (message,) = messages
        assert message.startswith("SequenceMismatchError: "), message
        assert "different packed-document tables" in message
