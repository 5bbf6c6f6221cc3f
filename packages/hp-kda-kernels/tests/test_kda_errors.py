"""Bad inputs raise ValueError on every rank before any communication; the group still works.

Rejected inputs (spec-kda "Errors"):
- S/M: dtype other than fp32, shape mismatch, device mismatch, non-unit column stride;
- K or V unsupported by the chosen backend (explicit ``backend="triton"``);
- ``rank`` outside ``[0, P)``;
- unknown protocol, unknown backend;
- ``group_size`` not a positive int (bools rejected), not dividing P, or given to a protocol
  that takes none;
- a mesh that is not 1-D, or whose rank order is not chronological;
- kda_context_parallel: mismatched q/k/v/g/beta/initial_state shapes, bad chunk_size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _kda_testutil import kda_inputs

from hyper_parallel.dtensor import DeviceMesh, init_device_mesh
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.kda import affine_merge, build_state_exchange, kda_context_parallel
from hyper_parallel.kda import exchange as exchange_mod

_COMM = ["send", "recv", "isend", "irecv", "broadcast", "all_reduce", "all_gather",
         "all_gather_into_tensor", "new_group", "barrier"]  # fmt: skip


def _cases(mesh: Any, mesh2d: Any, shuffled: Any) -> dict[str, Callable[[], object]]:
    S = torch.randn(1, 2, 16, 32)
    M = torch.randn(1, 2, 16, 16)
    ex = build_state_exchange(mesh, "allgather")
    ex_tr = build_state_exchange(mesh, "p2p", backend="triton")
    q, k, v, g, beta, h0 = (x.float() for x in kda_inputs(1, 6, 2, 16, 32))
    q24 = torch.randn(1, 6, 2, 24)
    S4, M4 = S.expand(4, -1, -1, -1, -1), M.expand(4, -1, -1, -1, -1)
    S24, M24 = torch.randn(1, 2, 24, 32), torch.randn(1, 2, 24, 24)
    cp = kda_context_parallel
    return {
        "unknown protocol": lambda: build_state_exchange(mesh, "ring"),
        "unknown backend": lambda: build_state_exchange(mesh, "p2p", backend="cuda"),
        "group_size for p2p": lambda: build_state_exchange(mesh, "p2p", 2),
        "group_size for auto": lambda: build_state_exchange(mesh, "auto", 2),
        "group_size bool": lambda: build_state_exchange(mesh, "grouped", True),
        "group_size zero": lambda: build_state_exchange(mesh, "grouped", 0),
        "group_size not dividing": lambda: build_state_exchange(mesh, "grouped", 3),
        "2-D mesh": lambda: build_state_exchange(mesh2d, "p2p"),
        "shuffled rank order": lambda: build_state_exchange(shuffled, "allgather"),
        "fp64 summaries": lambda: ex.forward(S.double(), M.double()),
        "S/M shape mismatch": lambda: ex.forward(S, M[:, :1]),
        "S/M device mismatch": lambda: ex.forward(S, M.to("meta")),
        "non-unit column stride": lambda: ex.backward(S.transpose(-1, -2)[..., :16, :], M),
        "K unsupported by triton": lambda: ex_tr.forward(S24, M24),
        "rank outside [0, P)": lambda: affine_merge(S4, M4, 4),
        "beta shape": lambda: cp(q, k, v, g, beta[..., :1], mesh),
        "initial_state shape": lambda: cp(q, k, v, g, beta, mesh, initial_state=h0[:, :1]),
        "chunk_size": lambda: cp(q, k, v, g, beta, mesh, chunk_size=0),
        "layer protocol": lambda: cp(q, k, v, g, beta, mesh, protocol="tree"),
        "layer group_size": lambda: cp(q, k, v, g, beta, mesh, protocol="p2p", group_size=2),
        "layer triton dims": lambda: cp(q24, q24, v, q24, beta, mesh, backend="triton"),
    }  # fmt: skip


def _errors_rank() -> dict[str, Any]:
    P = dist.get_world_size()
    mesh = init_device_mesh("cpu", (P,), mesh_dim_names=("cp",))
    mesh2d = init_device_mesh("cpu", (2, P // 2), mesh_dim_names=("a", "b"))
    shuffled = DeviceMesh("cpu", torch.arange(P - 1, -1, -1), mesh_dim_names=("cp",))
    cases = _cases(mesh, mesh2d, shuffled)
    calls: list[str] = []
    saved = {name: getattr(dist, name) for name in _COMM}
    saved_gather = exchange_mod._all_gather_single

    def spy(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return fn(*args, **kwargs)

        return wrapped

    for name, fn in saved.items():
        setattr(dist, name, spy(name, fn))
    exchange_mod._all_gather_single = spy("all_gather_single", saved_gather)
    raised: dict[str, str] = {}
    try:
        for name, call in cases.items():
            try:
                call()
            except ValueError as exc:
                raised[name] = str(exc)
            else:
                raised[name] = "NO ERROR"
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
        exchange_mod._all_gather_single = saved_gather
    # The group is still usable: a collective and a real exchange complete.
    t = torch.ones(1)
    dist.all_reduce(t)
    eye = torch.eye(16).expand(1, 1, 16, 16).contiguous()
    h = build_state_exchange(mesh, "p2p").forward(torch.ones(1, 1, 16, 16), eye)
    return {"raised": raised, "calls": calls, "sum": t.item(), "h": h[0, 0, 0, 0].item()}


def test_every_bad_input_raises_on_every_rank_before_communicating() -> None:
    results = run_distributed(_errors_rank, 4, timeout=120)
    names = list(results[0]["raised"])
    assert len(names) == 21
    for r, res in enumerate(results):
        assert res["calls"] == [], f"rank {r} communicated: {res['calls']}"
        for name in names:
            assert res["raised"][name] != "NO ERROR", f"rank {r}: {name} was accepted"
            assert res["raised"][name] == results[0]["raised"][name]
        assert res["sum"] == 4.0
        assert res["h"] == float(r)
    msgs = results[0]["raised"]
    assert "unknown protocol" in msgs["unknown protocol"]
    assert "only valid for protocol 'grouped'" in msgs["group_size for p2p"]
    assert "positive int" in msgs["group_size bool"]
    assert "does not divide" in msgs["group_size not dividing"]
    assert "1-D" in msgs["2-D mesh"]
    assert "rank order" in msgs["shuffled rank order"]
    assert "float32" in msgs["fp64 summaries"]
    assert "unit column stride" in msgs["non-unit column stride"]
    assert "K and V in" in msgs["K unsupported by triton"]
    assert "outside [0, 4)" in msgs["rank outside [0, P)"]
