"""FSDP2's collectives on the trace's comm lane, from a ``torch.profiler`` session of the step.

FSDP2 (``grad_reduction="fsdp"``, the default on torch 2.13) starts its collectives itself, not
through hp-dtensor's comm runtime, so hp-dtensor's recorder does not see them. It names its
phases with ``torch.profiler.record_function`` ranges instead:
``FSDP::all_gather (<module>)`` launches a block's parameter all-gather,
``FSDP::all_gather_copy_out (<module>)`` waits for it and copies the parameters out, and
``FSDP::post_backward_reduce (<module>)`` reduce-scatters (HSDP: and all-reduces) the block's
gradients. :class:`FsdpCapture` records the CPU profiler over the traced step and turns them into
comm-lane spans (tid 1, like the recorder's): ``fsdp all_gather <module>`` from the launch to the
end of its copy-out, ``fsdp reduce_scatter <module>`` over the reduce (on gloo the collective
runs inside that range; on CUDA/NPU the range is its launch on FSDP2's stream). A marker range
taken at a known ``time.perf_counter_ns()`` puts the profiler's clock on the recorder's.
"""

from __future__ import annotations

import time
from typing import Any

import torch

ORIGIN = "hp.trace.origin"


def _module(name: str) -> str:
    """``"FSDP::all_gather (model.layers.0)"`` -> ``"model.layers.0"`` (the root: ``"model"``)."""
    return name.split(" (", 1)[1].rstrip(")") if " (" in name else "model"


class FsdpCapture:
    """``with FsdpCapture() as cap: <the step>``, then ``cap.spans(t0_ns, pid)``."""

    def __init__(self) -> None:
        self.prof: Any = None
        self.origin_ns = 0

    def __enter__(self) -> FsdpCapture:
        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self.prof.__enter__()
        with torch.profiler.record_function(ORIGIN):
            self.origin_ns = time.perf_counter_ns()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.prof.__exit__(*exc)

    def spans(self, t0_ns: int, pid: int) -> list[dict[str, Any]]:
        """FSDP2's collectives as Chrome-trace 'X' events on the comm lane, in microseconds
        since ``t0_ns`` (the recorder's first event, ``time.perf_counter_ns()``)."""
        events = [e for e in self.prof.events() if e.name.startswith("FSDP::") or e.name == ORIGIN]
        origin = next((e for e in events if e.name == ORIGIN), None)
        if origin is None:
            return []
        shift = self.origin_ns / 1000.0 - origin.time_range.start - t0_ns / 1000.0
        events.sort(key=lambda e: e.time_range.start)
        out: list[dict[str, Any]] = []
        gathers: dict[str, list[Any]] = {}  # module -> launched, not yet copied out
        for e in events:
            label = e.name.split(" (", 1)[0]
            module = _module(e.name)
            start, end = e.time_range.start, e.time_range.end
            if label == "FSDP::all_gather":
                gathers.setdefault(module, []).append(e)
            elif label == "FSDP::all_gather_copy_out" and gathers.get(module):
                launch = gathers[module].pop(0)
                out.append(
                    _span(f"fsdp all_gather {module}", launch.time_range.start, end, shift, pid)
                )
            elif label == "FSDP::post_backward_reduce":
                out.append(_span(f"fsdp reduce_scatter {module}", start, end, shift, pid))
        return out


def _span(name: str, start: float, end: float, shift: float, pid: int) -> dict[str, Any]:
    return {"name": name, "ph": "X", "ts": start + shift, "dur": max(end - start, 0.0),
            "pid": pid, "tid": 1, "args": {"from": "torch.profiler (FSDP2)"}}  # fmt: skip


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
