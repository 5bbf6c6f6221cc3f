"""Forward/backward overlap across micro-batches: the forward of micro-batch i+1 and the
backward of micro-batch i run as interleaved nodes, each one's exchanges in flight under the
other's compute.

:func:`run_interleaved` runs two callables, ``first`` (a forward) and ``second`` (a backward),
as coroutines on two threads of which exactly one runs at a time (a *baton*). A side runs until
it reaches an **in-flight point** (hp-dtensor's ``overlap.in_flight``: one of this rank's
collectives was just started and nothing of this side needs it yet — an MoE dispatch or
combine, a context-parallel all-to-all, a delta-rule state exchange, in forward or, for their
gradients, in backward), then hands the baton to the other side, which runs until its own next
in-flight point, and so on; a side that has finished no longer takes the baton. So the forward's
dispatch travels while the backward computes an expert's gradient, and the backward's combine
gradient travels while the forward computes attention: node by node, as Megatron-core's
combined 1F1B pairs them, but with no model rewrite: the nodes are cut where the layers already
start and wait their exchanges.

**Exact and deadlock-free.** Each side computes what it computes alone, on its own tensors; only
the order of the two sides' operations interleaves. The points where the baton changes hands
are the in-flight points in graph order, the same on every rank, so every rank issues every
collective (the two sides' exchanges, their blocking collectives, FSDP2's) in the same order.
The backward's end (autograd's final callbacks, where FSDP2 closes its backward) waits for the
forward to finish first: FSDP2 resets per-pass state there.

What runs on each side's thread inherits the caller's context: ``contextvars``, grad mode,
autocast and the caller's torch dispatch modes (the same mode objects, so a memory tracker or a
FLOP counter around the step sees both sides). Activation checkpointing composes: a recomputed
forward runs inside the backward's side, and its exchanges are in-flight points like any other.

**Traced.** While hp-dtensor's event recorder is on (``record_events``), each side's running
stretches are recorded as *segments*: a ``segment_begin`` event when the side starts or gets
the baton back and a ``segment_end`` event when it hands the baton over or finishes, named as
the caller names the side (``run_interleaved(..., names=("forward mb1", "backward mb0"))``;
phase ``forward`` for ``first``, ``backward`` for ``second``), on the recorder's clock beside
the layers' spans and the collectives' launches and waits; :func:`segment` records a whole
computation run alone the same way and :func:`segment_spans` pairs the events into spans. A
segment that starts between one of the other side's launches and its wait is that side's
exchange in flight under it. Without a recorder nothing is recorded (one ``None`` check a
hand-over).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch import Tensor
from torch.autograd import Function
from torch.utils._python_dispatch import (  # torch's own helpers, 2.7.1 to 2.15
    _get_current_dispatch_mode_stack,
    _pop_mode,
    _push_mode,
)

from hyper_parallel.dtensor import comm
from hyper_parallel.dtensor.amp import autocast_dtype
from hyper_parallel.dtensor.overlap import in_flight_hook
from hyper_parallel.dtensor.recorder import Event, current_recorder

__all__ = ["hold_backward_end", "run_interleaved", "segment", "segment_spans"]

T = TypeVar("T")

#: the recorder event kinds of a side's running stretch (hp-dtensor's ``EventRecorder``;
#: its Chrome export leaves them out: :func:`segment_spans` pairs them)
SEGMENT_BEGIN, SEGMENT_END = "segment_begin", "segment_end"
_PHASES = ("forward", "backward")


def _mark(kind: str, name: str, phase: str) -> None:
    rec = current_recorder()
    if rec is not None:
        rec.add(kind, name, phase)


@contextlib.contextmanager
def segment(name: str, phase: str) -> Iterator[None]:
    """Record the block as one segment ``name`` (``phase``: ``forward`` / ``backward``) while
    hp-dtensor's event recorder is on (a no-op otherwise): a computation of the interleaved
    step that runs alone (the first forward, the last backward)."""
    if current_recorder() is None:
        yield
        return
    _mark(SEGMENT_BEGIN, name, phase)
    try:
        yield
    finally:
        _mark(SEGMENT_END, name, phase)


def segment_spans(events: list[Event]) -> list[tuple[str, str, int, int]]:
    """``(name, phase, begin_ns, end_ns)`` of every recorded segment (see the module
    docstring), in the order they began; a segment still open at the end is left out."""
    open_at: dict[tuple[str, str], int] = {}
    spans: list[tuple[str, str, int, int]] = []
    for e in events:
        if e.kind == SEGMENT_BEGIN:
            open_at[(e.name, e.phase)] = e.t_ns
        elif e.kind == SEGMENT_END and (e.name, e.phase) in open_at:
            spans.append((e.name, e.phase, open_at.pop((e.name, e.phase)), e.t_ns))
    return sorted(spans, key=lambda s: s[2])


class _Baton:
    """Which of the two sides runs: ``turn`` (0 or 1); a side that has ``done`` never gets it
    again."""

    def __init__(self, names: tuple[str, str] = _PHASES) -> None:
        self.cv = threading.Condition()
        self.turn = 0
        self.done = [False, False]
        self.switches = 0
        self.names = names

    def mark(self, kind: str, me: int) -> None:
        """A segment of side ``me`` begins or ends (recorded only under a recorder)."""
        if current_recorder() is not None:
            _mark(kind, self.names[me], _PHASES[me])

    def switch(self) -> None:
        """Called by the running side (on whatever thread runs it): hand over to the other
        side, if it is not done, and wait until the baton comes back."""
        with self.cv:
            me = self.turn
            if self.done[1 - me]:
                return
            self.mark(SEGMENT_END, me)
            self.turn = 1 - me
            self.switches += 1
            self.cv.notify_all()
            self.cv.wait_for(lambda: self.turn == me)
            comm.set_lane(me + 1)
            self.mark(SEGMENT_BEGIN, me)

    def drain(self, me: int) -> None:
        """Side ``me`` (running) lets the other side run to its end."""
        while True:
            with self.cv:
                if self.done[1 - me]:
                    return
            self.switch()

    def run_side(self, me: int, fn: Callable[[], Any], out: list[Any]) -> None:
        with self.cv:
            self.cv.wait_for(lambda: self.turn == me)
            comm.set_lane(me + 1)
            self.mark(SEGMENT_BEGIN, me)
        try:
            out[me] = (True, fn())
        except BaseException as exc:  # re-raised by the caller
            out[me] = (False, exc)
        finally:
            self.mark(SEGMENT_END, me)
            with self.cv:
                self.done[me] = True
                self.turn = 1 - me
                self.cv.notify_all()


_current: _Baton | None = None


class _HoldEnd(Function):
    """Identity whose backward (the first node of the backward that starts at its output) queues
    an engine callback ahead of every callback queued later (FSDP2's end-of-backward among them):
    the backward side lets the forward side finish before its backward closes."""

    @staticmethod
    def forward(ctx: Any, baton: _Baton, x: Tensor) -> Tensor:  # type: ignore[override]
        ctx.baton = baton
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:  # type: ignore[override]
        baton = ctx.baton
        torch.autograd.Variable._execution_engine.queue_callback(lambda: baton.drain(1))
        return None, grad


def hold_backward_end(loss: Tensor) -> Tensor:
    """``loss`` as it is; inside :func:`run_interleaved`'s ``second`` side, a backward started
    from the result closes only after the ``first`` side has finished (see the module
    docstring). Outside it, ``loss`` itself."""
    if _current is None:
        return loss
    return _HoldEnd.apply(_current, loss)


@contextlib.contextmanager
def _caller_state(
    grad: bool, casts: list[tuple[str, torch.dtype]], modes: list[Any]
) -> Iterator[None]:
    """The caller's grad mode, autocast and torch dispatch modes (a memory tracker, a FLOP
    counter: the mode objects themselves, so one counter sees both sides) on a side's thread.
    Dispatch modes live in a thread-local stack: each mode is pushed on this thread's stack as
    the caller's thread has it (outermost first) and popped at the end, without entering it a
    second time (the mode's own enter/exit bookkeeping stays with the caller)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.set_grad_enabled(grad))
        for device, dtype in casts:
            stack.enter_context(torch.autocast(device, dtype=dtype))
        for mode in modes:
            _push_mode(mode)
            stack.callback(_pop_mode)
        yield


def run_interleaved(
    first: Callable[[], T],
    second: Callable[[], Any],
    names: tuple[str, str] = _PHASES,
) -> tuple[T, int]:
    """Run ``first()`` and ``second()`` interleaved at their in-flight points (see the module
    docstring); return ``first``'s result and how many times the baton changed hands (0: the
    two ran one after the other); ``first`` starts. Every rank calls it with the same pair of
    computations. Each side's collectives are marked as its own (hp-dtensor's
    ``comm.set_lane``), so a layer's check for collectives it leaked sees only its side's. An
    exception of either side is raised here once both sides have stopped (the other side runs
    to its end alone). ``names``: the two sides' segment names in a recorded trace (default
    ``("forward", "backward")``)."""
    global _current
    if _current is not None:
        raise RuntimeError("run_interleaved does not nest")
    grad = torch.is_grad_enabled()
    casts = [(d, t) for d in ("cpu", "cuda", "npu") if (t := autocast_dtype(d)) is not None]
    modes = _get_current_dispatch_mode_stack()
    baton = _Baton(names)
    out: list[Any] = [None, None]
    threads = []
    for me, fn in enumerate((first, second)):
        ctx = contextvars.copy_context()

        def body(me: int = me, fn: Callable[[], Any] = fn, ctx: Any = ctx) -> None:
            def call() -> Any:
                with _caller_state(grad, casts, modes):
                    return fn()

            ctx.run(baton.run_side, me, call, out)

        threads.append(threading.Thread(target=body, name=f"hp-interleave-{me}", daemon=True))
    _current = baton
    lane = comm.set_lane(0)
    try:
        with in_flight_hook(baton.switch):
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
    finally:
        _current = None
        comm.set_lane(lane)
    for ok, value in out:
        if not ok:
            raise value
    return out[0][1], baton.switches
