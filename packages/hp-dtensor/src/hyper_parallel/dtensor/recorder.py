"""Event recorder: the schedule of launches, waits and the compute they bracket, for every
layer that communicates through :mod:`hyper_parallel.dtensor.comm`.

Off by default. While no recorder is active every hook is one global ``None`` check (and the
layers insert no marker nodes), so recording costs nothing when it is off. Inside
``with record_events() as rec:`` every collective started through ``comm`` records a
``launch`` (with the bytes this rank moves over its link, ``comm.link_bytes``), a
``wait_begin`` and a ``wait`` event, and the layers record ``begin``/``end`` events around
the compute they overlap (:class:`span`), in forward and in backward.

``rec.to_chrome_trace()`` returns a Chrome trace (``chrome://tracing`` / https://ui.perfetto.dev
JSON): compute spans on one track, each collective in flight (launch to wait) on another.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = ["Event", "EventRecorder", "current_recorder", "record_events", "span"]

_ACTIVE: EventRecorder | None = None


@dataclass(frozen=True)
class Event:
    """One recorded event.

    ``kind``: ``launch`` | ``wait_begin`` | ``wait`` (collectives, ``op_id`` pairs them) or
    ``begin`` | ``end`` (compute spans). ``name``: e.g. ``a2a:q``, ``all_gather:latent``,
    ``q_proj``, ``o_proj.weight_grad``. ``phase``: ``forward`` or ``backward``.
    ``nbytes``: for launches, the bytes this rank moves over its link (``comm.link_bytes``).
    """

    kind: str
    name: str
    phase: str
    t_ns: int
    op_id: int = -1
    nbytes: int = 0


class EventRecorder:
    """Collects :class:`Event` s in the order they happen on this process."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._next_op = 0

    # -- recording (called by the package) ------------------------------------------------
    def new_op_id(self) -> int:
        self._next_op += 1
        return self._next_op

    def add(self, kind: str, name: str, phase: str, op_id: int = -1, nbytes: int = 0) -> None:
        self.events.append(Event(kind, name, phase, time.perf_counter_ns(), op_id, nbytes))

    # -- queries ----------------------------------------------------------------------------
    def index(self, kind: str, name: str, phase: str | None = None, occurrence: int = 0) -> int:
        """Position of the ``occurrence``-th event matching ``kind``/``name`` (and ``phase``)."""
        seen = 0
        for i, e in enumerate(self.events):
            if e.kind == kind and e.name == name and (phase is None or e.phase == phase):
                if seen == occurrence:
                    return i
                seen += 1
        raise KeyError(f"no {kind!r} event named {name!r} (phase {phase!r}) #{occurrence}")

    def names(self, kind: str | None = None, phase: str | None = None) -> list[str]:
        return [
            e.name
            for e in self.events
            if (kind is None or e.kind == kind) and (phase is None or e.phase == phase)
        ]

    def bytes_received(self, phase: str | None = None) -> int:
        """Bytes this rank moved over its link in all recorded launches (``comm.link_bytes``:
        for the all-to-alls, gathers and reduce-scatters of the layers, what it receives from
        its peers)."""
        return sum(e.nbytes for e in self.events if e.kind == "launch" and phase in (None, e.phase))

    def clear(self) -> None:
        self.events.clear()

    # -- export -----------------------------------------------------------------------------
    def to_chrome_trace(self, path: str | os.PathLike[str] | None = None, *, pid: int = 0) -> dict:
        """Chrome trace JSON (dict); also written to ``path`` when given.

        Track ``compute`` (tid 0): projection/attention spans and the time spent blocked in a
        wait. Track ``comm`` (tid 1): every collective from launch to the end of its wait.
        """
        if not self.events:
            return {"traceEvents": [], "displayTimeUnit": "ms"}
        t0 = self.events[0].t_ns
        us = lambda t: (t - t0) / 1000.0  # noqa: E731
        out: list[dict[str, Any]] = [
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "args": {"name": "compute"}},
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": 1, "args": {"name": "comm"}},
        ]
        open_spans: dict[tuple[str, str], list[Event]] = {}
        launches: dict[int, Event] = {}
        wait_begins: dict[int, Event] = {}
        for e in self.events:
            if e.kind == "begin":
                open_spans.setdefault((e.name, e.phase), []).append(e)
            elif e.kind == "end":
                stack = open_spans.get((e.name, e.phase))
                if stack:
                    b = stack.pop()
                    out.append(_span(f"{e.name} ({e.phase})", us(b.t_ns), us(e.t_ns), pid, 0))
            elif e.kind == "launch":
                launches[e.op_id] = e
            elif e.kind == "wait_begin":
                wait_begins[e.op_id] = e
            elif e.kind == "wait":
                lt = launches.pop(e.op_id, None)
                wb = wait_begins.pop(e.op_id, None)
                if lt is not None:
                    span = _span(e.name, us(lt.t_ns), us(e.t_ns), pid, 1)
                    span["args"] = {"bytes_received": lt.nbytes, "phase": e.phase}
                    out.append(span)
                if wb is not None:
                    out.append(_span(f"wait {e.name}", us(wb.t_ns), us(e.t_ns), pid, 0))
        trace = {"traceEvents": out, "displayTimeUnit": "ms"}
        if path is not None:
            with open(path, "w") as f:
                json.dump(trace, f)
        return trace


def _span(name: str, start_us: float, end_us: float, pid: int, tid: int) -> dict[str, Any]:
    return {
        "name": name,
        "ph": "X",
        "ts": start_us,
        "dur": max(end_us - start_us, 0.0),
        "pid": pid,
        "tid": tid,
    }


def current_recorder() -> EventRecorder | None:
    """The active recorder, or ``None`` when recording is off (the default)."""
    return _ACTIVE


@contextmanager
def record_events(recorder: EventRecorder | None = None) -> Iterator[EventRecorder]:
    """Record this process's schedule while the block runs (forward and backward)."""
    global _ACTIVE
    rec = recorder if recorder is not None else EventRecorder()
    previous = _ACTIVE
    _ACTIVE = rec
    try:
        yield rec
    finally:
        _ACTIVE = previous


class span:
    """Record a compute span ``name`` in ``phase`` (``forward``/``backward``) while the block
    runs; a no-op when recording is off."""

    __slots__ = ("name", "phase", "rec")

    def __init__(self, name: str, phase: str) -> None:
        self.name, self.phase, self.rec = name, phase, _ACTIVE

    def __enter__(self) -> None:
        if self.rec is not None:
            self.rec.add("begin", self.name, self.phase)

    def __exit__(self, *exc: object) -> None:
        if self.rec is not None:
            self.rec.add("end", self.name, self.phase)
