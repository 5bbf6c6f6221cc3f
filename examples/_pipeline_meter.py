"""The pipeline's stages timed and traced (the main job under ``--pp``, examples/train_hybrid.py).

:class:`StageMeter` wraps the ``forward_one_chunk`` / ``backward_one_chunk`` (and, for the
zero-bubble schedules, ``backward_weight_one_chunk``) of the torch ``PipelineStage`` objects a
:class:`~hyper_parallel.models.PipelinedModel` runs (``pm._runner._stage``, or ``._stages`` for
the schedules with several stages a rank), as packages/hp-models/benchmarks/pipeline_bubble.py
does: each stage's forward and backward wall time in a step, every micro-batch summed. The
runner is built in the first ``pm.step``; the meter wraps it as it is built (``pm._build``) and
again at each step's start, whichever comes first. While ``recorder`` (hp-dtensor's
``EventRecorder``) is set, each call is also a compute span ``stage S mb K`` (``forward`` /
``backward``) on the rank's timeline, the layers' spans nested inside.

:func:`p2p_spans` puts torch's point-to-point exchanges between the stages on the trace's comm
lane: each batch of sends and receives (``p2p:fwd_recv``, ``p2p:bwd_send``, ...; torch's
names) from its launch to the end of its wait, and the time a stage blocks waiting for one as a
``wait p2p:…`` span on the compute lane (the bubble). They are torch internals
(``torch.distributed.pipelining.schedules._batch_p2p`` / ``_wait_batch_p2p``): where missing,
nothing is recorded.

:func:`micro_batch_lane`: under ``--overlap forward_backward`` (``pipeline_model(...,
overlap="forward_backward")`` at pp = 1) each micro-batch's running stretches, as hp-models
records them (``forward mb1``, ``backward mb0``, ...: from a start or a hand-over to the next
hand-over; ``hyper_parallel.models.pipeline.interleave.segment_spans``), on a lane of their own
(tid 2, ``micro-batches``): a ``forward mb1`` stretch that starts while ``moe:combine0:grad`` is
on the comm lane is micro-batch 1's forward running under micro-batch 0's combine.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from typing import Any

PHASES = {
    "forward_one_chunk": "forward",
    "backward_one_chunk": "backward",
    "backward_weight_one_chunk": "backward",
}


def torch_stages(runner: Any) -> list[Any]:
    """The ``PipelineStage`` objects of a torch schedule (one, or several a rank)."""
    stages = getattr(runner, "_stages", None)
    if stages is None:
        stage = getattr(runner, "_stage", None)
        stages = [] if stage is None else [stage]
    return list(stages)


class StageMeter:
    """Per-stage forward / backward seconds of the current step (``time``: ``{(stage, phase):
    s}``), the wall time of its ``pm.step`` (``step_s``) and, while ``recorder`` is set, a span
    per micro-batch of each stage."""

    def __init__(self, pm: Any) -> None:
        self.pm = pm
        self.time: dict[tuple[int, str], float] = {}
        self.step_s = 0.0
        self.recorder: Any = None
        self._wrapped: set[int] = set()
        step = pm.step

        @functools.wraps(step)
        def timed_step(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return step(*args, **kwargs)
            finally:
                self.step_s += time.perf_counter() - t0

        pm.step = timed_step
        build = getattr(pm, "_build", None)
        if build is not None:  # wrap torch's stages as soon as the first step builds them

            @functools.wraps(build)
            def built(*args: Any, **kwargs: Any) -> Any:
                runner = build(*args, **kwargs)
                self._wrap(runner)
                return runner

            pm._build = built

    def attach(self) -> None:
        """Wrap the stages of the runner built so far (a no-op for those already wrapped)."""
        runner = getattr(self.pm, "_runner", None)
        if runner is not None:
            self._wrap(runner)

    def clear(self) -> None:
        self.time.clear()
        self.step_s = 0.0

    def _wrap(self, runner: Any) -> None:
        for stage in torch_stages(runner):
            if id(stage) in self._wrapped:
                continue
            self._wrapped.add(id(stage))
            for name, phase in PHASES.items():
                if hasattr(stage, name):
                    setattr(stage, name, self._timed(stage, name, phase))

    def _timed(self, stage: Any, name: str, phase: str) -> Any:
        original = getattr(stage, name)
        index = int(stage.stage_index)
        traced = name != "backward_weight_one_chunk"  # the zero-bubble W step: timed only

        @functools.wraps(original)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            rec = self.recorder if traced else None
            chunk = args[0] if args else next(iter(kwargs.values()), "?")
            span = f"stage {index} mb {chunk}"
            if rec is not None:
                rec.add("begin", span, phase)
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                key = (index, phase)
                self.time[key] = self.time.get(key, 0.0) + time.perf_counter() - t0
                if rec is not None:
                    rec.add("end", span, phase)

        return wrapped

    def snapshot(self) -> dict[str, list[float]]:
        """``{stage: [forward s, backward s]}`` of the step (JSON keys)."""
        stages = sorted({s for s, _ in self.time})
        return {
            str(s): [self.time.get((s, "forward"), 0.0), self.time.get((s, "backward"), 0.0)]
            for s in stages
        }


@contextlib.contextmanager
def p2p_spans(recorder: Any, meter: Any = None) -> Iterator[None]:
    """While in the block, record torch's pipeline sends and receives on ``recorder`` (see the
    module docstring); ``meter`` (examples/_meter.py's ``LayerMeter``) counts their bytes under
    ``p2p``."""
    try:
        from torch.distributed.pipelining import schedules
    except ImportError:
        yield
        return
    batch = getattr(schedules, "_batch_p2p", None)
    wait = getattr(schedules, "_wait_batch_p2p", None)
    if recorder is None or batch is None or wait is None:
        yield
        return
    pending: dict[int, tuple[int, str, str, Any]] = {}  # id(works) -> (op, name, phase, works)

    def launched(ops: Any, *args: Any, **kwargs: Any) -> Any:
        desc = kwargs.get("desc", args[0] if args else None) or "batch"
        name, phase = f"p2p:{desc}", "backward" if str(desc).startswith("bwd") else "forward"
        nbytes = sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
        op_id = recorder.new_op_id()
        recorder.add("launch", name, phase, op_id, nbytes)
        before = getattr(meter, "current", None)
        if meter is not None:
            meter.current = "p2p"
        try:
            works = batch(ops, *args, **kwargs)
        finally:
            if meter is not None:
                meter.current = before
        pending[id(works)] = (op_id, name, phase, works)  # kept alive until waited on
        return works

    def waited(works: Any, *args: Any, **kwargs: Any) -> Any:
        entry = pending.pop(id(works), None)
        if entry is None:
            return wait(works, *args, **kwargs)
        op_id, name, phase, _ = entry
        recorder.add("wait_begin", name, phase, op_id)
        try:
            return wait(works, *args, **kwargs)
        finally:
            recorder.add("wait", name, phase, op_id)

    schedules._batch_p2p = launched  # type: ignore[assignment]
    schedules._wait_batch_p2p = waited  # type: ignore[assignment]
    try:
        yield
    finally:
        schedules._batch_p2p = batch
        schedules._wait_batch_p2p = wait


def bubble(schedule: str, pp: int, microbatches: int, stages_per_rank: int) -> float | None:
    """The schedule's idle fraction of a rank with equal stages: ``(p − 1)/(m + p − 1)`` for
    GPipe and 1F1B, ``(p − 1)/(v·m + p − 1)`` interleaved over ``v`` stages a rank; ``None``
    for the zero-bubble schedules (run here with a whole backward a micro-batch)."""
    if schedule in ("GPipe", "1F1B"):
        return (pp - 1) / (microbatches + pp - 1)
    if schedule == "Interleaved1F1B":
        return (pp - 1) / (stages_per_rank * microbatches + pp - 1)
    return None


def micro_batch_lane(trace: dict[str, Any], events: list[Any], pid: int) -> int:
    """Add the recorded micro-batch segments (see the module docstring) of ``events`` (the
    recorder's, whose first event is the trace's time 0) to ``trace`` on tid 2; return how many
    were added (0: none recorded, the trace unchanged)."""
    from hyper_parallel.models.pipeline.interleave import segment_spans

    spans = segment_spans(events)
    if not spans:
        return 0
    t0 = events[0].t_ns
    out = trace.setdefault("traceEvents", [])
    out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 2,
                "args": {"name": "micro-batches"}})  # fmt: skip
    for name, phase, begin, end in spans:
        out.append({"name": name, "ph": "X", "ts": (begin - t0) / 1000.0,
                    "dur": max(end - begin, 0) / 1000.0, "pid": pid, "tid": 2,
                    "args": {"phase": phase}})  # fmt: skip
    return len(spans)
