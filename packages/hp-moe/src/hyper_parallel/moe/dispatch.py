"""The dispatcher interface: how rows reach their experts' ranks and come back, as named steps.

A forward of the split experts is, on every rank of the ep group (Megatron-core's
``MoETokenDispatcher`` names; communication only in the *start* halves and, in backward, in
the gradients of the *finish* halves)::

    handle = d.exchange_plan(...)                 # the count exchange: plan + every rank's verdict
    rows   = d.dispatch_preprocess(handle, hidden, gate_up, down)    # local: permute
    for each chunk q (d.chunks_of(handle)):
        token = d.dispatch_start(handle, q, rows)  # the exchange launched
        recv  = d.dispatch_finish(handle, q, token)   # its wait
        x, counts = d.dispatch_postprocess(handle, q, recv)   # local: regroup by local expert
        y     = d.experts(handle, q, x, counts, act)          # local: the expert work
        y     = d.combine_preprocess(handle, q, y)            # local: back to source order
        token = d.combine_start(handle, q, y)
        back  = d.combine_finish(handle, q, token)
    out = d.combine_postprocess(handle, {q: back}, top_k_weights, dtype)   # local: unpermute

- ``exchange_plan`` is a small blocking all-gather (:func:`~.routing.exchange_counts`): the
  per-expert counts of every rank (the split sizes, no further host sync) and each rank's
  verdict on its own inputs, to which the dispatcher's **per-call** limits are added (tokens a
  rank, the dtype rows travel in, whether gradients are needed): any rank's problem raises the
  same ``ValueError`` on every rank before the first row moves.
- The start halves go through :func:`hyper_parallel.dtensor.overlap.launch` and the finish
  halves through :func:`~hyper_parallel.dtensor.overlap.wait`: the pair's in-flight points
  (after a start in forward, after a gradient's start in backward) come in graph order, the
  same on every rank, which a micro-batch runner (hp-models' forward/backward overlap) switches
  at. ``handle`` (a :class:`DispatchHandle`) is opaque to the caller: it carries the plan,
  the permutation, the exchanges in flight and what combine needs.
- Each backend declares its :class:`Capabilities`. :func:`static_refusal` checks the static
  ones (device type, ep size, local experts, hidden size; and the backend's own
  ``refusal()``) on every rank before anything runs (:func:`~hyper_parallel.moe.
  parallelize_experts` raises with it); the per-call ones are folded into the count
  exchange's verdicts.
- Backends are registered by name (:data:`DISPATCHERS`, :func:`register_dispatcher`); a user's
  own backend is passed as an object (``parallelize_experts(..., dispatcher=obj)``). The
  simplest one subclasses :class:`AllToAllDispatcher` and overrides a step.

:class:`AllToAllDispatcher` (``"alltoall"``, the default) is torch's all-to-all with split
sizes through hp-dtensor's ``comm``, whole or chunked; the local steps are the local backend's
(``impl=``, :mod:`hyper_parallel.moe.local`). The torch_npu backends are in
:mod:`hyper_parallel.moe.npu_dispatch`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from hyper_parallel.dtensor import comm
from hyper_parallel.dtensor.overlap import launch, wait
from hyper_parallel.moe.form import ExpertsShape
from hyper_parallel.moe.local import LocalExperts, TorchExperts, select_impl, split_experts
from hyper_parallel.moe.routing import (
    DTYPE_REFUSED,
    INFERENCE_ONLY,
    OWNER,
    TOKENS_OVER,
    TOKENS_UNDER,
    Plan,
    exchange_counts,
    local_verdict,
)

__all__ = [
    "DISPATCHERS",
    "AllToAllDispatcher",
    "Capabilities",
    "DispatchHandle",
    "Dispatcher",
    "dispatcher_label",
    "register_dispatcher",
    "resolve_dispatcher",
    "static_refusal",
]

Act = Callable[[Tensor], Tensor]
AUTO_MAX_CHUNKS = 8


@dataclass(frozen=True)
class Capabilities:
    """What a dispatcher can run (``None``: no limit).

    Static (checked by :func:`static_refusal` on every rank before anything runs):
    ``device_types`` (of the expert weights), ``ep_sizes``, ``max_local_experts``,
    ``max_experts`` (E over the group), ``max_hidden``. Per call (folded into the count
    exchange's verdicts): ``max_tokens_per_rank`` / ``min_tokens_per_rank`` (``N`` of a rank),
    ``dtypes`` (the dtype rows travel in), ``backward`` (``False``: refused when gradients are
    needed). Descriptive: ``fuses_expert_gemms`` (the exchanges run the expert GEMMs too),
    ``chunks`` (takes ``chunks > 1``; else every call runs one chunk), ``platforms``,
    ``source`` (where the limits are documented)."""

    backward: bool = True
    device_types: tuple[str, ...] | None = None
    ep_sizes: tuple[int, ...] | None = None
    max_local_experts: int | None = None
    max_experts: int | None = None
    max_tokens_per_rank: int | None = None
    min_tokens_per_rank: int = 0
    max_hidden: int | None = None
    dtypes: tuple[torch.dtype, ...] | None = None
    fuses_expert_gemms: bool = False
    chunks: bool = True
    platforms: str = "any"
    source: str = ""


@dataclass(eq=False)
class DispatchHandle:
    """What one forward's steps share (opaque to the caller; a backend may add to ``state``)."""

    plan: Plan
    group: comm.Group
    shape: ExpertsShape
    local: LocalExperts
    local_reason: str
    chunks: int
    chunks_reason: str
    compute_dtype: torch.dtype
    top_k_index: Tensor
    top_k: int
    what: str
    rows: list[int] = field(default_factory=list)  # rows each local expert computed
    order: Tensor | None = None
    gate_up: Tensor | None = None
    down: Tensor | None = None
    anchors: tuple[Tensor, ...] = ()
    state: dict[Any, Any] = field(default_factory=dict)

    @property
    def active(self) -> list[int]:
        """The chunks with a row somewhere in the group (every rank knows them from the plan)."""
        return [q for q in range(self.chunks) if self.plan.chunk_rows(q)]


@runtime_checkable
class Dispatcher(Protocol):
    """One dispatch/combine backend (see the module docstring for the order of the steps)."""

    name: str

    @property
    def capabilities(self) -> Capabilities: ...

    def refusal(self, device_type: str, ep: int, shape: ExpertsShape) -> str | None:
        """Static limits beyond :class:`Capabilities` (``None``: none refuse)."""
        ...

    def exchange_plan(
        self,
        hidden: Tensor,
        top_k_index: Tensor,
        top_k_weights: Tensor,
        gate_up: Tensor,
        down: Tensor,
        group: comm.Group,
        *,
        compute_dtype: torch.dtype,
        impl: str,
        chunks: int | str,
        what: str,
    ) -> DispatchHandle: ...

    def dispatch_preprocess(
        self, handle: DispatchHandle, hidden: Tensor, gate_up: Tensor, down: Tensor
    ) -> Tensor: ...

    def dispatch_start(self, handle: DispatchHandle, q: int, rows: Tensor) -> Tensor: ...

    def dispatch_finish(self, handle: DispatchHandle, q: int, token: Tensor) -> Tensor: ...

    def dispatch_postprocess(
        self, handle: DispatchHandle, q: int, received: Tensor
    ) -> tuple[Tensor, list[int]]: ...

    def experts(
        self, handle: DispatchHandle, q: int, x: Tensor, counts: list[int], act: Act
    ) -> Tensor: ...

    def combine_preprocess(self, handle: DispatchHandle, q: int, y: Tensor) -> Tensor: ...

    def combine_start(self, handle: DispatchHandle, q: int, y: Tensor) -> Tensor: ...

    def combine_finish(self, handle: DispatchHandle, q: int, token: Tensor) -> Tensor: ...

    def combine_postprocess(
        self,
        handle: DispatchHandle,
        back: dict[int, Tensor],
        top_k_weights: Tensor,
        dtype: torch.dtype,
    ) -> Tensor: ...


def choose_chunks(
    rows_per_rank: int, hidden: int, intermediate: int, device_type: str
) -> tuple[int, str]:
    """``chunks="auto"``: the chunk count for ``rows_per_rank`` rows a rank's experts compute
    on average (``Σ counts / P``, the same number on every rank) and why.

    Each chunk should be expert work worth hiding an exchange under: at least 64 rows and about
    ``2**27`` FLOP (``6·rows·H·I`` for the three GEMMs of a gated expert); at most
    :data:`AUTO_MAX_CHUNKS`, which the modeled-link benchmark found best (README, Benchmarks).
    A pure function of shapes and device type, so every rank chooses alike."""
    flops = 6 * rows_per_rank * hidden * intermediate
    by_rows, by_flops = rows_per_rank // 64, flops >> 27
    c = max(1, min(AUTO_MAX_CHUNKS, by_rows, by_flops))
    if c == AUTO_MAX_CHUNKS:
        why = f"the cap ({AUTO_MAX_CHUNKS}): every chunk has >= 64 rows and >= 2**27 FLOP"
    elif c == 1:
        why = f"{rows_per_rank} rows a rank ({flops:.2e} FLOP): too little work to split"
    else:
        limit = "64 rows" if by_rows <= by_flops else "2**27 FLOP"
        why = f"{c} chunks keep >= {limit} each ({rows_per_rank} rows a rank)"
    return c, f"{c} chunk(s) on {device_type}: {why}"


# --- the all-to-all exchange ------------------------------------------------------------------


class RowExchange:
    """One chunk's dispatch (or combine): rows out by ``send``, in by ``recv``; the gradient
    goes the reverse way (an :class:`hyper_parallel.dtensor.overlap.Exchange`). The only owner
    of its collectives in flight."""

    __slots__ = ("_bwd", "_fwd", "group", "name", "recv", "send")

    def __init__(self, group: comm.Group, send: list[int], recv: list[int], name: str) -> None:
        self.group, self.send, self.recv, self.name = group, send, recv, name
        self._fwd: comm.Work | None = None
        self._bwd: comm.Work | None = None

    def start(self, x: Tensor) -> None:
        self._fwd = comm.start_all_to_all_v(
            x, self.send, self.recv, self.group, self.name, "forward", OWNER
        )

    def finish(self) -> Tensor:
        work, self._fwd = self._fwd, None
        if work is None:
            raise RuntimeError(f"{self.name}: no forward exchange in flight")
        return work.wait()

    def start_grad(self, grad: Tensor) -> None:
        name = f"{self.name}:grad"
        self._bwd = comm.start_all_to_all_v(
            grad, self.recv, self.send, self.group, name, "backward", OWNER
        )

    def finish_grad(self) -> Tensor:
        work, self._bwd = self._bwd, None
        if work is None:
            raise RuntimeError(f"backward of {self.name}: no gradient exchange in flight")
        return work.wait()


def _rows_of(x: Tensor, ranges: list[tuple[int, int]]) -> Tensor:
    parts = [x[a:b] for a, b in ranges if b > a]
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts) if parts else x[:0]


def _segment_index(segments: list[tuple[int, int]], device: torch.device) -> Tensor:
    if not segments:
        return torch.zeros(0, dtype=torch.long, device=device)
    return torch.cat([torch.arange(s, s + n) for s, n in segments]).to(device)


def needs_grad(*tensors: Tensor) -> bool:
    """Whether autograd records and one of ``tensors`` requires grad."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


class AllToAllDispatcher:
    """``"alltoall"``: torch's all-to-all with split sizes (hp-dtensor's ``comm``), whole or in
    chunks; permute, regroup, expert work and unpermute by the local backend (``impl=``).
    Runs everywhere, forward and backward, in any dtype. Subclasses override steps (the NPU
    backends, a user's own); ``capabilities=`` replaces the declared limits."""

    name = "alltoall"
    _capabilities = Capabilities(source="torch.distributed all_to_all_single (any backend)")

    def __init__(self, capabilities: Capabilities | None = None, name: str | None = None) -> None:
        if capabilities is not None:
            self._capabilities = capabilities
        if name is not None:
            self.name = name

    @property
    def capabilities(self) -> Capabilities:
        return self._capabilities

    def refusal(self, device_type: str, ep: int, shape: ExpertsShape) -> str | None:
        return None

    # --- the count exchange ------------------------------------------------------------------

    def call_verdict(
        self,
        hidden: Tensor,
        top_k_weights: Tensor,
        gate_up: Tensor,
        down: Tensor,
        compute_dtype: torch.dtype,
    ) -> int:
        """This rank's verdict on the per-call limits of :attr:`capabilities` (0: none)."""
        caps = self.capabilities
        n = hidden.shape[0] if hidden.dim() else 0
        if caps.max_tokens_per_rank is not None and n > caps.max_tokens_per_rank:
            return TOKENS_OVER
        if n < caps.min_tokens_per_rank:
            return TOKENS_UNDER
        if caps.dtypes is not None and compute_dtype not in caps.dtypes:
            return DTYPE_REFUSED
        if not caps.backward and needs_grad(hidden, top_k_weights, gate_up, down):
            return INFERENCE_ONLY
        return 0

    def call_reasons(self) -> dict[int, str]:
        """The wording of :meth:`call_verdict`'s codes (the same on every rank)."""
        caps, n = self.capabilities, repr(self.name)
        dtypes = ", ".join(str(d).replace("torch.", "") for d in caps.dtypes or ())
        return {
            TOKENS_OVER: f"more tokens than dispatcher {n} takes "
            f"(at most {caps.max_tokens_per_rank} a rank: {caps.platforms}, {caps.source})",
            TOKENS_UNDER: f"fewer tokens than dispatcher {n} takes "
            f"(at least {caps.min_tokens_per_rank} a rank: {caps.source})",
            DTYPE_REFUSED: f"rows in a dtype dispatcher {n} does not take (only {dtypes})",
            INFERENCE_ONLY: f"dispatcher {n} is inference-only (no backward: {caps.source}) and "
            "gradients are needed here; run under torch.no_grad()/inference_mode or choose "
            "another dispatcher",
        }

    def exchange_plan(
        self,
        hidden: Tensor,
        top_k_index: Tensor,
        top_k_weights: Tensor,
        gate_up: Tensor,
        down: Tensor,
        group: comm.Group,
        *,
        compute_dtype: torch.dtype,
        impl: str,
        chunks: int | str,
        what: str,
    ) -> DispatchHandle:
        """The count exchange (blocking; the forward's one host sync): every rank's counts,
        input verdict and per-call capability verdict; raises the same error on every rank if
        any is bad. Then the chunk count and the local backend (from shapes, the same on every
        rank)."""
        e_l, two_i, h = gate_up.shape
        shape = ExpertsShape(e_l * group.size, h, two_i // 2)
        verdict = local_verdict(
            hidden, top_k_index, top_k_weights, shape.num_experts, h, gate_up.dtype, compute_dtype
        )
        if not verdict:
            verdict = self.call_verdict(hidden, top_k_weights, gate_up, down, compute_dtype)
        plan = exchange_counts(
            top_k_index, verdict, compute_dtype, shape.num_experts, group, 1, what,
            self.call_reasons(),
        )  # fmt: skip
        device = hidden.device.type
        if not self.capabilities.chunks:
            c, c_why = 1, f"1 chunk: dispatcher {self.name!r} exchanges every row at once"
        elif chunks == "auto":
            total = sum(plan.global_counts())
            c, c_why = choose_chunks(total // group.size, h, shape.intermediate, device)
        else:
            c, c_why = int(chunks), f"chunks={chunks} requested"
        local, l_why = self.local_backend(impl, device, compute_dtype, shape)
        return DispatchHandle(
            replace(plan, chunks=c), group, shape, local, l_why, c, c_why, compute_dtype,
            top_k_index, top_k_index.shape[1], what, rows=[0] * e_l,
        )  # fmt: skip

    def local_backend(
        self, impl: str, device_type: str, dtype: torch.dtype, shape: ExpertsShape
    ) -> tuple[LocalExperts, str]:
        """The local backend of the local steps (``impl=``; :func:`~.local.select_impl`)."""
        return select_impl(impl, device_type, dtype, shape)

    # --- dispatch ----------------------------------------------------------------------------

    def dispatch_preprocess(
        self, handle: DispatchHandle, hidden: Tensor, gate_up: Tensor, down: Tensor
    ) -> Tensor:
        """Local: the (token, slot) rows sorted by expert (rank j's rows one block)."""
        handle.gate_up, handle.down = gate_up, down
        handle.anchors = (gate_up[:0], down[:0]) if torch.is_grad_enabled() else ()
        rows, handle.order = handle.local.permute(hidden, handle.top_k_index)
        handle.state["empty"] = rows[:0]
        return rows

    def _exchange(self, handle: DispatchHandle, q: int, combine: bool) -> RowExchange:
        send, recv = handle.plan.send_splits(q), handle.plan.recv_splits(q)
        if combine:
            return RowExchange(handle.group, recv, send, f"moe:combine{q}")
        return RowExchange(handle.group, send, recv, f"moe:dispatch{q}")

    def dispatch_start(self, handle: DispatchHandle, q: int, rows: Tensor) -> Tensor:
        """Launch chunk q's dispatch (its slice of every rank's block); the token to finish."""
        ex = handle.state[("dispatch", q)] = self._exchange(handle, q, False)
        return launch(ex, _rows_of(rows, handle.plan.send_ranges(q)), *handle.anchors)

    def dispatch_finish(self, handle: DispatchHandle, q: int, token: Tensor) -> Tensor:
        """Wait chunk q's dispatch: its rows as received (source-major)."""
        return wait(handle.state.pop(("dispatch", q)), token)

    def dispatch_postprocess(
        self, handle: DispatchHandle, q: int, received: Tensor
    ) -> tuple[Tensor, list[int]]:
        """Local: the received rows grouped by local expert, and the rows of each."""
        counts, segments = handle.plan.received_by_expert(q)
        for e, n in enumerate(counts):
            handle.rows[e] += n
        idx = _segment_index(segments, received.device)
        inv = torch.empty_like(idx)
        inv[idx] = torch.arange(idx.numel(), device=idx.device)
        handle.state[("regroup", q)] = inv
        return received.index_select(0, idx), counts

    def experts(
        self, handle: DispatchHandle, q: int, x: Tensor, counts: list[int], act: Act
    ) -> Tensor:
        """Local: the rows through their experts (the local backend's GEMMs)."""
        assert handle.gate_up is not None and handle.down is not None
        gate_up: Any = handle.gate_up
        down: Any = handle.down
        if type(handle.local).experts is TorchExperts.experts:  # expert by expert: split once
            if "experts" not in handle.state:  # for every chunk of this forward
                handle.state["experts"] = split_experts(gate_up, down)
            gate_up, down = handle.state["experts"]
        return handle.local.experts(x, counts, gate_up, down, act)

    # --- combine -----------------------------------------------------------------------------

    def combine_preprocess(self, handle: DispatchHandle, q: int, y: Tensor) -> Tensor:
        """Local: the experts' rows back in received (source-major) order."""
        return y.index_select(0, handle.state.pop(("regroup", q)))

    def combine_start(self, handle: DispatchHandle, q: int, y: Tensor) -> Tensor:
        ex = handle.state[("combine", q)] = self._exchange(handle, q, True)
        return launch(ex, y, *handle.anchors)

    def combine_finish(self, handle: DispatchHandle, q: int, token: Tensor) -> Tensor:
        """Wait chunk q's combine: this rank's rows of the chunk, back from their experts."""
        return wait(handle.state.pop(("combine", q)), token)

    def combine_postprocess(
        self,
        handle: DispatchHandle,
        back: dict[int, Tensor],
        top_k_weights: Tensor,
        dtype: torch.dtype,
    ) -> Tensor:
        """Local: rank j's block is its chunks' slices in chunk order; every row back to its
        (token, slot), weighted and summed over the slots, in ``dtype``."""
        plan = handle.plan
        pieces = {q: b.split(plan.send_splits(q)) for q, b in back.items()}
        qs = sorted(back)
        ordered = [pieces[q][j] for j in range(plan.size) for q in qs]
        assert handle.order is not None and handle.gate_up is not None
        assert handle.down is not None
        if ordered:
            result = torch.cat(ordered) if len(ordered) > 1 else ordered[0]
        else:  # no row anywhere: keep the weights and routing weights in the graph
            zero = 0 * (handle.gate_up.sum() + handle.down.sum())
            result = handle.state["empty"].to(handle.compute_dtype) + zero
        return handle.local.unpermute(result, handle.order, top_k_weights, dtype)


# --- the registry -----------------------------------------------------------------------------

DISPATCHERS: dict[str, Dispatcher] = {}


def register_dispatcher(dispatcher: Dispatcher, name: str | None = None) -> Dispatcher:
    """Register ``dispatcher`` under ``name`` (default: its ``name``) for
    ``parallelize_experts(..., dispatcher=name)``; returns it. A name registered again is
    replaced. ``TypeError`` for an object without the :class:`Dispatcher` steps."""
    _check_dispatcher(dispatcher)
    DISPATCHERS[name or dispatcher.name] = dispatcher
    return dispatcher


_STEPS = (
    "capabilities", "refusal", "exchange_plan", "dispatch_preprocess", "dispatch_start",
    "dispatch_finish", "dispatch_postprocess", "experts", "combine_preprocess", "combine_start",
    "combine_finish", "combine_postprocess",
)  # fmt: skip


def _check_dispatcher(obj: Any) -> None:
    missing = [s for s in ("name", *_STEPS) if not hasattr(obj, s)]
    if missing:
        raise TypeError(
            f"a dispatcher needs the steps of hyper_parallel.moe.Dispatcher; "
            f"{type(obj).__name__} has no {', '.join(missing)}"
        )


def resolve_dispatcher(spec: Any) -> Dispatcher:
    """A registered name or a dispatcher object -> the dispatcher. ``ValueError`` for an
    unknown name, ``TypeError`` for an object without the steps."""
    if isinstance(spec, str):
        if spec not in DISPATCHERS:
            raise ValueError(
                f"dispatcher must be one of {sorted(DISPATCHERS)} or a Dispatcher object, "
                f"got {spec!r}"
            )
        return DISPATCHERS[spec]
    _check_dispatcher(spec)
    return spec  # type: ignore[no-any-return]


def dispatcher_label(spec: Any) -> str:
    """How ranks compare a ``dispatcher=`` option (a name, or an object's class and name)."""
    if isinstance(spec, str):
        return spec
    return f"{type(spec).__qualname__}:{getattr(spec, 'name', '?')}"


def static_refusal(d: Dispatcher, device_type: str, ep: int, shape: ExpertsShape) -> str | None:
    """Why ``d`` cannot run experts of ``shape`` on ``ep`` ranks with weights on
    ``device_type`` (``None``: it can). A pure function of its arguments and the dispatcher,
    so every rank gets the same answer."""
    caps, e_l = d.capabilities, shape.num_experts // max(ep, 1)
    if caps.device_types is not None and device_type not in caps.device_types:
        return f"it runs on {'/'.join(caps.device_types)} tensors, not {device_type}"
    if caps.ep_sizes is not None and ep not in caps.ep_sizes:
        sizes = ", ".join(map(str, caps.ep_sizes))
        return f"ep size {ep} is not one it takes ({sizes}; {caps.platforms}, {caps.source})"
    if caps.max_local_experts is not None and e_l > caps.max_local_experts:
        return (
            f"{e_l} local experts a rank exceed its limit of {caps.max_local_experts} "
            f"({caps.platforms}, {caps.source})"
        )
    if caps.max_experts is not None and shape.num_experts > caps.max_experts:
        return f"{shape.num_experts} experts exceed its limit of {caps.max_experts} ({caps.source})"
    if caps.max_hidden is not None and shape.hidden > caps.max_hidden:
        return (
            f"hidden size {shape.hidden} exceeds its limit of {caps.max_hidden} "
            f"({caps.platforms}, {caps.source})"
        )
    return d.refusal(device_type, ep, shape)


def check_static(d: Dispatcher, device_type: str, ep: int, shape: ExpertsShape, what: str) -> None:
    """:func:`static_refusal` as a ``ValueError`` (raised alike on every rank)."""
    why = static_refusal(d, device_type, ep, shape)
    if why:
        raise ValueError(f"{what}: dispatcher {d.name!r} cannot run here: {why}")


register_dispatcher(AllToAllDispatcher())
