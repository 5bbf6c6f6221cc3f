"""Gradient clipping by the total norm of a parallelised model's gradients, counted once each.

After :func:`~hyper_parallel.models.sync_gradients` every rank holds, for each parameter, either
the whole gradient (a plain tensor, the same on every rank: ``grad_reduction="allreduce"``) or
a DTensor whose local tensor is one shard of it (hp-mc2's ``tp`` shards, FSDP2's shards, HSDP's
replicated shards). ``torch.nn.utils.clip_grad_norm_`` cannot take that mix (parameters on
different meshes). Here each gradient's local tensor contributes ``Σ |g|^p`` (or ``max |g|``)

- once per distinct shard: a DTensor's local tensor counts on the rank whose coordinate is 0 on
  every mesh dim where the placement is ``Replicate`` (other ranks hold a copy), and the
  contributions are summed over that DTensor's own mesh (one all-reduce per mesh dim);
- a plain tensor counts whole, on every rank (each rank holds all of it, so no reduction).

Ranks outside a DTensor's mesh hold the same values as their counterpart inside it (the
gradients are in sync), so every rank ends with the same total. The collectives depend only on
the parameters' meshes and placements (the same on every rank), not on which gradients exist.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate

from hyper_parallel.dtensor import comm
from hyper_parallel.models.state import OWNER, pipeline_parts, plan_of

__all__ = ["clip_grad_norm_"]


def _placement_kind(p: Any) -> str:
    if isinstance(p, Replicate):
        return "replicate"
    # Shard and _StridedShard alike (FSDP2 over a tp shard): distinct data per coordinate
    if p.is_shard() or type(p).__name__ == "_StridedShard":
        return "shard"
    return "other"  # Partial: an unreduced gradient


def _check_norm_type(norm_type: Any) -> float:
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)):
        raise TypeError(f"norm_type must be a number, got {norm_type!r}")
    p = float(norm_type)
    if not p > 0:  # nan too
        raise ValueError(f"norm_type must be positive or inf, got {norm_type!r}")
    return p


def clip_grad_norm_(
    model: Any,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> Tensor:
    """Clip the gradients of a model parallelised by
    :func:`~hyper_parallel.models.parallelize_model` as ``torch.nn.utils.clip_grad_norm_``
    would on the serial model, in place; return the total norm before clipping.

    Call on every rank, after :func:`~hyper_parallel.models.sync_gradients` (the gradients must
    be the serial ones). A :class:`~hyper_parallel.models.PipelinedModel`: the norm over every
    stage of the pipeline (each stage's total over its ranks, then summed over pp).
    The total ``‖(g_1, ..., g_n)‖_p`` counts every gradient element once
    (see the module docstring); ``norm_type`` is a positive number or ``inf``. Every gradient is
    then multiplied by ``min(1, max_norm / (total + 1e-6))``, torch's rule.

    Returns a 0-d plain tensor, the same on every rank, on the gradients' device, in the
    widest gradient dtype promoted to at least float32 (float64 for a float64 model).

    Raised on every rank alike, before any collective: ``RuntimeError`` for a model not
    parallelised by ``parallelize_model``; ``TypeError``/``ValueError`` for a bad
    ``norm_type``; ``ValueError`` for a gradient left ``Partial`` (not reduced). With
    ``error_if_nonfinite``, ``RuntimeError`` on every rank when the total is nan or inf.
    """
    p = _check_norm_type(norm_type)
    inf = math.isinf(p)
    parts = pipeline_parts(model)
    if parts is None:
        plan_of(model, "clip_grad_norm_")
        total, grads = _local_total(model, p)
    else:  # each stage's total over its ranks, then over the pipeline (each stage once)
        for part in parts:
            plan_of(part, "clip_grad_norm_")
        terms = [_local_total(part, p) for part in parts]
        grads = [g for _, gs in terms for g in gs]
        dtype = functools.reduce(torch.promote_types, [t.dtype for t, _ in terms])
        total = torch.stack([t.to(dtype) for t, _ in terms])
        total = total.max() if inf else total.sum()
        pp_mesh = model.pp_mesh
        if pp_mesh is not None and pp_mesh.size() > 1:
            grp = comm.resolve_group(pp_mesh, "clip_grad_norm_")
            if inf:
                every = comm.start_all_gather(
                    total.reshape(1), 0, grp, "all_gather:grad_norm_max", "step", OWNER
                )
                total = every.wait().max()
            else:
                total = comm.start_all_reduce(
                    total, grp, "all_reduce:grad_norm", "step", OWNER
                ).wait()
    if not inf:
        total = total.pow(1.0 / p)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
            "so it cannot be clipped. To disable this error and scale the gradients by the "
            "non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total


def _local_total(model: nn.Module, p: float) -> tuple[Tensor, list[Tensor]]:
    """``(Σ |g|^p over every gradient element of ``model``, counted once, or the largest
    |g| for p = inf; the local gradient tensors)``, the same on every rank of the model's
    mesh."""
    inf = math.isinf(p)
    params = [q for q in model.parameters() if q.requires_grad]
    # one accumulator per distinct mesh (in parameter order: the same on every rank), plus one
    # for plain tensors; dtype: the widest gradient dtype, at least float32
    acc_dtype = torch.float32
    for q in params:
        acc_dtype = torch.promote_types(acc_dtype, q.dtype)
    meshes: list[Any] = []
    for q in params:
        if isinstance(q, DTensor):
            kinds = [_placement_kind(pl) for pl in q.placements]
            if "other" in kinds:
                raise ValueError(
                    f"clip_grad_norm_: a parameter has placements {q.placements}; only Shard "
                    "and Replicate are supported"
                )
            if not any(q.device_mesh == m for m in meshes):
                meshes.append(q.device_mesh)
    if not params:
        return torch.zeros((), dtype=acc_dtype), []
    device = (params[0].to_local() if isinstance(params[0], DTensor) else params[0]).device
    zero = torch.zeros((), dtype=acc_dtype, device=device)
    totals = [zero.clone() for _ in range(len(meshes) + 1)]  # last: plain tensors

    def add(slot: int, g: Tensor) -> None:
        if g.numel() == 0:
            return
        g = g.to(acc_dtype)
        if inf:
            totals[slot] = torch.maximum(totals[slot], g.abs().max())
        elif p == 2.0:
            totals[slot] = totals[slot] + g.pow(2).sum()
        else:
            totals[slot] = totals[slot] + g.abs().pow(p).sum()

    grads: list[Tensor] = []
    for q in params:
        g = q.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            local = g.to_local()
            grads.append(local)
            for pl in g.placements:
                if _placement_kind(pl) == "other":
                    raise ValueError(
                        f"clip_grad_norm_: a gradient is {g.placements} (not reduced); "
                        "call sync_gradients first"
                    )
            coord: list[int] = list(g.device_mesh.get_coordinate() or [])
            duplicate = any(
                _placement_kind(pl) == "replicate" and coord[d] != 0
                for d, pl in enumerate(g.placements)
            )
            if not isinstance(q, DTensor):
                raise ValueError("clip_grad_norm_: a plain parameter has a DTensor gradient")
            slot = next(i for i, m in enumerate(meshes) if m == q.device_mesh)
            if not duplicate:
                add(slot, local.detach())
        else:
            grads.append(g)
            add(len(meshes), g.detach())
    for slot, mesh in enumerate(meshes):
        for d in range(mesh.ndim):
            if mesh.size(d) > 1:
                grp = comm.resolve_group(mesh.get_group(d), "clip_grad_norm_")
                if inf:  # the largest of the ranks' maxima: gathered, then max (exact)
                    every = comm.start_all_gather(
                        totals[slot].reshape(1), 0, grp, "all_gather:grad_norm_max", "step", OWNER
                    )
                    totals[slot] = every.wait().max()
                else:
                    name = "all_reduce:grad_norm"
                    comm.start_all_reduce(totals[slot], grp, name, "step", OWNER).wait()
    if inf:
        return torch.stack(totals).max(), grads
    return torch.stack(totals).sum(), grads
