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

Each of these is a step of the dispatcher (``dispatcher=``, :mod:`hyper_parallel.moe.dispatch`):
``exchange_plan`` (1), ``dispatch_preprocess`` (2), per chunk ``dispatch_start`` /
``dispatch_finish`` / ``dispatch_postprocess`` / ``experts`` / ``combine_preprocess`` /
``combine_start`` / ``combine_finish``, and ``combine_postprocess`` (4); this module only
orders them. With the default ``"alltoall"`` dispatcher the exchanges are all-to-all-v's.

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
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from hyper_parallel.dtensor import comm
from hyper_parallel.dtensor.amp import autocast_dtype, autocast_off, cast_for_autocast
from hyper_parallel.moe.dispatch import (
    AUTO_MAX_CHUNKS,
    check_static,
    choose_chunks,
    resolve_dispatcher,
)
from hyper_parallel.moe.form import ExpertsShape

__all__ = [
    "AUTO_MAX_CHUNKS",
    "ForwardStats",
    "choose_chunks",
    "experts_parallel_blocking",
    "experts_parallel_forward",
]

_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)
Act = Callable[[Tensor], Tensor]


@dataclass
class ForwardStats:
    """What one forward did on this rank: the global per-expert counts ``[E]``, the rows each
    local expert computed, the chunk count, local backend and dispatcher with the reasons."""

    counts: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    chunks: int = 0
    chunks_reason: str = ""
    impl: str = ""
    impl_reason: str = ""
    alongside: Any = None  # what ``alongside`` returned (run while the first dispatch flies)
    dispatcher: str = ""


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
    dispatcher: Any = "alltoall",
) -> tuple[Tensor, ForwardStats]:
    d = resolve_dispatcher(dispatcher)
    e_l, two_i, h = gate_up.shape
    device = hidden.device.type
    check_static(d, gate_up.device.type, group.size, ExpertsShape(e_l * group.size, h, two_i // 2),
                 what)  # fmt: skip
    cast = autocast_dtype(device)
    floating = hidden.dtype in _CASTABLE and gate_up.dtype in _CASTABLE
    compute_dtype = cast if cast is not None and floating else hidden.dtype
    # the count exchange: raises on every rank if any rank's inputs (or the dispatcher's
    # per-call limits) are bad, before any row is exchanged
    handle = d.exchange_plan(
        hidden, top_k_index, top_k_weights, gate_up, down, group,
        compute_dtype=compute_dtype, impl=impl, chunks=chunks, what=what,
    )  # fmt: skip
    stats = ForwardStats(
        handle.plan.global_counts(), handle.rows, handle.chunks, handle.chunks_reason,
        handle.local.name, handle.local_reason, dispatcher=d.name,
    )  # fmt: skip

    x, gu, dn = cast_for_autocast(device, hidden, gate_up, down)

    def side_work() -> None:  # under the caller's autocast, like the code around the experts
        if alongside is not None:
            with contextlib.ExitStack() as stack:
                if cast is not None:
                    stack.enter_context(torch.autocast(device, dtype=cast))
                stats.alongside = alongside()

    def compute(q: int, received: Tensor) -> Tensor:
        rows_q, counts = d.dispatch_postprocess(handle, q, received)
        y = d.experts(handle, q, rows_q, counts, act)
        return d.combine_preprocess(handle, q, y)

    with autocast_off(device):
        rows = d.dispatch_preprocess(handle, x, gu, dn)
        active = handle.active
        back: dict[int, Tensor] = {}
        if overlapped and active:
            # chunk q+1's dispatch and chunk q-1's combine in flight under chunk q's experts
            token = d.dispatch_start(handle, active[0], rows)
            side_work()  # hides the first dispatch (and, in backward, the last dispatch gradient)
            combines = []
            for i, q in enumerate(active):
                received = d.dispatch_finish(handle, q, token)
                if i + 1 < len(active):
                    token = d.dispatch_start(handle, active[i + 1], rows)
                y = compute(q, received)
                combines.append((q, d.combine_start(handle, q, y)))
            for q, c_token in combines:
                back[q] = d.combine_finish(handle, q, c_token)
        else:  # blocking (each exchange finished as soon as it is started), or nothing to move
            side_work()
            for q in active:
                received = d.dispatch_finish(handle, q, d.dispatch_start(handle, q, rows))
                y = compute(q, received)
                back[q] = d.combine_finish(handle, q, d.combine_start(handle, q, y))
        out = d.combine_postprocess(handle, back, top_k_weights, hidden.dtype)
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
    dispatcher: Any = "alltoall",
) -> tuple[Tensor, ForwardStats]:
    """The experts of the ep group on this rank's tokens, chunked and overlapped.

    ``hidden [N, H]``, ``top_k_index [N, K]`` (global expert ids in ``[0, E)``),
    ``top_k_weights [N, K]`` of this rank; ``gate_up [E_l, 2I, H]`` and ``down [E_l, H, I]``:
    this rank's experts (rank r holds experts ``r·E_l … (r+1)·E_l − 1``); ``group``: the ep group
    (``comm.resolve_group``). Returns ``out [N, H]`` (what the stock module with every expert
    gives on these tokens) and the :class:`ForwardStats`. Every rank of the group calls it
    together; ``N`` may differ between ranks (also 0). ``alongside``: work that does not need
    the experts' output (e.g. a MoE block's shared experts), run once the first dispatch is in
    flight, under the caller's autocast; its result is ``stats.alongside``. ``dispatcher``: a
    registered name or a :class:`~hyper_parallel.moe.dispatch.Dispatcher` object (the
    exchanges; :mod:`hyper_parallel.moe.dispatch`)."""
    return _run(
        hidden, top_k_index, top_k_weights, gate_up, down, act, group,
        impl=impl, chunks=chunks, overlapped=True, what=what, alongside=alongside,
        dispatcher=dispatcher,
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
    dispatcher: Any = "alltoall",
) -> tuple[Tensor, ForwardStats]:
    """The reference twin of :func:`experts_parallel_forward` (same signature, same numbers):
    every dispatch and combine is waited as soon as it is started, forward and backward."""
    return _run(
        hidden, top_k_index, top_k_weights, gate_up, down, act, group,
        impl=impl, chunks=chunks, overlapped=False, what=what, alongside=alongside,
        dispatcher=dispatcher,
    )  # fmt: skip
