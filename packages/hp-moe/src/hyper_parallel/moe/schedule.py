"""Dispatch → expert compute → combine over the ep group, chunked and overlapped, and its
blocking twin.

Notation as in :mod:`hyper_parallel.moe.routing`; chunk ``q`` of ``C``. On each rank:

1. the count exchange (:func:`~hyper_parallel.moe.routing.exchange_counts`): the plan, the
   verdicts, the one host sync;
2. ``permute``: the N·K (token, slot) rows sorted by expert, so rank j's rows are one block;
3. per chunk q: **dispatch** (all-to-all-v of slice q of every block), the received rows put
   expert-major, the **local experts** (:mod:`hyper_parallel.moe.local`), back to
   source-major, **combine** (the reverse all-to-all-v);
4. ``unpermute``: every row back to its (token, slot), weighted by ``top_k_weights`` and
   summed over the slots.

:func:`experts_parallel_forward` runs step 3 as a pipeline of launch/wait node pairs
(:mod:`hyper_parallel.dtensor.overlap`): chunk q+1's dispatch and chunk q−1's combine are in
flight while chunk q's experts compute; in backward every combine gradient is started at once
and chunk q's dispatch gradient is in flight under chunk q−1's expert backward. With C chunks
the first dispatch and the last combine (in backward: the first combine gradient and the last
dispatch gradient) have nothing to hide under: the schedule's ceiling is ``1 − 1/C`` of the
exchange time. :func:`experts_parallel_blocking` (the reference twin, same signature) waits
each exchange at once; both compute the same numbers with the same operations.

Every rank joins every exchange of every non-empty chunk (a chunk is skipped only when it has
no row on any rank: every rank knows that from the plan), and the exchanges stay in the
autograd graph through ``anchors`` (empty slices of the local weights) on a rank that sends
nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from hyper_parallel.dtensor import comm
from hyper_parallel.dtensor.amp import autocast_dtype, autocast_off, cast_for_autocast
from hyper_parallel.dtensor.overlap import blocking, launch, wait
from hyper_parallel.moe.form import ExpertsShape
from hyper_parallel.moe.local import LocalExperts, select_impl
from hyper_parallel.moe.routing import OWNER, Plan, exchange_counts, local_verdict

__all__ = [
    "AUTO_MAX_CHUNKS",
    "ForwardStats",
    "choose_chunks",
    "experts_parallel_blocking",
    "experts_parallel_forward",
]

AUTO_MAX_CHUNKS = 8
_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)
Act = Callable[[Tensor], Tensor]


@dataclass
class ForwardStats:
    """What one forward did on this rank: the global per-expert counts ``[E]``, the rows each
    local expert computed, the chunk count and local backend with the reasons."""

    counts: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    chunks: int = 0
    chunks_reason: str = ""
    impl: str = ""
    impl_reason: str = ""
    alongside: Any = None  # what ``alongside`` returned (run while the first dispatch flies)


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


class _RowExchange:
    """One chunk's dispatch (or combine): rows out by ``send``, in by ``recv``; the gradient
    goes the reverse way. The only owner of its collectives in flight."""

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


def _compute_chunk(
    recv: Tensor,
    plan: Plan,
    q: int,
    backend: LocalExperts,
    gate_up: Tensor,
    down: Tensor,
    act: Act,
    stats: ForwardStats,
) -> Tensor:
    """Chunk q's received rows (source-major) through the local experts, back source-major."""
    counts, segments = plan.received_by_expert(q)
    for e, n in enumerate(counts):
        stats.rows[e] += n
    idx = _segment_index(segments, recv.device)
    inv = torch.empty_like(idx)
    inv[idx] = torch.arange(idx.numel(), device=idx.device)
    y = backend.experts(recv.index_select(0, idx), counts, gate_up, down, act)
    return y.index_select(0, inv)


def _run(
    hidden: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    gate_up: Tensor,
    down: Tensor,
    act: Act,
    group: comm.Group,
    *,
    impl: str,
    chunks: int | str,
    overlapped: bool,
    what: str,
    alongside: Callable[[], Any] | None = None,
) -> tuple[Tensor, ForwardStats]:
    e_l, two_i, h = gate_up.shape
    shape = ExpertsShape(e_l * group.size, h, two_i // 2)
    device = hidden.device.type
    cast = autocast_dtype(device)
    floating = hidden.dtype in _CASTABLE and gate_up.dtype in _CASTABLE
    compute_dtype = cast if cast is not None and floating else hidden.dtype
    verdict = local_verdict(
        hidden, top_k_index, top_k_weights, shape.num_experts, h, gate_up.dtype, compute_dtype
    )
    plan = exchange_counts(
        top_k_index, verdict, compute_dtype, shape.num_experts, group, 1, what
    )  # raises on every rank if any rank's inputs are bad
    total = sum(plan.global_counts())
    if chunks == "auto":
        c, c_why = choose_chunks(total // group.size, h, shape.intermediate, device)
    else:
        c, c_why = int(chunks), f"chunks={chunks} requested"
    plan = replace(plan, chunks=c)
    backend, b_why = select_impl(impl, device, compute_dtype, shape)
    stats = ForwardStats(plan.global_counts(), [0] * e_l, c, c_why, backend.name, b_why)

    x, gu, dn = cast_for_autocast(device, hidden, gate_up, down)

    def side_work() -> None:  # under the caller's autocast, like the code around the experts
        if alongside is not None:
            with contextlib.ExitStack() as stack:
                if cast is not None:
                    stack.enter_context(torch.autocast(device, dtype=cast))
                stats.alongside = alongside()

    with autocast_off(device):
        rows, order = backend.permute(x, top_k_index)
        anchors = (gu[:0], dn[:0]) if torch.is_grad_enabled() else ()
        active = [q for q in range(c) if plan.chunk_rows(q)]
        back: dict[int, Tensor] = {}

        def exchange(q: int, combine: bool) -> _RowExchange:
            send, recv = plan.send_splits(q), plan.recv_splits(q)
            if combine:
                return _RowExchange(group, recv, send, f"moe:combine{q}")
            return _RowExchange(group, send, recv, f"moe:dispatch{q}")

        if overlapped and active:
            d_ex = exchange(active[0], False)
            d_tok = launch(d_ex, _rows_of(rows, plan.send_ranges(active[0])), *anchors)
            side_work()  # hides the first dispatch (and, in backward, the last dispatch gradient)
            combines = []
            for i, q in enumerate(active):
                recv = wait(d_ex, d_tok)
                if i + 1 < len(active):
                    nq = active[i + 1]
                    d_ex = exchange(nq, False)
                    d_tok = launch(d_ex, _rows_of(rows, plan.send_ranges(nq)), *anchors)
                y = _compute_chunk(recv, plan, q, backend, gu, dn, act, stats)
                c_ex = exchange(q, True)
                combines.append((q, c_ex, launch(c_ex, y, *anchors)))
            for q, c_ex, c_tok in combines:
                back[q] = wait(c_ex, c_tok)
        else:  # blocking, or nothing to dispatch anywhere
            side_work()
            for q in active:
                recv = blocking(exchange(q, False), _rows_of(rows, plan.send_ranges(q)), *anchors)
                y = _compute_chunk(recv, plan, q, backend, gu, dn, act, stats)
                back[q] = blocking(exchange(q, True), y, *anchors)

        # rank j's block of the sorted rows is its chunks' slices, in chunk order
        pieces = {q: b.split(plan.send_splits(q)) for q, b in back.items()}
        ordered = [pieces[q][j] for j in range(group.size) for q in active]
        if ordered:
            result = torch.cat(ordered) if len(ordered) > 1 else ordered[0]
        else:  # no row anywhere: keep the weights and routing weights in the graph
            result = rows[:0].to(compute_dtype) + 0 * (gu.sum() + dn.sum())
        out = backend.unpermute(result, order, top_k_weights, hidden.dtype)
    return out, stats


def experts_parallel_forward(
    hidden: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    gate_up: Tensor,
    down: Tensor,
    act: Act,
    group: comm.Group,
    *,
    impl: str = "auto",
    chunks: int | str = "auto",
    what: str = "experts_parallel_forward",
    alongside: Callable[[], Any] | None = None,
) -> tuple[Tensor, ForwardStats]:
    """The experts of the ep group on this rank's tokens, chunked and overlapped.

    ``hidden [N, H]``, ``top_k_index [N, K]`` (global expert ids in ``[0, E)``),
    ``top_k_weights [N, K]`` of this rank; ``gate_up [E_l, 2I, H]`` and ``down [E_l, H, I]``:
    this rank's experts (rank r holds experts ``r·E_l … (r+1)·E_l − 1``); ``group``: the ep group
    (``comm.resolve_group``). Returns ``out [N, H]`` (what the stock module with every expert
    gives on these tokens) and the :class:`ForwardStats`. Every rank of the group calls it
    together; ``N`` may differ between ranks (also 0). ``alongside``: work that does not need
    the experts' output (e.g. a MoE block's shared experts), run once the first dispatch is in
    flight, under the caller's autocast; its result is ``stats.alongside``."""
    return _run(
        hidden, top_k_index, top_k_weights, gate_up, down, act, group,
        impl=impl, chunks=chunks, overlapped=True, what=what, alongside=alongside,
    )  # fmt: skip


def experts_parallel_blocking(
    hidden: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    gate_up: Tensor,
    down: Tensor,
    act: Act,
    group: comm.Group,
    *,
    impl: str = "auto",
    chunks: int | str = "auto",
    what: str = "experts_parallel_blocking",
    alongside: Callable[[], Any] | None = None,
) -> tuple[Tensor, ForwardStats]:
    """The reference twin of :func:`experts_parallel_forward` (same signature, same numbers):
    every dispatch and combine is waited as soon as it is started, forward and backward."""
    return _run(
        hidden, top_k_index, top_k_weights, gate_up, down, act, group,
        impl=impl, chunks=chunks, overlapped=False, what=what, alongside=alongside,
    )  # fmt: skip
