"""Bad inputs raise ValueError on every rank before any communication; the group still works.

Rejected inputs (README, "Errors"); each case names the message it must carry:
- S/M: dtype other than fp32, shape mismatch, device mismatch, non-unit column stride;
- K or V unsupported by the chosen backend (explicit ``kernel="triton"``);
- ``rank`` outside ``[0, P)``;
- unknown protocol, unknown kernel;
- ``group_size`` not a positive int (bools rejected), not dividing P, or given to a protocol
  that takes none;
- a mesh that is not 1-D, or whose rank order is not chronological;
- kda_context_parallel: mismatched q/k/v/g/beta/initial_state shapes, bad chunk_size;
- causal_conv_halo: bad width, seq_dim, mesh;
- parallelize_kda: bad protocol/group_size/mesh; a call with cache_params, an attention_mask,
  seq_idx, a malformed cu_seqlens table (not starting at 0, not strictly increasing, not
  integer, B > 1) or hidden states of the wrong width; kda_context_parallel: the same tables.
  A module of another kind is a TypeError, a second rewrite a RuntimeError.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _kda_hf import kda_layer
from _kda_testutil import kda_inputs

from hyper_parallel.dtensor import DeviceMesh, init_device_mesh
from hyper_parallel.dtensor import comm as comm_mod
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.kda import (
    affine_merge,
    build_state_exchange,
    causal_conv_halo,
    kda_context_parallel,
    parallelize_kda,
    unparallelize_kda,
)

_COMM = ["send", "recv", "isend", "irecv", "broadcast", "all_reduce", "all_gather",
         "all_gather_into_tensor", "all_gather_single", "new_group", "barrier"]  # fmt: skip


def _cases(mesh: Any, mesh2d: Any, shuffled: Any) -> dict[str, tuple[str, Callable[[], object]]]:
    """name -> (the message the ValueError must contain, the call)."""
    S = torch.randn(1, 2, 16, 32)
    M = torch.randn(1, 2, 16, 16)
    ex = build_state_exchange(mesh, "allgather")
    ex_tr = build_state_exchange(mesh, "p2p", kernel="triton")
    q, k, v, g, beta, h0 = (x.float() for x in kda_inputs(1, 6, 2, 16, 32))
    q24 = torch.randn(1, 6, 2, 24)
    S4, M4 = S.expand(4, -1, -1, -1, -1), M.expand(4, -1, -1, -1, -1)
    S24, M24 = torch.randn(1, 2, 24, 32), torch.randn(1, 2, 24, 24)
    cp = kda_context_parallel
    layer = parallelize_kda(kda_layer(), mesh, protocol="p2p")
    x = torch.randn(1, 5, 32, dtype=torch.float64)
    return {
        "unknown protocol": ("unknown protocol 'ring'", lambda: build_state_exchange(mesh, "ring")),
        "unknown kernel": ("unknown kernel 'cuda'",
                            lambda: build_state_exchange(mesh, "p2p", kernel="cuda")),
        "group_size for p2p": ("only valid for protocol 'grouped', not 'p2p'",
                               lambda: build_state_exchange(mesh, "p2p", 2)),
        "group_size for auto": ("only valid for protocol 'grouped', not 'auto'",
                                lambda: build_state_exchange(mesh, "auto", 2)),
        "group_size bool": ("positive int, got True",
                            lambda: build_state_exchange(mesh, "grouped", True)),
        "group_size zero": ("positive int, got 0",
                            lambda: build_state_exchange(mesh, "grouped", 0)),
        "group_size not dividing": ("group_size 3 does not divide the mesh size 4",
                                    lambda: build_state_exchange(mesh, "grouped", 3)),
        "2-D mesh": ("must be 1-D", lambda: build_state_exchange(mesh2d, "p2p")),
        "shuffled rank order": ("rank order", lambda: build_state_exchange(shuffled, "allgather")),
        "fp64 summaries": ("must be float32", lambda: ex.forward(S.double(), M.double())),
        "S/M shape mismatch": ("do not match", lambda: ex.forward(S, M[:, :1])),
        "S/M device mismatch": ("states on cpu but matrices on meta",
                                lambda: ex.forward(S, M.to("meta"))),
        "non-unit column stride": ("unit column stride",
                                   lambda: ex.backward(S.transpose(-1, -2)[..., :16, :], M)),
        "K unsupported by triton": ("K and V in", lambda: ex_tr.forward(S24, M24)),
        "rank outside [0, P)": ("rank 4 outside [0, 4)", lambda: affine_merge(S4, M4, 4)),
        "beta shape": ("beta must be [B, T, H]", lambda: cp(q, k, v, g, beta[..., :1], mesh)),
        "initial_state shape": ("initial_state must be [B, H, K, V]",
                                lambda: cp(q, k, v, g, beta, mesh, initial_state=h0[:, :1])),
        "chunk_size": ("chunk_size must be a positive int",
                       lambda: cp(q, k, v, g, beta, mesh, chunk_size=0)),
        "layer protocol": ("unknown protocol 'tree'",
                           lambda: cp(q, k, v, g, beta, mesh, protocol="tree")),
        "layer group_size": ("only valid for protocol 'grouped'",
                             lambda: cp(q, k, v, g, beta, mesh, protocol="p2p", group_size=2)),
        "layer triton dims": ("kernel 'triton' does not support these dims",
                              lambda: cp(q24, q24, v, q24, beta, mesh, kernel="triton")),
        "halo width": ("width must be a positive int", lambda: causal_conv_halo(x, 0, mesh)),
        "halo seq_dim": ("seq_dim 3 is not a dim", lambda: causal_conv_halo(x, 4, mesh, seq_dim=3)),
        "halo 2-D mesh": ("halo mesh must be 1-D", lambda: causal_conv_halo(x, 4, mesh2d)),
        "halo target": ("needs a 1-D DeviceMesh or a ProcessGroup",
                        lambda: causal_conv_halo(x, 4, "cp")),
        "kda cache_params": ("cache_params (a generation cache) is not supported",
                             lambda: layer(x, cache_params=object())),
        "kda attention_mask": ("an attention_mask (padding) is not supported",
                               lambda: layer(x, attention_mask=torch.ones(1, 5))),
        "kda seq_idx": ("seq_idx is not supported",
                        lambda: layer(x, seq_idx=torch.zeros(1, 5, dtype=torch.int32))),
        "kda table start": ("cu_seqlens must start at 0",
                            lambda: layer(x, cu_seqlens=torch.tensor([1, 20]))),
        "kda table order": ("strictly increasing",
                            lambda: layer(x, cu_seqlens=torch.tensor([0, 3, 3, 20]))),
        "kda table B>1": ("batch size 1",
                          lambda: layer(x.expand(2, 5, 32), cu_seqlens=torch.tensor([0, 20]))),
        "kda table float": ("integer tensor",
                            lambda: layer(x, cu_seqlens=torch.tensor([0.0, 20.0]))),
        "layer table": ("cu_seqlens must start at 0",
                        lambda: cp(q, k, v, g, beta, mesh, cu_seqlens=torch.tensor([2, 24]))),
        "kda hidden size": ("hidden_states has 8 features, the layer expects 32",
                            lambda: layer(x[..., :8])),
        "parallelize protocol": ("unknown protocol 'ring'",
                                 lambda: parallelize_kda(kda_layer(), mesh, protocol="ring")),
        "parallelize group_size": ("group_size 3 does not divide",
                                   lambda: parallelize_kda(kda_layer(), mesh, protocol="grouped",
                                                           group_size=3)),
        "parallelize 2-D mesh": ("must be 1-D", lambda: parallelize_kda(kda_layer(), mesh2d)),
    }  # fmt: skip


def _errors_rank() -> dict[str, Any]:
    P = dist.get_world_size()
    mesh = init_device_mesh("cpu", (P,), mesh_dim_names=("cp",))
    mesh2d = init_device_mesh("cpu", (2, P // 2), mesh_dim_names=("a", "b"))
    shuffled = DeviceMesh("cpu", torch.arange(P - 1, -1, -1), mesh_dim_names=("cp",))
    cases = _cases(mesh, mesh2d, shuffled)
    calls: list[str] = []
    saved = {name: getattr(dist, name) for name in _COMM}
    saved_gather = comm_mod.all_gather_single  # what every all-gather of comm calls

    def spy(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return fn(*args, **kwargs)

        return wrapped

    for name, fn in saved.items():
        setattr(dist, name, spy(name, fn))
    comm_mod.all_gather_single = spy("all_gather_single", saved_gather)
    raised: dict[str, str] = {}
    try:
        for name, (_, call) in cases.items():
            try:
                call()
            except ValueError as exc:
                raised[name] = str(exc)
            else:
                raised[name] = "NO ERROR"
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
        comm_mod.all_gather_single = saved_gather
    # The group is still usable: a collective and a real exchange complete.
    t = torch.ones(1)
    dist.all_reduce(t)
    eye = torch.eye(16).expand(1, 1, 16, 16).contiguous()
    h = build_state_exchange(mesh, "p2p").forward(torch.ones(1, 1, 16, 16), eye)
    return {
        "raised": raised,
        "expected": {name: match for name, (match, _) in cases.items()},
        "calls": calls,
        "sum": t.item(),
        "h": h[0, 0, 0, 0].item(),
    }


def test_every_bad_input_raises_on_every_rank_before_communicating() -> None:
    results = run_distributed(_errors_rank, 4, timeout=120)
    expected = results[0]["expected"]
    assert len(expected) == 37
    for r, res in enumerate(results):
        assert res["calls"] == [], f"rank {r} communicated: {res['calls']}"
        for name, match in expected.items():
            got = res["raised"][name]
            assert match in got, f"rank {r}: {name}: expected {match!r}, got {got!r}"
            assert got == results[0]["raised"][name]
        assert res["sum"] == 4.0
        assert res["h"] == float(r)


def _type_errors_rank() -> dict[str, str]:
    """A module of another kind and a second parallelize: TypeError / RuntimeError, before any
    communication, naming the supported class."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    layer = parallelize_kda(kda_layer(), mesh, protocol="p2p")
    out = {}
    for name, call in {
        "linear": lambda: parallelize_kda(torch.nn.Linear(2, 2), mesh),
        "not a mesh": lambda: parallelize_kda(kda_layer(), "cp"),
        "twice": lambda: parallelize_kda(layer, mesh),
        "undo twice": lambda: unparallelize_kda(unparallelize_kda(layer)),
    }.items():
        try:
            call()
            out[name] = "NO ERROR"
        except (TypeError, RuntimeError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


def test_wrong_module_and_repeated_rewrites_raise_typed_errors_naming_the_classes() -> None:
    for res in run_distributed(_type_errors_rank, 2, timeout=120):
        assert res["linear"].startswith(
            "TypeError: parallelize_kda supports KimiLinearDeltaAttention"
        )
        assert "got Linear" in res["linear"]
        assert res["not a mesh"] == "TypeError: cp_mesh must be a 1-D torch DeviceMesh, got str"
        assert res["twice"].startswith("RuntimeError: parallelize_kda was already applied")
        assert res["undo twice"].startswith("RuntimeError: module is not context-parallel")
