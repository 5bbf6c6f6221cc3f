"""Every state-exchange protocol on 2, 4 and 8 gloo ranks against float64 folds; exchanges in
flight together with reversed backward; executors hold no tensors."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from _kda_testutil import fold64, max_rel_err, random_summaries

from hyper_parallel.dtensor import init_device_mesh
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.kda import StateExchange, build_state_exchange

B, H, K, V = 2, 2, 16, 32

CASES = {
    2: [("p2p", None), ("allgather", None), ("grouped", 1), ("grouped", 2), ("auto", None)],
    4: [("p2p", None), ("allgather", None), ("grouped", 2), ("grouped", 4), ("auto", None),
        ("grouped", None)],
    8: [("p2p", None), ("allgather", None), ("grouped", 2), ("grouped", 4), ("auto", None)],
}  # fmt: skip


def _summaries(P: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    S, M = random_summaries(P, B, H, K, V, seed=seed)
    G, _ = random_summaries(P, B, H, K, V, seed=seed + 100)
    return S, M, G


def _exchange_rank(P: int) -> dict[str, object]:
    mesh = init_device_mesh("cpu", (P,), mesh_dim_names=("cp",))
    r = dist.get_rank()
    S, M, G = (x[r].float() for x in _summaries(P, seed=P))
    results: dict[str, object] = {}
    for protocol, width in CASES[P]:
        ex = build_state_exchange(mesh, protocol, width, kernel="torch")
        results[f"{protocol}:{width}"] = (ex.forward(S, M), ex.backward(G, M))
        if protocol == "auto":
            results["auto_choice"] = ex.choice(S)  # type: ignore[attr-defined]
    if P == 4:
        results["interleaved"] = _interleaved(mesh, r)
        results["weakrefs"] = _weakrefs(mesh, S, M, G)
    return results


def _interleaved(mesh: object, r: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two exchanges in flight (different protocols and the same executor twice); their
    backwards run in the reverse order of their forwards."""
    out = []
    for a, b in (("grouped", "p2p"), ("allgather", "allgather"), ("p2p", "grouped")):
        ex_a = build_state_exchange(mesh, a, 2 if a == "grouped" else None)
        ex_b = ex_a if b == a else build_state_exchange(mesh, b, 2 if b == "grouped" else None)
        (S1, M1, G1), (S2, M2, G2) = (
            (x[r].float() for x in _summaries(4, seed=s)) for s in (11, 12)
        )
        h1 = ex_a.forward(S1, M1)
        h2 = ex_b.forward(S2, M2)
        g2 = ex_b.backward(G2, M2)
        g1 = ex_a.backward(G1, M1)
        out += [(h1, g1), (h2, g2)]
    return out


def _tensors_in(obj: object, seen: set[int]) -> int:
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return 1
    if isinstance(obj, dict):
        return sum(_tensors_in(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensors_in(v, seen) for v in obj)
    if isinstance(obj, StateExchange):
        return _tensors_in(vars(obj), seen)
    return 0


def _weakrefs(mesh: object, S: torch.Tensor, M: torch.Tensor, G: torch.Tensor) -> list[bool]:
    alive = []
    for protocol in ("p2p", "allgather", "grouped", "auto"):
        ex = build_state_exchange(mesh, protocol)
        S_c, M_c, G_c = S.clone(), M.clone(), G.clone()
        h = ex.forward(S_c, M_c)
        g = ex.backward(G_c, M_c)
        refs = [weakref.ref(t) for t in (S_c, M_c, G_c, h, g)]
        del S_c, M_c, G_c, h, g
        gc.collect()
        alive.append(any(ref() is not None for ref in refs) or _tensors_in(ex, set()) > 0)
    return alive


def _check(P: int, results: list[dict[str, object]], seed: int) -> None:
    S, M, G = _summaries(P, seed)
    for r in range(P):
        want_h = fold64(S, M, list(range(r)), True)[-1]
        want_g = fold64(G, M, list(range(P - 1, r, -1)), False)[-1]
        for protocol, width in CASES[P]:
            h, g = results[r][f"{protocol}:{width}"]  # type: ignore[misc]
            assert h.dtype == torch.float32 and h.shape == (B, H, K, V)
            if r == 0:
                assert torch.equal(h, torch.zeros_like(h)), (protocol, width)
            else:
                assert max_rel_err(h, want_h) < 1e-5, (protocol, width, r)
            if r == P - 1:
                assert torch.equal(g, torch.zeros_like(g)), (protocol, width)
            else:
                assert max_rel_err(g, want_g) < 1e-5, (protocol, width, r)


@pytest.mark.parametrize("P", [2, 4, 8])
def test_every_protocol_matches_float64_folds(P: int) -> None:
    results = run_distributed(_exchange_rank, P, P, timeout=150)
    _check(P, results, seed=P)
    choices = {str(res["auto_choice"]) for res in results}
    assert len(choices) == 1  # every rank resolved auto identically
    if P == 4:
        for r in range(P):
            assert results[r]["weakrefs"] == [False] * 4
            pairs = results[r]["interleaved"]
            for i, seed in enumerate([11, 12] * 3):
                S, M, G = _summaries(4, seed)
                h, g = pairs[i]  # type: ignore[index]
                want_h = fold64(S, M, list(range(r)), True)[-1]
                want_g = fold64(G, M, list(range(3, r, -1)), False)[-1]
                assert r == 0 or max_rel_err(h, want_h) < 1e-5
                assert r == 3 or max_rel_err(g, want_g) < 1e-5
