"""``kda_context_parallel``: KDA over a sequence split into contiguous chunks across CP ranks.

Rank ``r`` computes its chunk's summary ``(S_r, M_r)`` chunk-parallel, the exchange gives it the
incoming state ``h_in(r)``, and the chunked recurrence from ``h_in(r)`` gives its outputs. The
initial state enters as part of the first rank's summary (``S_0 ← M_0 h_0 + S_0``). Backward:
the gradient reaching ``h_in(r)`` is exchanged as the transposed suffix, which gives
``∂L/∂S_r = g_out(r)`` and ``∂L/∂M_r = g_out(r) h_in(r)ᵀ``; autograd carries both into
``k, v, g, β`` through the summary.

Schedule: the block's summary terms first, then the exchange is launched, then the chunks' own
attention (the state-independent output terms ``Q_eff``, ``O_c = P U``) runs while it is in
flight, and only the chunked recurrence from ``h_in`` waits for it. Backward mirrors it: the
node that receives ``∂L/∂h_in`` launches the gradient exchange, autograd then runs the
backward of those output terms (recorded after the launch, so it runs first), and the launch
node's backward completes the exchange before the summary's backward needs ``g_out``. The two
nodes are hp-dtensor's overlapped-exchange node pair (``overlap.launch`` / ``overlap.wait``).
"""

from __future__ import annotations

from typing import Any

import torch

from hyper_parallel.dtensor import overlap
from hyper_parallel.dtensor.amp import autocast_off, without_autocast
from hyper_parallel.dtensor.cache import WorldCache
from hyper_parallel.dtensor.consistency import checked_entry

from ._checks import check_chunk_size, check_kernel_dims, check_qkv, table_values
from ._renamed import accepts_backend
from .chunk import compose_chunks, run_chunks, summary_terms
from .chunk import output_terms as chunk_output_terms
from .cost import CostParams, choose_protocol
from .exchange import PendingExchange, StateExchange, build_state_exchange, default_width
from .lean import LeanTerms, lean_output_terms, lean_outputs, lean_summary
from .merge import choose_kernel
from .packing import PackedBlock, place_block

__all__ = ["kda_context_parallel"]

# DeviceMesh compares by structure, so after ``destroy_process_group`` and a new
# ``init_process_group`` an equal mesh of the new world would find the executor bound to the
# destroyed groups: the cache is world-scoped (hp-dtensor's ``WorldCache``: a new world empties
# it), and the key holds the mesh's own group object as well.
_EXECUTORS: WorldCache[tuple[Any, ...], StateExchange] = WorldCache()
# Overlap the state exchange with the block's state-independent output terms (forward and
# backward). False runs the earlier schedule (every local term, then the exchange); the
# results are bitwise the same (the benchmark compares the two schedules' times).
_OVERLAP = True
# The project's torch path keeps only inputs and per-chunk maps for backward and recomputes the
# intra-chunk terms there (:mod:`hyper_parallel.kda.lean`). False runs the earlier path under
# plain autograd (every chunk's pairwise terms kept): the benchmark compares the two.
_LEAN = True


def executor_for(
    mesh: Any, protocol: str, group_size: int | None, kernel: str, params: CostParams | None
) -> StateExchange:
    """The cached :func:`build_state_exchange` executor for these arguments in this world."""
    group = mesh.get_group(0) if getattr(mesh, "ndim", None) == 1 else None
    key = (mesh, group, protocol, group_size, kernel, params)
    return _EXECUTORS.get_or_create(
        key,
        lambda: build_state_exchange(mesh, protocol, group_size, kernel=kernel, cost_params=params),
    )


def chosen_protocol(
    mesh: Any, protocol: str, group_size: int | None, dims: tuple[int, ...], params: Any
) -> Any:
    """``(protocol, group_size)`` an exchange over ``mesh`` runs for summaries of
    ``dims = (B, H, K, V)``: what ``"auto"`` resolves to, and the default group size."""
    P = mesh.size()
    if protocol == "auto":
        dev = str(getattr(mesh, "device_type", "cpu"))
        c = choose_protocol(P, *dims, device_type=dev, params=params)
        return c.protocol, c.group_size
    if protocol == "grouped":
        return protocol, group_size or default_width(P)
    return protocol, group_size


def _tensors(args: Any) -> dict[str, Any]:
    return {"q": args.q, "k": args.k, "v": args.v, "g": args.g, "beta": args.beta}


def _dims(args: Any) -> tuple[int, ...]:
    """``(B, H, K, V)`` of a :func:`kda_context_parallel` call."""
    q, v = args.q, args.v
    return (q.shape[0], q.shape[2], q.shape[3], v.shape[3])


def _table(args: Any) -> Any:
    """The documents table of a :func:`kda_context_parallel` call, by value."""
    if isinstance(args.packed, PackedBlock):
        return args.packed.offsets
    if args.sequence_context is not None:
        return getattr(args.sequence_context, "offsets", "<not a SequenceContext>")
    return table_values(args.cu_seqlens)


# What ranks compare for one KDA recurrence over the 1-D ``mesh`` (consistency mode), beside
# the options compared by name: everything but the per-rank chunk length ``T_r`` and
# ``initial_state`` (read on the first rank only); the nested halo, block placement and
# exchange compare nothing more.
_KDA_FIELDS: dict[str, Any] = {
    "dims_BHKV": _dims,
    "dtypes": lambda args: {name: str(t.dtype) for name, t in _tensors(args).items()},
    "device": lambda args: args.q.device.type,
    "cu_seqlens": _table,
    # whether this call gathers the block lengths itself (a caller's PackedBlock or sequence
    # context: no), and whether it compares the context's fingerprint
    "places_blocks": lambda args: args.cu_seqlens is not None and args.packed is None,
    "checks_context": lambda args: bool(getattr(args.sequence_context, "needs_check", False)),
    "protocol_chosen": lambda args: chosen_protocol(
        args.mesh, args.protocol, args.group_size, _dims(args), args.cost_params
    ),
    "kernel_chosen": lambda args: choose_kernel(
        args.q.device, args.q.shape[3], args.v.shape[3], args.kernel
    )[0],
    "needs_grad": lambda args: (
        torch.is_grad_enabled() and any(t.requires_grad for t in _tensors(args).values())
    ),
    "cp_size": lambda args: args.mesh.size(),
}


class _Exchange:
    """One state exchange, driven by hp-dtensor's overlapped-exchange node pair
    (:mod:`hyper_parallel.dtensor.overlap`): the launch node's forward launches it and its
    backward completes the gradient exchange and returns ``∂L/∂S_r = g_out``, ``∂L/∂M_r =
    g_out h_inᵀ``; the wait node's forward completes it (``h_in(r)``) and its backward launches
    the gradient exchange of ``∂L/∂h_in(r)``. Keeps the pending transfers and this rank's own
    ``M`` and ``h_in`` (all that backward keeps).

    The pair moves one tensor, this exchange two and its anchors: :meth:`pack` makes them one
    flat fp32 vector ``[S_r ; M_r ; anchors]``, which autograd splits back into their gradients
    (the same values; one state-sized copy each way). The anchors travel in it rather than as
    the pair's own anchors because theirs get no gradient, while these (an empty chunk's
    inputs, which tie the nodes into the graph of a rank whose chunk is empty) keep getting
    their zero gradient, as before."""

    def __init__(self, ex: StateExchange) -> None:
        self.ex = ex
        self.pending: PendingExchange | None = None
        self.M: torch.Tensor | None = None
        self.h_in: torch.Tensor | None = None
        self._shapes: tuple[torch.Size, torch.Size] | None = None
        self._anchor_numel = 0

    def pack(
        self, S: torch.Tensor, M: torch.Tensor, anchors: tuple[torch.Tensor, ...]
    ) -> torch.Tensor:
        """``[S ; M ; anchors]`` flat, fp32 (differentiable)."""
        self._shapes = (S.shape, M.shape)
        self._anchor_numel = sum(a.numel() for a in anchors)
        parts = [S.reshape(-1), M.reshape(-1), *(a.to(torch.float32).reshape(-1) for a in anchors)]
        return torch.cat(parts)

    def start(self, x: torch.Tensor) -> None:
        assert self._shapes is not None
        (s_shape, m_shape), n_s = self._shapes, self._shapes[0].numel()
        S = x[:n_s].view(s_shape)
        M = x[n_s : n_s + m_shape.numel()].view(m_shape)
        self.M = M.detach()
        self.pending = self.ex.start_forward(S, M)

    def finish(self) -> torch.Tensor:
        assert self.pending is not None
        h_in = self.pending.wait()
        self.pending, self.h_in = None, h_in.detach()
        return h_in

    def start_grad(self, grad: torch.Tensor) -> None:
        assert self.M is not None
        # No consistency check here: the forward's signature (dims, protocol and its choice,
        # fold kernel, whether gradients flow) fixes this exchange's shapes (fp32 [B, H, K,
        # V]) and protocol, and every rank must run this backward anyway (a rank that does
        # not would leave a comparison waiting just as it leaves the exchange).
        with autocast_off(grad.device.type):
            self.pending = self.ex.start_backward(grad.to(torch.float32).contiguous(), self.M)

    def finish_grad(self) -> torch.Tensor:
        assert self.pending is not None and self.h_in is not None
        with autocast_off(self.h_in.device.type):
            g_out = self.pending.wait()
            self.pending = None
            parts = [g_out.reshape(-1), (g_out @ self.h_in.transpose(-1, -2)).reshape(-1)]
            if self._anchor_numel:
                parts.append(g_out.new_zeros(self._anchor_numel))
            return torch.cat(parts)


@accepts_backend("kda_context_parallel")
@checked_entry(
    "kda_context_parallel",
    compare=(
        "protocol", "group_size", "kernel", "scale", "chunk_size", "output_final_state",
        "cost_params",
    ),
    group="mesh",
    extra=_KDA_FIELDS,
)  # fmt: skip
@without_autocast  # state and summaries in float32 under autocast too: the core casts itself
def kda_context_parallel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    mesh: Any,
    *,
    protocol: str = "auto",
    group_size: int | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    kernel: str = "auto",
    cost_params: CostParams | None = None,
    cu_seqlens: torch.Tensor | None = None,
    packed: PackedBlock | None = None,
    sequence_context: Any = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA with the sequence split across the ranks of the 1-D ``mesh`` (rank ``r`` holds the
    ``r``-th contiguous chunk, chunks may differ in length).

    Per rank: ``q, k, g: [B, T_r, H, K]``, ``v: [B, T_r, H, V]``, ``beta: [B, T_r, H]``;
    ``initial_state [B, H, K, V]`` is the whole sequence's initial state, read on the mesh's
    first rank (ignored elsewhere). Returns ``(o_local [B, T_r, H, V] in v's dtype,
    final_state)``: ``o_local`` is this rank's slice of ``naive_recurrent_kda`` on the whole
    sequence; ``final_state`` (fp32 ``[B, H, K, V]``) is the whole sequence's final state on the
    mesh's last rank when ``output_final_state``, else None. Differentiable w.r.t. every input
    and the final state; when gradients are needed every rank must run backward through its
    output (the backward exchange is collective). State and summaries are fp32.
    ``protocol``/``group_size``/``cost_params`` configure :func:`build_state_exchange`;
    ``kernel`` selects the merge/scan fold kernel (``"auto"``, ``"torch"``, ``"triton"``;
    ``backend=``, its earlier name, still works with a ``DeprecationWarning``). All checks
    run before any communication.

    Packed documents: ``cu_seqlens`` (1-D integer, the global document offsets ``[0, …, T]``
    over the whole sequence, identical on every rank, ``B == 1``) restarts the state from zero
    at every document start (only the first document starts from ``initial_state``; the final
    state is the last document's). A block containing a start sends the summary ``(S, M = 0)``,
    so the exchange is the same size for any number of documents; placing the block costs one
    all-gather of the block lengths (see :mod:`hyper_parallel.kda.packing`; ``packed``, from
    :func:`~hyper_parallel.kda.packing.packed_block`, skips it when the caller placed it).
    ``sequence_context`` (hp-dtensor's :class:`~hyper_parallel.dtensor.SequenceContext` over
    ``mesh``, describing this block; instead of ``cu_seqlens``): the documents and the block's
    place from the context, with no host read and no gather (an unchecked context's fingerprint
    is compared once, with one all-gather); ranks given different tables raise
    ``SequenceMismatchError`` on every rank, also with consistency mode off.

    Consistency mode (hp-dtensor's README, "Ranks that disagree"): once per call, before any
    check or collective, the ranks of ``mesh`` compare ``(B, H, K, V)``, the dtypes of ``q, k,
    v, g, beta``, the device type, ``protocol``, ``group_size``, the protocol ``"auto"`` chose
    (with its group size), ``kernel`` and the fold kernel chosen, ``scale``, ``chunk_size``,
    ``output_final_state``, ``cost_params``, the documents table's values, whether gradients
    will flow and the mesh size; not the chunk length ``T_r`` (chunks may differ) nor
    ``initial_state`` (read on the first rank only).
    """
    B, T, *_ = check_inputs(q, k, v, g, beta, initial_state, chunk_size, kernel, mesh)
    packed = place_block(
        mesh, B, T, q.device, "kda_context_parallel",
        cu_seqlens=cu_seqlens, packed=packed, context=sequence_context,
    )  # fmt: skip
    ex = executor_for(mesh, protocol, group_size, kernel, cost_params)
    return run_with_executor(
        q, k, v, g, beta, ex, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, chunk_size=chunk_size, packed=packed,
    )  # fmt: skip


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    chunk_size: int,
    kernel: str,
    mesh: Any,
) -> tuple[int, int, int, int, int]:
    """The checks of one KDA call, before any communication: ``(B, T_r, H, K, V)``."""
    B, T, H, K, V = check_qkv(q, k, v, g, beta, initial_state)
    check_chunk_size(chunk_size)
    if kernel == "triton" and (why := check_kernel_dims(K, V)):
        raise ValueError(f"kernel 'triton' does not support these dims: {why}")
    dev_type = str(getattr(mesh, "device_type", "cpu"))
    if q.device.type != dev_type:
        raise ValueError(f"inputs on {q.device} but the mesh is a {dev_type!r} mesh")
    return B, T, H, K, V


@without_autocast
def run_with_executor(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ex: StateExchange,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    packed: PackedBlock | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`kda_context_parallel`'s computation on the executor ``ex`` the caller holds
    (a ``parallelize_kda``-ed module keeps its own): inputs already checked
    (:func:`check_inputs`), documents already placed (``packed``)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    resets = None if packed is None else packed.resets
    first = ex.position == 0
    last = ex.position == ex.world_size - 1
    if scale is None:
        scale = K**-0.5
    f32 = [x.to(torch.float32) for x in (q, k, v, g, beta)]
    h0 = initial_state.to(torch.float32) if (first and initial_state is not None) else None
    anchors: tuple[torch.Tensor, ...] = ()
    if T == 0:
        # An empty chunk is the identity map. Its summary depends on no input, so the inputs
        # ride along as anchors: the exchange stays in this rank's autograd graph (and its
        # collective backward runs here too) whenever an input requires grad.
        S = q.new_zeros(B, H, K, V, dtype=torch.float32)
        M = torch.eye(K, dtype=torch.float32, device=q.device).expand(B, H, K, K).contiguous()
        anchors = (q, k, v, g, beta)
    elif _LEAN:
        lean = lean_summary(f32[1], f32[2], f32[3], f32[4], chunk_size, resets)
        S, M = lean[0], lean[1]
    else:
        staged = summary_terms(f32[1], f32[2], f32[3], f32[4], chunk_size, resets)
        S, M = compose_chunks(staged)
    if h0 is not None:
        S = M @ h0 + S
    if T and not _OVERLAP:  # the earlier schedule: every local term before the exchange
        local = output_terms(lean[2] if _LEAN else staged, f32[0], scale)
    state = _Exchange(ex)
    started = overlap.launch(state, state.pack(S, M, anchors))
    if T and _OVERLAP:  # the chunks' own attention, while the exchange is in flight
        local = output_terms(lean[2] if _LEAN else staged, f32[0], scale)
    h_x = overlap.wait(state, started)
    h_in = h_x + h0 if h0 is not None else h_x
    if T == 0:
        # o = q h_in over zero tokens: empty, but linked to the exchange, so a loss over this
        # rank's (empty) output still reaches the exchange's backward.
        o = (f32[0].transpose(1, 2) @ h_in).transpose(1, 2)
        h_out = h_in
    elif _LEAN:
        o, h_out = lean_outputs(lean[2], local, h_in)
    else:
        o, h_out = run_chunks((staged.S_c, staged.M_c, *local), h_in, T)
    return o.to(v.dtype), (h_out if output_final_state and last else None)


def output_terms(terms: Any, q: torch.Tensor, scale: float) -> Any:
    """The block's state-independent output terms ``(Q_eff, O_c)`` (what runs while the
    exchange is in flight) on the lean path or the earlier one."""
    if isinstance(terms, LeanTerms):
        return lean_output_terms(terms, q, scale)
    return chunk_output_terms(terms, q, scale)
