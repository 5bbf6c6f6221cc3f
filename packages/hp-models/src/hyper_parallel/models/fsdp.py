"""Gradient reduction by torch's own FSDP2 (``fully_shard``), over the mesh each block needs.

Each rank's backward yields the gradient of its own tokens' share of the loss (see
:mod:`hyper_parallel.models.loss`), so gradients must be SUMMED (not averaged) over the ranks
that computed a share:

==========================================  ===========================  =====================
module                                      parameters                   ``fully_shard`` mesh
==========================================  ===========================  =====================
each dense gated MLP (hp-mc2)               DTensor shards over ``tp``   ``cp`` (2-D with tp)
each decoder layer (mixers, norms, MoE)     whole on every rank          ``flat`` (cp·tp)
the experts of a MoE block at ``ep > 1``    DTensor shards over ``ep``   ``edp`` (2-D with ep)
the model (embeddings, final norm, head)    whole on every rank          ``flat`` (cp·tp)
==========================================  ===========================  =====================

with ``set_gradient_divide_factor(1.0)`` (sum; ``set_force_sum_reduction_for_comms`` keeps the
collective a plain SUM, which every backend, gloo included, has) and
``set_reduce_scatter_unused_params(True)`` (an MoE expert that no token of this rank's block
reached still joins the reduce-scatter, with zeros, so every rank issues the same collectives).
A ``MixedPrecisionPolicy`` (``mp_policy``) goes to every ``fully_shard``: e.g. float32 master
weights, ``param_dtype=torch.bfloat16`` (each block's parameters are all-gathered and computed
in bf16, its floating inputs cast to bf16) and ``reduce_dtype=torch.float32`` (gradients summed
in float32 into the float32 shards).
On a (dp, cp, tp) mesh the dense MLPs use HSDP over ``(dp, cp)`` (replicated over dp,
sharded over cp: FSDP2 all-reduces their gradients over dp) and the rest FSDP over every rank
(``dp·cp·tp``), so the sums include the other data-parallel replicas' rows.
Parameters become DTensors sharded over those meshes (FSDP2's usual ZeRO-3 layout): build the
optimizer after ``parallelize_model``; ``p.full_tensor()`` gives a whole parameter or gradient.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hyper_parallel.models.mesh import SequenceMesh

__all__ = ["apply_fsdp", "check_mp_policy", "fsdp_available"]


def _fsdp() -> Any:
    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard
    except ImportError:
        return None
    needed = ("set_gradient_divide_factor", "set_reduce_scatter_unused_params")
    if not all(hasattr(FSDPModule, name) for name in needed):
        return None
    return fully_shard


def fsdp_available() -> bool:
    """True where this torch's FSDP2 can sum gradients and include unused parameters
    (torch 2.13 has both); the answer is the same on every rank of one job."""
    return _fsdp() is not None


def check_mp_policy(mp_policy: Any, grad_reduction: str) -> None:
    """``mp_policy`` must be None or a ``torch.distributed.fsdp.MixedPrecisionPolicy``, and
    needs FSDP2 (``grad_reduction`` ``"fsdp"``, or ``"auto"`` where FSDP2 is available): with
    ``"allreduce"`` nothing would apply it, so it is refused (``ValueError``) rather than
    ignored. Collective-free and the same on every rank."""
    if mp_policy is None:
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy  # torch >= 2.6

    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            "mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy or None, got "
            f"{type(mp_policy).__name__}"
        )
    if grad_reduction == "allreduce" or not fsdp_available():
        raise ValueError(
            "mp_policy is FSDP2's mixed precision and needs grad_reduction='fsdp' (FSDP2 with "
            f"set_gradient_divide_factor, torch 2.13); got grad_reduction={grad_reduction!r} "
            "on torch " + torch.__version__ + ". For bf16 compute without FSDP2, run the "
            "forward under torch.autocast instead"
        )


def apply_fsdp(
    model: nn.Module,
    base: nn.Module,
    roles: dict[str, str],
    sm: SequenceMesh,
    mp_policy: Any = None,
    edp: Any = None,
) -> None:
    """Wrap the blocks of an already parallelised ``model`` (see the module docstring), each
    with ``mp_policy`` (a ``MixedPrecisionPolicy``; None: FSDP2's default, no casting)."""
    fully_shard = _fsdp()
    if fully_shard is None:
        raise RuntimeError("this torch's FSDP2 cannot sum gradients with unused parameters")
    kw = {} if mp_policy is None else {"mp_policy": mp_policy}
    wrapped = []
    if edp is not None:  # experts split over ep (DTensors on ep): sharded over the edp ranks
        for path, role in roles.items():
            if role == "moe":
                experts = base.get_submodule(path).get_submodule("experts")
                wrapped.append(fully_shard(experts, mesh=edp, **kw))
    for path, role in roles.items():  # blocks reduced over another mesh than the layer's
        if sm.fsdp_mesh_for(role) is not sm.fsdp_mesh:
            wrapped.append(fully_shard(base.get_submodule(path), mesh=sm.fsdp_mesh_for(role), **kw))
    for layer in base.get_submodule("layers").children():
        wrapped.append(fully_shard(layer, mesh=sm.fsdp_mesh, **kw))
    wrapped.append(fully_shard(model, mesh=sm.fsdp_mesh, **kw))
    for module in wrapped:
        module.set_gradient_divide_factor(1.0)
        module.set_reduce_scatter_unused_params(True, recurse=False)
        if hasattr(module, "set_force_sum_reduction_for_comms"):
            # plain SUM on the wire: gloo has no PREMUL_SUM, which FSDP2 picks for float32
            module.set_force_sum_reduction_for_comms(True)
