"""Gradient reduction by torch's own FSDP2 (``fully_shard``), over the mesh each block needs.

Each rank's backward yields the gradient of its own tokens' share of the loss (see
:mod:`hyper_parallel.models.loss`), so gradients must be SUMMED (not averaged) over the ranks
that computed a share:

==========================================  ===========================  =====================
module                                      parameters                   ``fully_shard`` mesh
==========================================  ===========================  =====================
each dense gated MLP (hp-mc2)               DTensor shards over ``tp``   ``cp`` / ``dp_cp`` (+tp)
each decoder layer (mixers, norms, MoE)     whole on every rank          ``flat`` (cp·tp)
the experts of a MoE block at ``ep > 1``    DTensor shards over ``ep``   ``edp`` (2-D with ep)
the model (embeddings, final norm, head)    whole on every rank          ``flat`` (cp·tp)
==========================================  ===========================  =====================

A ``MixedPrecisionPolicy`` (``mp_policy``) goes to every ``fully_shard``: e.g. float32 master
weights, ``param_dtype=torch.bfloat16`` (each block's parameters are all-gathered and computed
in bf16, its floating inputs cast to bf16) and ``reduce_dtype=torch.float32`` (gradients summed
in float32 into the float32 shards).
On a (dp, cp, tp) mesh the dense MLPs use FSDP over ``dp_cp``, the ``dp·cp`` ranks that hold
the same tp shard (``SequenceMesh.fsdp_mlp_mesh``: a 1-D slice of the ``(dp·cp, tp)`` mesh),
and the rest FSDP over every rank (``dp·cp·tp``), so the sums include the other
data-parallel replicas' rows and each tp shard is sharded over all the ranks that hold it: a
dense MLP weight ``[I, H]`` (column-parallel) is ``[I/(dp·cp·tp), H]`` a rank, on the 2-D mesh
``(dp_cp, tp)`` with placements ``(_StridedShard(0, sf=tp), Shard(0))``; nothing is replicated
over dp (no HSDP).
Parameters become DTensors sharded over those meshes (FSDP2's usual ZeRO-3 layout): build the
optimizer after ``parallelize_model``; ``p.full_tensor()`` gives a whole parameter or gradient.

Two things FSDP2 must do for that, and how each torch release's FSDP2 is made to do them
(chosen by feature detection, never by version string; :func:`fsdp_mode` names the choice):

**A plain sum on the wire.**

- ``set_gradient_divide_factor`` (torch >= 2.8): factor ``1.0``, with
  ``set_force_sum_reduction_for_comms(True)`` (every release that has the first has this
  too), so every collective is ``ReduceOp.SUM`` with no scaling: gloo has no ``PREMUL_SUM``
  (an NCCL op) and its all-reduce no ``AVG`` (nor has HCCL on 910B).
- torch 2.7 has neither: its FSDP2 averages, picking the op per reduce dtype (float32/bf16: the
  reduce-scatter's op is ``AVG``, or the one ``set_reduce_scatter_divide_factor`` stores,
  always ``PREMUL_SUM``; float64/fp16: ``SUM`` with the mean's ``1/N`` split into a division of
  the input by a power of two ``pre`` and of the output by ``post = N/pre``). Here each param
  group's reduce-scatter op (the attribute that setter writes) is set to ``ReduceOp.SUM`` and
  an all-reduce hook (``set_all_reduce_hook``, which FSDP2 runs on the reduce-scatter output
  before its ``post`` division) multiplies by ``pre·post`` as FSDP2's own
  ``_get_gradient_divide_factors`` gives them: the sum for every dtype, exactly where
  ``pre·post`` is a power of two (every FSDP mesh of 2, 4, 8, ... ranks); otherwise within an
  ulp of it. Its native HSDP cannot sum (its dp all-reduce is ``AVG`` for float32/bf16);
  :func:`make_sums` offers a stand-in (FSDP over the shard mesh whose hook then all-reduces,
  ``SUM``, over a ``dp_mesh``), which hp-models' own units no longer need: none is HSDP.
  (On gloo, torch 2.7's ``reduce_scatter_tensor`` ignores its op and always sums, so
  there an ``AVG`` reduce-scatter would sum by accident; NCCL would average: the op is set.)

**Every parameter in every reduce-scatter**, even one this rank's forward did not use, so that
every rank reduce-scatters the same buffers (FSDP2 packs only the parameters that have a
gradient: a rank missing one would send a shorter buffer, or skip the collective and hang the
others). ``set_reduce_scatter_unused_params(True)`` (torch >= 2.13) adds zeros for them.
Before 2.13 a zero-cost dependency does the same: each wrapped block's forward passes its first
floating input through an identity autograd function that also takes the block's own
parameters; its backward runs after the block's (the input's gradient is complete only then,
and it precedes FSDP2's post-backward on that input), fills ``grad = zeros`` into exactly the
parameters that got none, and returns nothing for the others (no extra work for a parameter
that was used). Unused parameters are rare here (hp-moe gives every local expert's weights a
gradient even with no rows, and the stock experts are one tensor for all experts); a block
whose forward has no floating input (the model itself: token ids in) gets no such function:
its parameters (embeddings, final norm, head) are used by every rank; and a block that some
rank does not call at all gets none there (every block of a parallelised model runs on every
rank, the experts included: their forward holds the dispatch collectives).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hyper_parallel.dtensor import comm
from hyper_parallel.models.absent import is_absent
from hyper_parallel.models.mesh import SequenceMesh
from hyper_parallel.models.roles import Role
from hyper_parallel.models.state import OWNER

__all__ = [
    "apply_fsdp",
    "check_mp_policy",
    "fsdp_available",
    "fsdp_mode",
    "make_sums",
    "native_unused_params",
]


def _fsdp_module() -> Any:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    return FSDPModule


def _legacy_internals() -> Any:
    """torch 2.7's FSDP2 reduction internals, when they are what :func:`_set_legacy_sum`
    relies on: ``foreach_reduce`` taking the param group's ``reduce_scatter_reduce_op`` and
    ``_get_gradient_divide_factors(rs_group, ar_group, reduce_dtype, device_type)``."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives as coll
    except ImportError:
        return None
    factors = getattr(coll, "_get_gradient_divide_factors", None)
    reduce = getattr(coll, "foreach_reduce", None)
    if factors is None or reduce is None:
        return None
    try:
        reduce_params = inspect.signature(reduce).parameters
        factor_params = list(inspect.signature(factors).parameters)
    except (TypeError, ValueError):
        return None
    wanted = ["reduce_scatter_group", "all_reduce_group", "reduce_dtype", "device_type"]
    if "reduce_scatter_reduce_op" not in reduce_params or factor_params != wanted:
        return None
    return coll


def fsdp_mode() -> str | None:
    """How this torch's FSDP2 is made to sum gradients (see the module docstring), or None
    where it cannot be: ``"divide_factor"`` (``set_gradient_divide_factor``, torch >= 2.8) or
    ``"sum_op"`` (torch 2.7: the reduce-scatter op and an all-reduce hook). The same on every
    rank of one job."""
    cls = _fsdp_module()
    if cls is None:
        return None
    if hasattr(cls, "set_gradient_divide_factor"):
        return "divide_factor"
    if hasattr(cls, "set_all_reduce_hook") and _legacy_internals() is not None:
        return "sum_op"
    return None


def fsdp_available() -> bool:
    """True where this torch's FSDP2 can be made to sum gradients and include unused
    parameters (torch 2.7.1 and every later release; see :func:`fsdp_mode`); the answer is the
    same on every rank of one job."""
    return fsdp_mode() is not None


def native_unused_params() -> bool:
    """Whether FSDP2 itself reduce-scatters zeros for unused parameters
    (``set_reduce_scatter_unused_params``, torch >= 2.13); otherwise hp-models' zero-cost
    dependency does."""
    cls = _fsdp_module()
    return cls is not None and hasattr(cls, "set_reduce_scatter_unused_params")


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
            "mp_policy is FSDP2's mixed precision and needs grad_reduction='fsdp' (FSDP2 that "
            f"can sum gradients); got grad_reduction={grad_reduction!r} "
            "on torch " + torch.__version__ + ". For bf16 compute without FSDP2, run the "
            "forward under torch.autocast instead"
        )


class _FillUnused(torch.autograd.Function):
    """Identity on ``x`` that also takes a block's parameters: its backward gives ``zeros`` to
    each parameter that has no gradient by then and nothing to the others."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, *params: Tensor) -> Tensor:  # type: ignore[override]
        ctx.params = params
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        fill = [torch.zeros_like(p) if p.grad is None else None for p in ctx.params]
        ctx.params = ()
        return (grad, *fill)


def _own_params(module: nn.Module, fsdp_cls: Any) -> list[tuple[nn.Module, str]]:
    """``(owner, name)`` of the parameters one FSDP unit manages: ``module``'s, less those
    under a nested ``fully_shard`` module (they are that unit's)."""
    slots: list[tuple[nn.Module, str]] = []

    def walk(m: nn.Module) -> None:
        slots.extend((m, name) for name, _ in m.named_parameters(recurse=False))
        for child in m.children():
            if not isinstance(child, fsdp_cls):
                walk(child)

    walk(module)
    return slots


def _first_float(values: list[Any]) -> int | None:
    """Index of the first floating tensor needing a gradient, else of the first floating
    tensor, else None."""
    floats = [i for i, v in enumerate(values) if isinstance(v, Tensor) and v.is_floating_point()]
    for i in floats:
        if values[i].requires_grad:
            return i
    return floats[0] if floats else None


def _fill_unused_hook(slots: list[tuple[nn.Module, str]]) -> Callable[..., Any]:
    """A forward pre-hook (after FSDP2's, which unshards and registers the unsharded
    parameters on the modules) passing the first floating input through :class:`_FillUnused`
    with the unit's parameters that require a gradient."""

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not torch.is_grad_enabled():
            return None
        params = [p for p in (getattr(m, n) for m, n in slots) if p.requires_grad]
        if not params:
            return None
        values = list(args) + list(kwargs.values())
        i = _first_float(values)
        if i is None:
            return None
        anchored = _FillUnused.apply(values[i], *params)
        if i < len(args):
            return (*args[:i], anchored, *args[i + 1 :]), kwargs
        key = list(kwargs)[i - len(args)]
        return args, {**kwargs, key: anchored}

    # eager even inside a compiled module (``layer.compile()``): the backward reads which
    # parameters have a gradient at run time, which a traced graph would fix at trace time
    return torch.compiler.disable(hook)


def _legacy_sum_hook(rs_mesh: Any, dp_mesh: Any) -> Callable[[Tensor], None]:
    """torch 2.7's all-reduce hook for a unit sharded over ``rs_mesh``: undo FSDP2's
    ``pre``/``post`` division (``reduce_output`` is ``Σ g/pre`` and FSDP2 divides it by
    ``post`` after this hook), then (an HSDP stand-in) sum over ``dp_mesh``."""
    coll = _legacy_internals()
    rs_group = rs_mesh.get_group()
    dp = None if dp_mesh is None or dp_mesh.size() == 1 else comm.resolve_group(dp_mesh, "fsdp")

    def hook(reduce_output: Tensor) -> None:
        pre, post = coll._get_gradient_divide_factors(
            rs_group, None, reduce_output.dtype, reduce_output.device.type
        )
        scale = 1.0
        for f in (pre, post):  # FSDP2 divides by a factor only where it is > 1
            if f is not None and f > 1:
                scale *= f
        if scale != 1.0:
            reduce_output.mul_(scale)
        if dp is not None:  # a sum over the dp replicas, through the one runtime (recorded)
            name = "all_reduce:fsdp_dp_grads"
            comm.start_all_reduce(reduce_output, dp, name, "backward", OWNER).wait()

    return hook


def _set_legacy_sum(module: Any, rs_mesh: Any, dp_mesh: Any = None) -> None:
    """torch 2.7: the reduce-scatter op of ``module``'s param group (the attribute
    ``set_reduce_scatter_divide_factor`` writes) becomes ``ReduceOp.SUM`` and the all-reduce
    hook restores the sum (see the module docstring)."""
    group = module._get_fsdp_state()._fsdp_param_group
    if group is None:  # a unit without parameters of its own reduces nothing
        return
    if not hasattr(group, "reduce_scatter_reduce_op"):
        raise RuntimeError("this torch's FSDP2 param group has no reduce_scatter_reduce_op")
    group.reduce_scatter_reduce_op = dist.ReduceOp.SUM
    module.set_all_reduce_hook(_legacy_sum_hook(rs_mesh, dp_mesh))


def apply_fsdp(
    model: nn.Module,
    base: nn.Module,
    roles: dict[str, Role],
    sm: SequenceMesh,
    mp_policy: Any = None,
    edp: Any = None,
    reshard_after_forward: bool | None = None,
) -> None:
    """Wrap the blocks of an already parallelised ``model`` (see the module docstring), each
    with ``mp_policy`` (a ``MixedPrecisionPolicy``; None: FSDP2's default, no casting).
    ``reshard_after_forward``: FSDP2's option for every unit (None: its default); a pipeline
    stage passes False, so that its parameters are gathered once a step, not once a
    micro-batch. Layers another pipeline stage holds (no parameters) are not wrapped."""
    mode = fsdp_mode()
    if mode is None:
        raise RuntimeError("this torch's FSDP2 cannot be made to sum gradients")
    from torch.distributed.fsdp import fully_shard

    kw: dict[str, Any] = {} if mp_policy is None else {"mp_policy": mp_policy}
    if reshard_after_forward is not None:
        kw["reshard_after_forward"] = reshard_after_forward
    # (module, mesh it is sharded over, None: no unit needs make_sums' HSDP stand-in)
    wrapped: list[tuple[Any, Any, Any]] = []
    if edp is not None:  # experts split over ep (DTensors on ep): sharded over the edp ranks
        for path, role in roles.items():
            if role.routed:
                experts = base.get_submodule(path).get_submodule("experts")
                wrapped.append((fully_shard(experts, mesh=edp, **kw), edp, None))
    for path, role in roles.items():  # blocks reduced over another mesh than the layer's
        mesh = sm.fsdp_mesh_for(role.scope)  # a dense MLP: every rank of its tp shard
        if mesh is not sm.fsdp_mesh:
            block = base.get_submodule(path)
            wrapped.append((fully_shard(block, mesh=mesh, **kw), mesh, None))
    for layer in base.get_submodule("layers").children():
        if is_absent(layer):
            continue
        wrapped.append((fully_shard(layer, mesh=sm.fsdp_mesh, **kw), sm.fsdp_mesh, None))
    wrapped.append((fully_shard(model, mesh=sm.fsdp_mesh, **kw), sm.fsdp_mesh, None))
    make_sums(wrapped)


def make_sums(units: list[tuple[Any, Any, Any]], *, fill_unused: bool | None = None) -> None:
    """Make each ``fully_shard`` unit ``(module, mesh, dp_mesh)`` sum its gradients (no
    mean) over ``mesh`` (and, torch 2.7's HSDP stand-in, ``dp_mesh``, else None) with every
    parameter in every reduce-scatter, by this torch's means (see the module docstring). Call
    once every unit of the model is wrapped (a unit's own parameters exclude those of the
    units nested in it); collective-free. ``fill_unused``: use the zero-cost dependency for
    unused parameters (True), FSDP2's own setting (False; torch >= 2.13), or the latter where
    this torch has it (None)."""
    mode = fsdp_mode()
    if mode is None:
        raise RuntimeError("this torch's FSDP2 cannot be made to sum gradients")
    fsdp_cls = _fsdp_module()
    native_unused = native_unused_params() if fill_unused is None else not fill_unused
    if native_unused and not native_unused_params():
        raise ValueError("this torch's FSDP2 has no set_reduce_scatter_unused_params")
    for module, mesh, dp_mesh in units:
        if mode == "divide_factor":
            if dp_mesh is not None:
                raise ValueError("dp_mesh is torch 2.7's HSDP stand-in; use a 2-D mesh here")
            module.set_gradient_divide_factor(1.0)
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                # plain SUM on the wire: gloo has no PREMUL_SUM, which FSDP2 picks for float32
                module.set_force_sum_reduction_for_comms(True)
        else:
            _set_legacy_sum(module, mesh, dp_mesh)
        if native_unused:
            module.set_reduce_scatter_unused_params(True, recurse=False)
        else:
            slots = _own_params(module, fsdp_cls)
            if slots:
                module.register_forward_pre_hook(_fill_unused_hook(slots), with_kwargs=True)
