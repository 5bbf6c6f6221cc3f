"""Expert parallelism installed on a stock experts module, in place: :func:`parallelize_experts`,
:func:`unparallelize_experts`, :func:`is_experts_parallel`, :func:`expert_counts`,
:func:`experts_info`.

After :func:`parallelize_experts` (P ranks in the 1-D ``ep_mesh``, ``E_l = E / P``):

- ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` are DTensor parameters ``Shard(0)``
  on ``ep_mesh``: rank r holds experts ``r·E_l … (r+1)·E_l − 1`` and no other;
- ``forward(hidden [N, H], top_k_index [N, K], top_k_weights [N, K]) -> [N, H]`` on each rank's
  **own** tokens gives what the stock module with every expert gives on them, forward and every
  gradient (an expert's weight gradient, on its owner, sums the tokens of every rank);
- the module keeps its own class name with an ``EP`` prefix (hp-dtensor's ``rewrite``); a deep
  copy runs on the same groups.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import torch
from torch import Tensor, nn

from hyper_parallel.dtensor import DTensor, Shard, checked_entry, comm, rank_list
from hyper_parallel.dtensor.rewrite import (
    install_forward,
    is_parallelized,
    parallel_state,
    uninstall_forward,
)
from hyper_parallel.moe.dispatch import check_static, dispatcher_label, resolve_dispatcher
from hyper_parallel.moe.form import ExpertsShape, experts_shape
from hyper_parallel.moe.local import IMPLS
from hyper_parallel.moe.schedule import (
    ForwardStats,
    experts_parallel_blocking,
    experts_parallel_forward,
)

__all__ = [
    "LAYER",
    "expert_counts",
    "experts_info",
    "is_experts_parallel",
    "parallelize_experts",
    "run_experts",
    "unparallelize_experts",
]

LAYER = "hp-moe"
_M = TypeVar("_M", bound=nn.Module)
_WEIGHTS = ("gate_up_proj", "down_proj")


@dataclass
class _EPState:
    """What a parallelized experts module runs with (kept by hp-dtensor's ``rewrite``)."""

    mesh: Any
    group: comm.Group
    shape: ExpertsShape
    impl: str
    chunks: int | str
    overlap: bool
    dispatcher: Any = "alltoall"
    last: ForwardStats | None = field(default=None)


def _check_options(impl: Any, chunks: Any, overlap: Any, dispatcher: Any = "alltoall") -> None:
    if impl != "auto" and impl not in IMPLS:
        raise ValueError(f"impl must be 'auto' or one of {sorted(IMPLS)}, got {impl!r}")
    if chunks != "auto" and (not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1):
        raise ValueError(f"chunks must be 'auto' or an int >= 1, got {chunks!r}")
    if not isinstance(overlap, bool):
        raise ValueError(f"overlap must be a bool, got {overlap!r}")
    resolve_dispatcher(dispatcher)  # ValueError: an unknown name; TypeError: not a dispatcher


def _weight(name: str) -> Callable[[Any], Any]:
    return lambda args: getattr(args.experts, name, None)


@checked_entry(
    "parallelize_experts",
    compare=("impl", "chunks", "overlap"),
    group="ep_mesh",
    extra={
        "ep_ranks": lambda args: rank_list(args.ep_mesh),
        "class": lambda args: type(args.experts).__name__,
        "dispatcher": lambda args: dispatcher_label(args.dispatcher),
        **{name: _weight(name) for name in _WEIGHTS},
    },
)
def parallelize_experts(
    experts: _M,
    ep_mesh: Any,
    *,
    impl: str = "auto",
    chunks: int | str = "auto",
    overlap: bool = True,
    dispatcher: Any = "alltoall",
) -> _M:
    """Split the experts of a stock experts module over the 1-D ``ep_mesh`` (in place; returns
    the module).

    ``experts``: of the Hugging Face 5.x experts form (:data:`~hyper_parallel.moe.form.FORM`);
    every rank passes the same whole weights (as after seeding or loading a checkpoint): rank r
    keeps its ``E_l`` experts, nothing is communicated. ``impl``: the local backend
    (``"auto"``, ``"torch"``, ``"grouped_mm"``, ``"npu"``; :func:`~hyper_parallel.moe.select_impl`).
    ``chunks``: how many chunks the rows are dispatched, computed and combined in (``"auto"``:
    :func:`~hyper_parallel.moe.choose_chunks`, from shapes and device type). ``overlap=False``
    runs the blocking twin (every exchange waited at once). ``dispatcher``: how rows reach
    their experts and come back (:mod:`hyper_parallel.moe.dispatch`): a registered name
    (``"alltoall"``, the default; ``"npu_permute"``, ``"npu_fused_gmm"``, ``"npu_distribute"``)
    or a dispatcher object; its static capabilities (device type of the weights, ep size,
    local experts, hidden size) are checked here.

    Raises, on every rank and before any collective: ``TypeError`` for a module of another
    form or a ``dispatcher`` object without the dispatcher steps; ``ValueError`` for an n-D
    mesh, ``E`` not divisible by the mesh size, a bad option (an unknown dispatcher name), a
    dispatcher that cannot run these experts (naming the limit); ``RuntimeError`` for a module
    already parallelized (by this layer or another).

    Consistency mode (hp-dtensor's README, "Ranks that disagree"): the ranks of ``ep_mesh``
    compare the options, the mesh's ranks, the module's class and its weights; each forward
    compares the hidden size and dtypes (not ``N``), the options, the ep ranks and whether
    autograd records."""
    shape = experts_shape(experts)
    _check_options(impl, chunks, overlap, dispatcher)
    if is_parallelized(experts):
        raise RuntimeError(
            f"parallelize_experts: this {type(experts).__name__} is already parallelized; "
            "undo it first (unparallelize_experts)"
        )
    group = comm.resolve_group(ep_mesh, "parallelize_experts")
    if shape.num_experts % group.size:
        raise ValueError(
            f"parallelize_experts: {shape.num_experts} experts cannot be split evenly over an "
            f"ep mesh of {group.size} ranks (E must be divisible by ep)"
        )
    device = cast(Any, experts).gate_up_proj.device.type
    check_static(resolve_dispatcher(dispatcher), device, group.size, shape, "parallelize_experts")
    e_l = shape.num_experts // group.size
    lo = group.rank * e_l
    for name in _WEIGHTS:
        p = getattr(experts, name)
        local = p.detach()[lo : lo + e_l].clone()
        shard = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
        setattr(experts, name, nn.Parameter(shard, requires_grad=p.requires_grad))
    state = _EPState(ep_mesh, group, shape, impl, chunks, overlap, dispatcher)
    return cast(_M, install_forward(experts, LAYER, state, _make_forward, prefix="EP"))


def _forward_fields(args: Any) -> dict[str, Any]:
    """What the ranks compare before a forward's first collective (``checked_entry``'s
    ``extra``): the hidden size and the dtypes (not N, which may differ), the options and the
    ep mesh."""
    st = cast(_EPState, parallel_state(args.self, LAYER))

    def trailing(t: Any) -> Any:
        if not isinstance(t, Tensor):
            return repr(t)
        return f"[..., {list(t.shape)[1:]}]:{t.dtype}"

    return {
        "hidden": trailing(args.hidden_states),
        "top_k_index": trailing(args.top_k_index),
        "top_k_weights": trailing(args.top_k_weights),
        "impl": st.impl,
        "chunks": st.chunks,
        "overlap": st.overlap,
        "dispatcher": dispatcher_label(st.dispatcher),
        "ep_ranks": st.group.ranks,
        "grad": torch.is_grad_enabled(),
        "alongside": args.alongside is not None,
    }


def _parallel_call(
    self: nn.Module,
    hidden_states: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    alongside: Callable[[], Any] | None,
) -> tuple[Tensor, Any]:
    st = cast(_EPState, parallel_state(self, LAYER))
    gate_up = cast(Any, self.gate_up_proj).to_local()
    down = cast(Any, self.down_proj).to_local()
    run = experts_parallel_forward if st.overlap else experts_parallel_blocking
    out, st.last = run(
        hidden_states, top_k_index, top_k_weights, gate_up, down, cast(Any, self.act_fn), st.group,
        impl=st.impl, chunks=st.chunks, what=f"parallel experts ({type(self).__name__})",
        alongside=alongside, dispatcher=st.dispatcher,
    )  # fmt: skip
    return out, st.last.alongside


_checked_call = checked_entry(
    "parallel experts",
    group=lambda args: cast(_EPState, parallel_state(args.self, LAYER)).group.pg,
    extra=_forward_fields,
)(_parallel_call)


def _make_forward(original: type) -> Any:
    def forward(
        self: nn.Module,
        hidden_states: Tensor,
        top_k_index: Tensor,
        top_k_weights: Tensor,
        *,
        alongside: Callable[[], Any] | None = None,
    ) -> Any:
        out, side = _checked_call(self, hidden_states, top_k_index, top_k_weights, alongside)
        return out if alongside is None else (out, side)

    return forward


def run_experts(
    experts: nn.Module,
    hidden_states: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    *,
    alongside: Callable[[], Any] | None = None,
) -> tuple[Tensor, Any]:
    """Call parallelized ``experts`` as its forward does, running ``alongside()`` (work that
    does not need the experts' output, e.g. a MoE block's shared experts on the same tokens)
    once the first dispatch is in flight, under the caller's autocast; returns
    ``(out [N, H], alongside's result)``. With ``overlap=False`` it runs before the dispatch.
    The call goes through the module (``experts(..., alongside=fn)``), so its hooks (FSDP2's
    unshard and reshard among them) run as for a plain call. ``RuntimeError`` on a module that
    is not parallelized."""
    _state(experts, "run_experts")
    if alongside is None:
        return experts(hidden_states, top_k_index, top_k_weights), None
    out, side = experts(hidden_states, top_k_index, top_k_weights, alongside=alongside)
    return out, side


def is_experts_parallel(experts: nn.Module) -> bool:
    """Whether ``experts`` runs the expert-parallel forward of :func:`parallelize_experts`."""
    return is_parallelized(experts, LAYER)


def _state(experts: nn.Module, what: str) -> _EPState:
    st = parallel_state(experts, LAYER)
    if st is None:
        raise RuntimeError(
            f"{what}: this {type(experts).__name__} is not parallelized by parallelize_experts"
        )
    return cast(_EPState, st)


def expert_counts(experts: nn.Module) -> Tensor:
    """The per-expert number of (token, expert) assignments of the last forward over the ep
    group, ``[E]`` int64 (the same on every rank of the group). ``RuntimeError`` before the
    first forward or on a module that is not parallelized."""
    st = _state(experts, "expert_counts")
    if st.last is None:
        raise RuntimeError("expert_counts: the experts have not run a forward yet")
    return torch.tensor(st.last.counts, dtype=torch.int64)


def experts_info(experts: nn.Module) -> dict[str, Any]:
    """The options of a parallelized experts module and what its last forward chose: ``ep``,
    ``experts`` (E), ``local_experts`` (this rank's ids), ``dispatcher`` (its name) and its
    ``capabilities``, ``impl``/``impl_reason`` and ``chunks``/``chunks_reason`` (after a
    forward), ``rows`` (rows each local expert computed)."""
    st = _state(experts, "experts_info")
    e_l = st.shape.num_experts // st.group.size
    info: dict[str, Any] = {
        "ep": st.group.size,
        "experts": st.shape.num_experts,
        "local_experts": list(range(st.group.rank * e_l, (st.group.rank + 1) * e_l)),
        "impl": st.impl,
        "chunks": st.chunks,
        "overlap": st.overlap,
        "dispatcher": resolve_dispatcher(st.dispatcher).name,
        "capabilities": resolve_dispatcher(st.dispatcher).capabilities,
    }
    if st.last is not None:
        info.update(
            impl=st.last.impl,
            impl_reason=st.last.impl_reason,
            chunks=st.last.chunks,
            chunks_reason=st.last.chunks_reason,
            rows=list(st.last.rows),
        )
    return info


def unparallelize_experts(experts: _M) -> _M:
    """Undo :func:`parallelize_experts` (in place; returns the module): every expert's weights
    gathered back on every rank (one all-gather per weight: every rank of the ep group calls it
    together) as plain parameters, and the stock class and forward back. ``RuntimeError`` on a
    module that is not parallelized by this layer."""
    _state(experts, "unparallelize_experts")
    for name in _WEIGHTS:
        p = getattr(experts, name)
        whole = p.detach().full_tensor()
        setattr(experts, name, nn.Parameter(whole, requires_grad=p.requires_grad))
    uninstall_forward(experts, LAYER)
    return experts
