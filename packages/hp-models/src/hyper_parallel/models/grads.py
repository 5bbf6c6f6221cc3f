"""Summing every parameter gradient over the ranks that computed a share of it, for
``grad_reduction="allreduce"`` (with ``"fsdp"``, FSDP2 does it during backward and
:func:`sync_gradients` has nothing left to do).

After ``loss.backward()`` on a parallelised model each rank holds the gradient of its own
tokens' share of the loss:

- a parameter that is whole on every rank (embeddings, norms, attention and KDA weights, MoE
  routers, shared experts and, at ``ep = 1``, the routed experts, the LM head) has a share on
  every rank of the (cp, tp) mesh: summed over all of them;
- a routed expert split over ``ep`` ranks (hp-moe, ``ep > 1``) already holds the sum over its
  ep group (its owner computed every row routed to it): summed over ``edp``, the ranks holding
  the same experts;
- a tensor-parallel parameter of an MLP (a DTensor over ``tp``, from hp-mc2: the weight shards
  and the replicated down-projection bias alike) already holds the sum over its ``tp`` group,
  because hp-mc2's backward works on the gradient gathered over ``tp`` (the whole ``cp``
  chunk): summed over ``cp`` only. Which parameters these are is the ``scope`` of the
  block's role (:class:`~hyper_parallel.models.roles.Role`), the rule FSDP2's meshes follow
  too (``SequenceMesh.fsdp_mesh_for``).

On a (dp, cp, tp) mesh both sums also run over ``dp`` (the other replicas' rows): whole
parameters over every rank, tp parameters over ``cp`` then ``dp``.

Gradients are packed into one flat buffer per (group, dtype) and reduced with one
``all_reduce`` each (two for tp parameters with dp > 1). Which parameters have a gradient may
differ by rank (an MoE expert that no token of this rank's block was routed to): a flag vector
is all-reduced first (summed: a parameter is kept if any rank has its gradient), so every rank
sends the same buffers, and a parameter no rank touched keeps ``grad = None``. The collectives
start through ``hyper_parallel.dtensor.comm`` (owner ``"hp-models"``, phase ``"step"``):
``all_reduce:grad_flags``, then ``all_reduce:grads_world`` / ``all_reduce:grads_cp`` per
bucket, so they are recorded and appear in ``torch.profiler`` as ``hp.comm.*`` ranges.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from hyper_parallel.dtensor import checked_entry, comm
from hyper_parallel.dtensor.rewrite import parallel_state
from hyper_parallel.models.families import family_of
from hyper_parallel.models.mesh import SequenceMesh
from hyper_parallel.models.roles import Role
from hyper_parallel.models.state import LAYER, OWNER, ParallelPlan, pipeline_parts, plan_of

__all__ = ["sync_gradients"]


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _scopes(model: nn.Module, roles: dict[str, Role], ep: int) -> dict[int, str]:
    """``id(parameter) -> scope`` of its block's role (:attr:`Role.scope`) (the rule FSDP2's meshes
    follow too); parameters outside every role's block are ``"world"``; split experts
    (``ep > 1``) are ``"edp"``: summed over the ranks holding the same experts."""
    _, base = family_of(model)
    scopes: dict[int, str] = {}
    for path, role in roles.items():
        for p in base.get_submodule(path).parameters():
            scopes[id(p)] = role.scope
        if role.routed and ep > 1:
            for p in base.get_submodule(path).get_submodule("experts").parameters():
                scopes[id(p)] = "edp"
    return scopes


def _batch_mesh(args: Any) -> Any:
    """The mesh ``sync_gradients`` compares over: every rank of the batch (none for a model not
    parallelised: the body raises)."""
    return cast(ParallelPlan, parallel_state(args.model, LAYER)).mesh.batch


def _fields(args: Any) -> dict[str, Any] | None:
    """``sync_gradients``' consistency fields (``checked_entry``'s ``extra``): the trainable
    parameters (local shapes, dtypes) and the reduction. Nothing under FSDP2
    (``sync_gradients`` does nothing there)."""
    plan = cast(ParallelPlan, parallel_state(args.model, LAYER))
    if plan.grad_reduction == "fsdp":
        return None
    params = [_local(p) for p in args.model.parameters() if p.requires_grad]
    return {"params": params, "grad_reduction": plan.grad_reduction}


def sync_gradients(model: Any) -> None:
    """Sum each parameter's gradient over the ranks that computed a share of it (see the
    module docstring), in place, so that every gradient (``full_tensor()`` of a DTensor one)
    equals the serial model's on the full batch. Call after ``backward()`` (or
    :meth:`~hyper_parallel.models.PipelinedModel.step`), before the optimizer step, on every
    rank (a no-op under ``grad_reduction="fsdp"``, where FSDP2 has already reduced them;
    calling it keeps a training loop independent of the choice). A
    :class:`~hyper_parallel.models.PipelinedModel`: each of this rank's stages over its own
    ranks (every parameter lives in one stage: nothing is summed over pp). ``RuntimeError``
    if ``model`` was not parallelised by :func:`~hyper_parallel.models.parallelize_model` or
    :func:`~hyper_parallel.models.pipeline_model`. Consistency mode (hp-dtensor's README,
    "Ranks that disagree"): the ranks first compare the trainable parameters (local shapes,
    dtypes) and the reduction."""
    parts = pipeline_parts(model)
    for part in [model] if parts is None else parts:
        _sync_model(part)


@checked_entry("sync_gradients", group=_batch_mesh, extra=_fields)
def _sync_model(model: nn.Module) -> None:
    """:func:`sync_gradients` of one parallelised model."""
    plan = plan_of(model, "sync_gradients")
    if plan.grad_reduction == "fsdp":
        return  # FSDP2 summed the gradients during backward (reduce-scatter, divide factor 1)
    sm: SequenceMesh = plan.mesh
    params = [p for p in model.parameters() if p.requires_grad]
    everyone = sm.batch  # every rank holding a share of the global batch
    if not params:
        return
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
    dev = _local(params[0]).device
    if everyone.size() > 1:
        grp = comm.resolve_group(everyone, "sync_gradients")
        flags = comm.start_all_reduce(has.to(dev), grp, "all_reduce:grad_flags", "step", OWNER)
        has = flags.wait().cpu()
    groups: dict[str, list[Any]] = {
        "world": [everyone],
        "cp": [sm.cp] if sm.dp is None else [sm.cp, sm.dp],
        "edp": [] if plan.moe is None or plan.moe.ep == 1 else [plan.moe.edp_mesh],
    }
    scopes = _scopes(model, plan.roles, 1 if plan.moe is None else plan.moe.ep)
    buckets: dict[tuple[str, torch.dtype, torch.device], list[Tensor]] = {}
    for p, flag in zip(params, has.tolist()):
        if not flag:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        g = _local(p.grad)
        key = (scopes.get(id(p), "world"), g.dtype, g.device)
        buckets.setdefault(key, []).append(g)
    for (name, _, _), grads in sorted(buckets.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        meshes = [m for m in groups[name] if m.size() > 1]
        if not meshes:
            continue
        flat = torch.cat([g.reshape(-1) for g in grads])
        for m in meshes:
            grp = comm.resolve_group(m, "sync_gradients")
            comm.start_all_reduce(flat, grp, f"all_reduce:grads_{name}", "step", OWNER).wait()
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset : offset + n].view_as(g))
            offset += n
