"""FSDP2's collectives on the trace's comm lane, from the ranges FSDP2 names them by.

FSDP2 (``grad_reduction="fsdp"``, the default) starts its collectives itself, not
through hp-dtensor's comm runtime, so hp-dtensor's recorder does not see them. It brackets its
phases with ``torch.profiler.record_function`` ranges instead:
``FSDP::all_gather (<module>)`` launches a block's parameter all-gather,
``FSDP::all_gather_copy_out (<module>)`` waits for it and copies the parameters out, and
``FSDP::post_backward_reduce (<module>)`` reduce-scatters (HSDP: and all-reduces) the block's
gradients (on gloo the collective runs inside that range; on CUDA/NPU the range is its launch
on FSDP2's stream).

A ``torch.profiler`` session sees those ranges, but recording every operator of the step
made the traced step about twice as long (measured on the 4-rank CPU job), which defeats a
picture of what overlaps what. So :class:`FsdpCapture` times the ranges themselves: for the
traced step it wraps the ``record_function`` that FSDP2's parameter-group module calls (the
real one still runs inside, so a user's profiler sees the same ranges) and keeps each range's
``time.perf_counter_ns()`` start and end, the recorder's clock. ``spans`` turns them into
comm-lane spans (tid 1, like the recorder's): ``fsdp all_gather <module>`` from the launch to
the end of its copy-out, ``fsdp reduce_scatter <module>`` over the reduce. That module
attribute is torch's internals: where it is missing the capture records nothing, and the main
job's integration test (which expects FSDP2 spans under FSDP2) fails.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_param_group"
_KEPT = ("FSDP::all_gather", "FSDP::all_gather_copy_out", "FSDP::post_backward_reduce")


def _module(name: str) -> str:
    """``"FSDP::all_gather (model.layers.0)"`` -> ``"model.layers.0"`` (the root: ``"model"``)."""
    return name.split(" (", 1)[1].rstrip(")") if " (" in name else "model"


class FsdpCapture:
    """``with FsdpCapture() as cap: <the step>``, then ``cap.spans(t0_ns, pid)``."""

    def __init__(self) -> None:
        self.ranges: list[tuple[str, int, int]] = []  # (name, start ns, end ns)
        self._owner: Any = None
        self._real: Any = None

    def __enter__(self) -> FsdpCapture:
        import importlib

        try:
            owner = importlib.import_module(_MODULE)
        except ImportError:
            return self
        real = getattr(owner, "record_function", None)
        if real is None:
            return self
        ranges = self.ranges

        @contextlib.contextmanager
        def timed(name: str, *args: Any) -> Iterator[Any]:
            start = time.perf_counter_ns()
            try:
                with real(name, *args) as inner:
                    yield inner
            finally:
                if name.split(" (", 1)[0] in _KEPT:
                    ranges.append((name, start, time.perf_counter_ns()))

        self._owner, self._real = owner, real
        owner.record_function = timed
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._owner is not None:
            self._owner.record_function = self._real
            self._owner = None

    def spans(self, t0_ns: int, pid: int) -> list[dict[str, Any]]:
        """FSDP2's collectives as Chrome-trace 'X' events on the comm lane, in microseconds
        since ``t0_ns`` (the recorder's first event, ``time.perf_counter_ns()``)."""
        out: list[dict[str, Any]] = []
        gathers: dict[str, list[int]] = {}  # module -> launch starts not yet copied out
        for name, start, end in sorted(self.ranges, key=lambda r: r[1]):
            label, module = name.split(" (", 1)[0], _module(name)
            if label == "FSDP::all_gather":
                gathers.setdefault(module, []).append(start)
            elif label == "FSDP::all_gather_copy_out" and gathers.get(module):
                launched = gathers[module].pop(0)
                out.append(_span(f"fsdp all_gather {module}", launched, end, t0_ns, pid))
            elif label == "FSDP::post_backward_reduce":
                out.append(_span(f"fsdp reduce_scatter {module}", start, end, t0_ns, pid))
        return out


def _span(name: str, start: int, end: int, t0_ns: int, pid: int) -> dict[str, Any]:
    return {
        "name": name,
        "ph": "X",
        "ts": (start - t0_ns) / 1000.0,
        "dur": max(end - start, 0) / 1000.0,
        "pid": pid,
        "tid": 1,
        "args": {"from": "FSDP2's named ranges"},
    }


def add_spans(trace: dict[str, Any], spans: list[dict[str, Any]]) -> None:
    """Add ``spans`` to ``trace`` (the recorder's Chrome trace), shifting every event so that
    the earliest starts at 0 (the root module's first all-gather precedes the recorder's first
    event)."""
    events = trace.setdefault("traceEvents", [])
    events.extend(spans)
    first = min((e["ts"] for e in events if e.get("ph") == "X"), default=0.0)
    if first < 0:
        for e in events:
            if "ts" in e:
                e["ts"] -= first
