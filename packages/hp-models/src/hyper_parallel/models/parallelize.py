"""``parallelize_model``: a stock Hugging Face model made tensor + sequence + context parallel
from outside, in place, by applying the four layers' own entry points block by block.

Each block of a decoder layer (its token mixer and its MLP) plays a
:class:`~hyper_parallel.models.roles.Role` its family names
(:mod:`hyper_parallel.models.families`), and the role applies its layer's own entry point on
the (cp, tp) mesh (:mod:`hyper_parallel.models.mesh`; the table is in
:mod:`hyper_parallel.models.roles`): MLA and GQA attention (hp-context-parallel), KDA and
Gated DeltaNet (hp-kda-kernels) over the flattened ``cp·tp`` ranks, dense gated MLPs over
``tp`` (hp-mc2), the routed experts of MoE blocks over ``ep`` (hp-moe; with ``ep = 1`` the
MoE block runs on the local block with replicated parameters). Norms, embeddings and the LM
head run per token on the local block.

Every rank computes a distinct share of every block: no mixer is run twice across ``tp``.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from hyper_parallel.context_parallel import STRATEGIES
from hyper_parallel.dtensor import DeviceMesh, checked_entry
from hyper_parallel.dtensor.rewrite import install_forward, is_parallelized
from hyper_parallel.kda import LOCAL_KERNELS, PROTOCOLS
from hyper_parallel.models.checkpoint import save_pretrained_member
from hyper_parallel.models.experts import (
    MoEState,
    check_dispatcher,
    check_ep,
    expert_meshes,
    install_moe,
    resolve_moe_chunks,
)
from hyper_parallel.models.families import ModelFamily, family_of
from hyper_parallel.models.fsdp import apply_fsdp, check_mp_policy, fsdp_available
from hyper_parallel.models.loss import parallel_forward, refuse_generate
from hyper_parallel.models.mesh import check_mesh, cp_tp, sequence_mesh
from hyper_parallel.models.roles import BlockOptions, Role
from hyper_parallel.models.state import LAYER, ParallelPlan
from hyper_parallel.moe.dispatch import dispatcher_label

__all__ = ["ParallelPlan", "apply_parallel", "parallelize_model"]

# the layers' own tables (each fact written once, in the layer that owns it)
_MLA_STRATEGIES = STRATEGIES
_KDA_PROTOCOLS = PROTOCOLS
GRAD_REDUCTIONS = ("auto", "fsdp", "allreduce")


def _layers(base: nn.Module) -> list[nn.Module]:
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(base).__name__} has no `layers` ModuleList")
    return list(layers)


def _validate(
    model: nn.Module,
    mesh: Any,
    mla_strategy: str,
    overlap: Any,
    kda_protocol: str,
    grad_reduction: str,
    ep: Any = 1,
    local_kernel: Any = "auto",
) -> tuple[ModelFamily, nn.Module, dict[str, Role]]:
    """Every check, collective-free and identical on every rank."""
    if is_parallelized(model, LAYER):
        raise RuntimeError("parallelize_model was already applied to this model")
    if is_parallelized(model):
        raise RuntimeError(
            f"parallelize_model: this {type(model).__name__} was already parallelized by "
            "another layer"
        )
    fam, base = family_of(model)
    check_mesh(mesh)
    if mla_strategy not in _MLA_STRATEGIES:
        raise ValueError(f"mla_strategy must be one of {_MLA_STRATEGIES}, got {mla_strategy!r}")
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be a bool, got {overlap!r}")
    if kda_protocol not in _KDA_PROTOCOLS:
        raise ValueError(f"kda_protocol must be one of {_KDA_PROTOCOLS}, got {kda_protocol!r}")
    if local_kernel not in LOCAL_KERNELS:
        raise ValueError(f"local_kernel must be one of {LOCAL_KERNELS}, got {local_kernel!r}")
    if grad_reduction not in GRAD_REDUCTIONS:
        raise ValueError(f"grad_reduction must be one of {GRAD_REDUCTIONS}, got {grad_reduction!r}")
    if grad_reduction == "fsdp" and not fsdp_available():
        raise ValueError(
            "grad_reduction='fsdp' needs an FSDP2 (fully_shard) that hp-models can make sum "
            "gradients (torch 2.7.1 and later; see hyper_parallel.models.fsdp); use "
            "'allreduce' on this torch"
        )
    cp, tp = cp_tp(mesh)
    p = cp * tp
    roles: dict[str, Role] = {}
    for i, layer in enumerate(_layers(base)):
        for path, block in fam.layer_blocks(layer, i):
            role = fam.role_of(block)
            role.check(block, f"layer {i} ({path})", cp, tp)
            roles[path] = role
    dp = 1 if mesh.ndim == 2 else mesh.size(0)
    moe = {path: base.get_submodule(path) for path, role in roles.items() if role.routed}
    check_ep(ep, dp * p, moe)
    return fam, base, roles


def _roles(model: nn.Module) -> list[tuple[str, str]]:
    fam, base = family_of(model)
    return sorted(
        (path, fam.role_of(block).name)
        for i, layer in enumerate(_layers(base))
        for path, block in fam.layer_blocks(layer, i)
    )


def _resolved_reduction(grad_reduction: Any) -> Any:
    """``grad_reduction`` with ``"auto"`` resolved (compared resolved)."""
    if grad_reduction == "auto":
        return "fsdp" if fsdp_available() else "allreduce"
    return grad_reduction


# over the default group (no group=), before any sub-mesh is created: creating a process group
# involves every process
@checked_entry(
    "parallelize_model",
    compare=("mla_strategy", "overlap", "kda_protocol", "local_kernel", "ep", "moe_chunks"),
    extra={
        "model": lambda args: type(args.model).__name__,
        "family": lambda args: family_of(args.model)[0].name,
        "roles": lambda args: _roles(args.model),
        "param_dtypes": lambda args: sorted({str(p.dtype) for p in args.model.parameters()}),
        "param_count": lambda args: sum(1 for _ in args.model.parameters()),
        "mesh": lambda args: (tuple(args.mesh.mesh.shape), args.mesh.mesh_dim_names),
        "grad_reduction": lambda args: _resolved_reduction(args.grad_reduction),
        "mp_policy": lambda args: repr(args.mp_policy),
        "dispatcher": lambda args: dispatcher_label(args.dispatcher),
    },
)
def parallelize_model(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    mla_strategy: str = "latent",
    overlap: bool = True,
    kda_protocol: str = "auto",
    grad_reduction: str = "auto",
    mp_policy: Any = None,
    ep: int = 1,
    local_kernel: str = "auto",
    dispatcher: Any = "alltoall",
    moe_chunks: int | str = "auto",
) -> nn.Module:
    """Parallelise a stock ``KimiLinearForCausalLM``/``KimiLinearModel``,
    ``DeepseekV3ForCausalLM``/``DeepseekV3Model`` or ``Qwen3NextForCausalLM``/``Qwen3NextModel``
    in place over the 2-D ``mesh`` with dims
    ``("cp", "tp")`` (sizes may be 1) and return it. A 3-D mesh ``("dp", "cp", "tp")`` adds
    data parallelism: each ``dp`` slice is such a (cp, tp) mesh on its ``B/dp`` rows (see
    :func:`~hyper_parallel.models.shard_batch`); ``out.loss`` is then the loss of the whole
    global batch on every rank and the gradients are summed over ``dp`` too (FSDP2: FSDP over
    the ``dp·cp`` ranks of each tp shard for the dense MLPs, over all ranks for the rest;
    all-reduce: over ``dp`` as well).

    Afterwards call it on this rank's block: ``model(**shard_batch(batch, mesh))`` with
    ``input_ids`` ``[B, T/(cp·tp)]``; ``out.loss`` is the serial loss on the full batch, on
    every rank; ``out.logits`` are this rank's block ``[B, T/(cp·tp), V]``. After
    ``backward()``, :func:`~hyper_parallel.models.sync_gradients` makes every gradient equal the
    serial one. The module tree, parameter objects and ``state_dict`` keys are kept (dense MLP
    weights become DTensors sharded over ``tp``).

    ``mla_strategy`` (``"latent"``/``"expanded"``) and ``overlap`` go to ``parallelize_mla``
    (``overlap`` to ``parallelize_attention`` too), ``kda_protocol``
    (``"auto"``/``"p2p"``/``"allgather"``/``"grouped"``) and ``local_kernel`` to
    ``parallelize_kda`` and ``parallelize_gated_deltanet``: ``local_kernel="stock"`` makes each
    rank run the stock layer's own chunk function (fla's fused ``chunk_kda`` /
    ``chunk_gated_delta_rule`` where transformers bound it to fla), ``"torch"`` hp-kda-kernels'
    lean chunk path, ``"auto"`` (default) the stock one exactly when it is fla's.

    ``grad_reduction``: ``"fsdp"`` wraps the blocks with torch's FSDP2 ``fully_shard`` over the
    mesh each block needs (gradients summed during backward, parameters sharded; see
    :mod:`hyper_parallel.models.fsdp`); ``"allreduce"`` keeps parameters whole and sums the
    gradients in :func:`~hyper_parallel.models.sync_gradients` with one bucketed all-reduce per
    mesh; ``"auto"`` picks ``"fsdp"`` where this torch's FSDP2 can be made to sum (every
    torch from 2.7.1: :func:`~hyper_parallel.models.fsdp.fsdp_mode`), else ``"allreduce"``.
    Either way, build the optimizer after this call.

    ``ep``: expert parallelism for the MoE blocks (see :mod:`hyper_parallel.models.experts`):
    the ``dp·cp·tp`` ranks, flattened innermost first (tp, cp, dp), are cut into groups of
    ``ep`` consecutive ranks; each group splits every MoE layer's routed experts
    (``E/ep`` a rank, hp-moe), each expert's gradient is summed over the ranks holding the same
    experts, and the shared experts run while the dispatch is in flight. ``ep`` must divide
    ``dp·cp·tp`` and every MoE layer's expert count; ``ep=1`` (default) keeps every expert whole
    on every rank.

    ``dispatcher``: how the MoE blocks' rows reach their experts' ranks at ep > 1 (hp-moe's
    dispatchers: ``"alltoall"`` (default), the NPU ones by name, or a dispatcher object of
    your own; :mod:`hyper_parallel.moe.dispatch`); an unknown name raises ``ValueError``, and
    so does a dispatcher other than ``"alltoall"`` at ep = 1 (no exchange to run it).
    ``overlap`` reaches the MoE blocks too: ``False`` waits for every dispatch and combine at
    once. ``moe_chunks``: how many chunks hp-moe cuts a MoE block's rows into, so that one
    chunk's exchange is in flight under another's experts (an int >= 1, or ``"auto"``:
    hp-moe's choice from the shapes with ``overlap=True``, one chunk with ``overlap=False``).

    ``mp_policy``: a ``torch.distributed.fsdp.MixedPrecisionPolicy`` handed to every
    ``fully_shard`` (with ``grad_reduction="fsdp"``/``"auto"`` on FSDP2; with ``"allreduce"``
    it raises ``ValueError``, with another type ``TypeError``). The usual recipe: float32
    weights (the master copy), ``param_dtype=torch.bfloat16`` (compute in bf16),
    ``reduce_dtype=torch.float32`` (gradients summed in float32). ``torch.autocast`` around
    the forward works in either mode: every layer computes in the dtypes autocast gives the
    serial module (KDA keeps its state in float32).

    Raised on every rank alike, before any communication: ``TypeError`` for an unsupported model
    (naming the supported classes) or option type; ``ValueError`` for a mesh without dims
    ``("cp", "tp")``, MLA or GQA heads not divisible by ``cp·tp`` or an unknown option;
    ``RuntimeError`` for a second call on the same model.

    Consistency mode (hp-dtensor's README, "Ranks that disagree"): before anything else (so
    before the sub-meshes are created), every process of the job (the default group) compares
    the model's class and family, the role of every block, the parameter dtypes and count, the
    mesh's shape and dim names, and the options (``mla_strategy``, ``overlap``,
    ``kda_protocol``, ``local_kernel``, the resolved ``grad_reduction``, ``mp_policy``,
    ``ep``, ``dispatcher``, ``moe_chunks``); the forward
    then compares its keyword arguments over the flattened mesh, for its layers too.
    """
    return apply_parallel(
        model,
        mesh,
        mla_strategy=mla_strategy,
        overlap=overlap,
        kda_protocol=kda_protocol,
        grad_reduction=grad_reduction,
        mp_policy=mp_policy,
        ep=ep,
        local_kernel=local_kernel,
        dispatcher=dispatcher,
        moe_chunks=moe_chunks,
    )


def apply_parallel(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    mla_strategy: str = "latent",
    overlap: bool = True,
    kda_protocol: str = "auto",
    grad_reduction: str = "auto",
    mp_policy: Any = None,
    ep: int = 1,
    local_kernel: str = "auto",
    dispatcher: Any = "alltoall",
    moe_chunks: int | str = "auto",
    reshard_after_forward: bool | None = None,
) -> nn.Module:
    """:func:`parallelize_model`'s body, without its consistency check over the default group
    (a pipeline stage compares over the job itself: its stages hold different layers), and
    with FSDP2's ``reshard_after_forward`` (None: FSDP2's default)."""
    fam, base, roles = _validate(
        model, mesh, mla_strategy, overlap, kda_protocol, grad_reduction, ep, local_kernel
    )
    check_mp_policy(mp_policy, grad_reduction)
    check_dispatcher(dispatcher, ep)
    chunks = resolve_moe_chunks(moe_chunks, overlap)
    if grad_reduction == "auto":
        grad_reduction = "fsdp" if fsdp_available() else "allreduce"
    sm = sequence_mesh(mesh)
    options = BlockOptions(mla_strategy, overlap, kda_protocol, local_kernel)
    for path, role in roles.items():
        role.apply(base.get_submodule(path), sm, options)
    moe = MoEState(ep, dispatcher=dispatcher, overlap=overlap, chunks=chunks)
    if ep > 1:
        moe.ep_mesh, moe.edp_mesh = expert_meshes(sm.batch, ep)
    install_moe(moe, base, [path for path, role in roles.items() if role.routed])
    plan = ParallelPlan(fam, sm, grad_reduction, roles, has_loss=base is not model, moe=moe)
    # the class keeps its name: Hugging Face derives the saved `architectures` and the loss
    # type from it
    install_forward(model, LAYER, plan, parallel_forward, prefix="", members=_members(type(model)))
    if grad_reduction == "fsdp":
        apply_fsdp(model, base, roles, sm, mp_policy, moe.edp_mesh, reshard_after_forward)
    return model


def _members(original: type) -> dict[str, Any]:
    """Methods of the parallelised class besides ``forward``: ``generate`` refuses (decoding is
    not split; it raises before any communication) and ``save_pretrained`` writes a plain
    Hugging Face folder from every rank (:mod:`hyper_parallel.models.checkpoint`). Methods,
    not instance attributes, so a deep copy's act on the copy."""
    members: dict[str, Any] = {}
    if hasattr(original, "generate"):

        def generate(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return refuse_generate(*args, **kwargs)

        members["generate"] = functools.wraps(original.generate)(generate)
    if hasattr(original, "save_pretrained"):
        members["save_pretrained"] = save_pretrained_member(original)
    return members
