"""kda_context_parallel on 2 and 4 gloo ranks: forward, final state and every gradient equal the
float64 serial reference on the whole sequence, for every protocol, with empty chunks too; the
executor cache follows a new world."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _kda_testutil import bounds, kda_inputs, max_rel_err, new_world

from hyper_parallel.dtensor import init_device_mesh
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.kda import kda_context_parallel, naive_recurrent_kda
from hyper_parallel.kda import layer as layer_mod

# (B, T, H, K, V, chunk_size): lengths that no rank's chunk size divides; K = V = 128 included.
SMALL = (2, 45, 2, 16, 32, 8)
WIDE = (1, 37, 1, 128, 128, 16)

CONFIGS: dict[int, list[tuple[tuple[int, ...], str, int | None]]] = {
    2: [(SMALL, p, w) for p, w in [("p2p", None), ("allgather", None), ("grouped", 1),
                                    ("grouped", 2), ("auto", None)]]
    + [(WIDE, p, w) for p, w in [("p2p", None), ("allgather", None), ("grouped", 2),
                                  ("auto", None)]],
    4: [(SMALL, p, w) for p, w in [("p2p", None), ("allgather", None), ("grouped", 2),
                                    ("auto", None)]]
    + [(WIDE, p, w) for p, w in [("p2p", None), ("allgather", None), ("grouped", 2),
                                  ("auto", None)]],
}  # fmt: skip


def _weights(shape: torch.Size, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _layer_rank(P: int) -> list[Any]:
    mesh = init_device_mesh("cpu", (P,), mesh_dim_names=("cp",))
    r = dist.get_rank()
    out: list[Any] = []
    for (B, T, H, K, V, C), protocol, width in CONFIGS[P]:
        *qkvgb, h0 = kda_inputs(B, T, H, K, V, seed=T + K)
        lo, hi = bounds(T, P)[r : r + 2]
        xs = [x[:, lo:hi].float().requires_grad_() for x in qkvgb]
        h0 = h0.float().requires_grad_()
        o, hT = kda_context_parallel(
            *xs, mesh, protocol=protocol, group_size=width, initial_state=h0,
            output_final_state=True, chunk_size=C,
        )  # fmt: skip
        assert (hT is not None) == (r == P - 1)
        loss = (o.double() * _weights(o.shape, seed=r)).sum()
        if hT is not None:
            loss = loss + (hT.double() ** 2).sum()
        loss.backward()
        out.append((o.detach(), hT if hT is None else hT.detach(), [x.grad for x in xs], h0.grad))
    out.append(_two_layers(mesh, P, r))
    if P == 4:
        out.append(_empty_chunks(mesh, r))
    return out


# Empty chunks (T = 0) on a middle rank and on the last rank (which then holds the final state
# without holding a token), with gradients: every rank must still join the backward exchange.
EMPTY = {"middle": [0, 5, 5, 9, 12], "last": [0, 4, 8, 12, 12]}
EMPTY_SHAPE = (2, 12, 2, 16, 32)


def _empty_chunks(mesh: object, r: int) -> list[Any]:
    out = []
    for cuts in EMPTY.values():
        for protocol in ("p2p", "allgather", "grouped"):
            *qkvgb, h0 = kda_inputs(*EMPTY_SHAPE, seed=5)
            xs = [x[:, cuts[r] : cuts[r + 1]].float().requires_grad_() for x in qkvgb]
            h0 = h0.float().requires_grad_()
            o, hT = kda_context_parallel(
                *xs, mesh, protocol=protocol, initial_state=h0, output_final_state=True,
                chunk_size=4,
            )  # fmt: skip
            loss = (o.double() * _weights(o.shape, seed=r)).sum()
            if hT is not None:
                loss = loss + (hT.double() ** 2).sum()
            loss.backward()
            out.append((o.detach(), hT, [x.grad for x in xs], h0.grad))
    return out


def _check_empty_chunks(results: list[Any]) -> None:
    P = len(results)
    i = 0
    for name, cuts in EMPTY.items():
        inputs = [x.requires_grad_() for x in kda_inputs(*EMPTY_SHAPE, seed=5)]
        *qkvgb, h0 = inputs
        o_ref, hT_ref = naive_recurrent_kda(*qkvgb, initial_state=h0, output_final_state=True)
        assert hT_ref is not None
        loss = (hT_ref**2).sum() + sum(
            (o_ref[:, cuts[r] : cuts[r + 1]] * _weights(results[r][-1][i][0].shape, seed=r)).sum()
            for r in range(P)
        )
        grads = torch.autograd.grad(loss, inputs)
        for protocol in ("p2p", "allgather", "grouped"):
            got = [results[r][-1][i] for r in range(P)]
            tag = (name, protocol)
            assert max_rel_err(torch.cat([g[0] for g in got], dim=1), o_ref) < 1e-4, tag
            assert max_rel_err(got[-1][1], hT_ref) < 1e-4, tag
            for j in range(5):
                grad = torch.cat([g[2][j] for g in got], dim=1)
                assert max_rel_err(grad, grads[j]) < 5e-4, (*tag, "qkvgb"[j])
            assert max_rel_err(got[0][3], grads[5]) < 1e-4, (*tag, "h0")
            i += 1


def _two_layers(mesh: object, P: int, r: int) -> tuple[Any, ...]:
    """Two layers stacked: both exchanges are in flight when backward starts, and autograd runs
    their backwards in reverse order."""
    *qkvgb, _ = kda_inputs(*SMALL[:5], seed=3)
    lo, hi = bounds(SMALL[1], P)[r : r + 2]
    q, k, v, g, beta = (x[:, lo:hi].float().requires_grad_() for x in qkvgb)
    o1, _ = kda_context_parallel(q, k, v, g, beta, mesh, protocol="grouped", chunk_size=8)
    o2, _ = kda_context_parallel(q, k, o1, g, beta, mesh, protocol="p2p", chunk_size=8)
    (o2.double() * _weights(o2.shape, seed=r)).sum().backward()
    return o2.detach(), [x.grad for x in (q, k, v, g, beta)]


@pytest.mark.parametrize("P", [2, 4])
def test_context_parallel_kda_equals_serial_reference_forward_and_gradients(P: int) -> None:
    results = run_distributed(_layer_rank, P, P, timeout=240)
    for i, ((B, T, H, K, V, _), protocol, width) in enumerate(CONFIGS[P]):
        inputs = [x.requires_grad_() for x in kda_inputs(B, T, H, K, V, seed=T + K)]
        *qkvgb, h0 = inputs
        o_ref, hT_ref = naive_recurrent_kda(*qkvgb, initial_state=h0, output_final_state=True)
        assert hT_ref is not None
        cuts = bounds(T, P)
        loss = (hT_ref**2).sum() + sum(
            (o_ref[:, cuts[r] : cuts[r + 1]] * _weights(results[r][i][0].shape, seed=r)).sum()
            for r in range(P)
        )
        grads = torch.autograd.grad(loss, inputs)
        tag = (protocol, width, K)
        o = torch.cat([results[r][i][0] for r in range(P)], dim=1)
        assert o.dtype == torch.float32
        assert max_rel_err(o, o_ref) < 1e-4, tag
        assert max_rel_err(results[P - 1][i][1], hT_ref) < 1e-4, tag
        for j in range(5):
            got = torch.cat([results[r][i][2][j] for r in range(P)], dim=1)
            assert max_rel_err(got, grads[j]) < 5e-4, (*tag, "qkvgb"[j])
        assert max_rel_err(results[0][i][3], grads[5]) < 1e-4, (*tag, "h0")
        assert all(results[r][i][3] is None for r in range(1, P)), tag

    two = -2 if P == 4 else -1  # the two-layer result (the empty-chunk results follow on 4)
    *qkvgb, _ = (x.requires_grad_() for x in kda_inputs(*SMALL[:5], seed=3))
    q, k, v, g, beta = qkvgb
    o1, _ = naive_recurrent_kda(q, k, v, g, beta)
    o2, _ = naive_recurrent_kda(q, k, o1, g, beta)
    cuts = bounds(SMALL[1], P)
    loss = sum(
        (o2[:, cuts[r] : cuts[r + 1]] * _weights(results[r][two][0].shape, seed=r)).sum()
        for r in range(P)
    )
    grads = torch.autograd.grad(loss, qkvgb)
    assert max_rel_err(torch.cat([res[two][0] for res in results], dim=1), o2) < 1e-4
    for j in range(5):
        got = torch.cat([res[two][1][j] for res in results], dim=1)
        assert max_rel_err(got, grads[j]) < 5e-4, "qkvgb"[j]
    if P == 4:
        _check_empty_chunks(results)


def _new_world() -> tuple[Any, ...]:
    """The executor cache follows a new world: after destroy_process_group and a new
    init_process_group, an equal mesh gets a new executor bound to the new group."""
    P, r = dist.get_world_size(), dist.get_rank()
    *qkvgb, _ = kda_inputs(*SMALL[:5], seed=3)
    lo, hi = bounds(SMALL[1], P)[r : r + 2]
    xs = [x[:, lo:hi].float() for x in qkvgb]
    mesh = init_device_mesh("cpu", (P,), mesh_dim_names=("cp",))
    o1, _ = kda_context_parallel(*xs, mesh, protocol="p2p", chunk_size=8)
    ex1 = layer_mod.executor_for(mesh, "p2p", None, "auto", None)
    new_world()
    mesh2 = init_device_mesh("cpu", (P,), mesh_dim_names=("cp",))
    o2, _ = kda_context_parallel(*xs, mesh2, protocol="p2p", chunk_size=8)
    ex2 = layer_mod.executor_for(mesh2, "p2p", None, "auto", None)
    return mesh2 == mesh, ex2 is not ex1, ex2.group is mesh2.get_group(0), torch.equal(o1, o2)


def test_executor_cache_follows_a_new_world() -> None:
    for equal_mesh, new_executor, new_group, same_result in run_distributed(_new_world, 2):
        assert equal_mesh  # torch compares meshes by structure: the key alone cannot tell
        assert new_executor and new_group and same_result
