"""Hybrid Ulysses × all-gather context parallelism over one CP mesh.

The P = G·U ranks of the CP mesh are unflattened into (gather G, ulysses U): Ulysses groups
are U contiguous ranks, so after the seq→head all-to-all a rank holds the contiguous
sequence block of its Ulysses group (S/G tokens) for H/U heads; keys and values are then
all-gathered across the G groups and the queries attend causally with their global offset.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from hyper_parallel.context_parallel.collectives import (
    all_gather_blocking,
    ulysses_head_to_seq,
    ulysses_seq_to_head,
)
from hyper_parallel.dtensor import DeviceMesh, checked_entry, unflatten
from hyper_parallel.dtensor.cache import WorldCache

__all__ = ["hybrid_attention", "hybrid_meshes"]

# (id of the CP mesh, degree) -> (that mesh, ulysses, gather); emptied in a new world, and the
# mesh itself is kept and compared, so a recycled id never matches another mesh
_MESHES: WorldCache[tuple[int, int], tuple[DeviceMesh, DeviceMesh, DeviceMesh]] = WorldCache()


def _check_degree(cp_mesh: Any, degree: Any) -> int:
    if not isinstance(cp_mesh, DeviceMesh):
        raise TypeError(f"cp_mesh must be a 1-D torch DeviceMesh, got {type(cp_mesh).__name__}")
    if cp_mesh.ndim != 1:
        raise ValueError(f"cp_mesh must be 1-D, got a {cp_mesh.ndim}-D mesh")
    if not isinstance(degree, int) or isinstance(degree, bool):
        raise TypeError(f"ulysses_degree must be an int, got {degree!r}")
    p = cp_mesh.size()
    if not 1 < degree < p or p % degree:
        raise ValueError(
            f"ulysses_degree must satisfy 1 < degree < {p} and divide the CP size {p}, got {degree}"
        )
    return p


def hybrid_meshes(cp_mesh: DeviceMesh, ulysses_degree: int) -> tuple[DeviceMesh, DeviceMesh]:
    """``(ulysses_mesh, gather_mesh)`` of this rank, from ``unflatten(cp_mesh, 0, (P/U, U))``.

    Ulysses groups are contiguous: CP 8, degree 2 -> {0,1},{2,3},{4,5},{6,7}; gather groups
    take one rank per Ulysses group: {0,2,4,6},{1,3,5,7}. ``TypeError`` when the degree is
    not an int (or is a bool); ``ValueError`` unless ``1 < U < P`` and U divides P.
    """
    p = _check_degree(cp_mesh, ulysses_degree)
    key = (id(cp_mesh), ulysses_degree)
    cached = _MESHES.get(key)
    if cached is not None and cached[0] is cp_mesh:
        return cached[1], cached[2]
    base = cp_mesh.mesh_dim_names[0] if cp_mesh.mesh_dim_names else "cp"
    gname, uname = f"{base}_gather", f"{base}_ulysses"
    mesh2 = unflatten(cp_mesh, 0, (p // ulysses_degree, ulysses_degree), (gname, uname))
    ulysses, gather = mesh2[uname], mesh2[gname]
    _MESHES[key] = (cp_mesh, ulysses, gather)
    return ulysses, gather


@checked_entry(
    "hybrid_attention",
    compare=("q", "k", "v", "ulysses_degree"),
    group="cp_mesh",
    extra={"cp_size": lambda args: args.cp_mesh.size()},
)
def hybrid_attention(
    attn_fn: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cp_mesh: DeviceMesh,
    ulysses_degree: int,
) -> Tensor:
    """Causal attention over a sequence split across the CP mesh.

    ``q, k [B, S/P, H, dk]``, ``v [B, S/P, H, dv]`` on rank r hold tokens
    ``[r·S/P, (r+1)·S/P)``; returns ``[B, S/P, H, dv]`` for the same tokens, equal to
    single-process causal attention. ``attn_fn(q, k, v, attn_mask)`` works on ``[B, h, L, d]``
    tensors with a boolean mask ``[Lq, Lk]`` (True = attend), e.g.
    ``torch.nn.functional.scaled_dot_product_attention``. Keys past the query block are not
    gathered into the computation (causality), so ``Lk = (g + 1)·S/G`` on gather rank g.

    Consistency mode (hp-dtensor's README, "Ranks that disagree"): the ranks of ``cp_mesh``
    compare ``q``, ``k``, ``v``, ``ulysses_degree`` and the CP size, once, before anything else.
    """
    _check_degree(cp_mesh, ulysses_degree)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor [B, S/P, H, d]")
        if t.shape[:3] != q.shape[:3]:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, q has {tuple(q.shape)}")
    if q.shape[2] % ulysses_degree:
        raise ValueError(f"heads ({q.shape[2]}) not divisible by ulysses_degree {ulysses_degree}")
    umesh, gmesh = hybrid_meshes(cp_mesh, ulysses_degree)
    q_u = ulysses_seq_to_head(q, 1, 2, umesh)  # [B, S/G, H/U, d]
    k_u = ulysses_seq_to_head(k, 1, 2, umesh)
    v_u = ulysses_seq_to_head(v, 1, 2, umesh)
    g = gmesh.get_local_rank()
    lq = q_u.shape[1]
    n_keys = (g + 1) * lq
    k_all = all_gather_blocking(k_u, 1, gmesh, "k")[:, :n_keys]
    v_all = all_gather_blocking(v_u, 1, gmesh, "v")[:, :n_keys]
    qpos = torch.arange(g * lq, (g + 1) * lq, device=q.device)
    kpos = torch.arange(n_keys, device=q.device)
    mask = kpos[None, :] <= qpos[:, None]
    out = attn_fn(q_u.transpose(1, 2), k_all.transpose(1, 2), v_all.transpose(1, 2), mask)
    return ulysses_head_to_seq(out.transpose(1, 2), 1, 2, umesh)
