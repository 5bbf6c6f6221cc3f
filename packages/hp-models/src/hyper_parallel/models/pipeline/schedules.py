"""torch.distributed.pipelining's schedules by name: which this torch has, what each needs of
the stages and micro-batches, and where each stage lives.

Every rule here is checked before any communication and is the same on every rank.

=======================  =====  ===================  =============================  ========
schedule                 torch  stages a rank        micro-batches ``m``            stages
=======================  =====  ===================  =============================  ========
``GPipe``                2.4    1                    any                            loop
``1F1B``                 2.4    1                    ``m >= pp``                    loop
``Interleaved1F1B``      2.4    ``>= 2``             ``m % max(1, m // pp) == 0``   loop
``InterleavedZeroBubble`` 2.5   ``>= 2``             ``m % max(1, m // pp) == 0``   loop
``ZBVZeroBubble``        2.6    2                    ``m >= 2·pp``                  v
``DualPipeV``            2.9    2                    ``m >= 2·pp``                  v
=======================  =====  ===================  =============================  ========

The V schedules also need a torch whose stages hand activations to a stage on the same rank in
place (:func:`same_rank_hand_off`; torch 2.7.1 sends them through the process group and
fails); elsewhere they raise ``ValueError``.

"loop": stage ``s`` on pp rank ``s % pp`` (a rank holds stages ``r, r + pp, ...``); "v": pp
rank ``r`` holds stages ``r`` and ``2·pp − 1 − r`` (the first and the last stage on rank 0).

The zero-bubble schedules (``InterleavedZeroBubble``, ``ZBVZeroBubble``, ``DualPipeV``) split
each backward into an input-gradient step (I) and a weight-gradient step (W) that torch runs
with two partial ``torch.autograd.grad`` calls. The layers here cannot be differentiated in
parts: their backward collectives (Ulysses' all-to-alls, the delta-rule state exchange,
FSDP2's reduce-scatters) pair a launch and a wait inside one backward, and a partial
``autograd.grad`` prunes one of the pair. So these schedules run with torch's ``dw_builder``
hook: the I step computes the input and the weight gradients in one backward and the W step
has nothing left to do. The results are exact and the schedules' order (and their memory
profile of stages in flight) is kept; the bubble their split would fill is not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "SCHEDULES",
    "ScheduleSpec",
    "check_schedule",
    "same_rank_hand_off",
    "schedule_class",
    "stages_of_rank",
]


@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule: torch's class name, the torch release that added it, whether it runs
    several stages a rank (``multi``), how many stages a rank it needs (``per_rank``: an exact
    count, or ``None``: ``>= 2`` for a multi schedule, 1 otherwise) and the stage placement
    (``"loop"`` or ``"v"``); ``split_backward``: torch splits its backward into input and weight
    steps (the zero-bubble schedules; see the module docstring)."""

    name: str
    cls: str
    since: str
    multi: bool
    per_rank: int | None
    style: str = "loop"
    split_backward: bool = False


SCHEDULES: dict[str, ScheduleSpec] = {
    s.name: s
    for s in (
        ScheduleSpec("GPipe", "ScheduleGPipe", "2.4", False, 1),
        ScheduleSpec("1F1B", "Schedule1F1B", "2.4", False, 1),
        ScheduleSpec("Interleaved1F1B", "ScheduleInterleaved1F1B", "2.4", True, None),
        ScheduleSpec(
            "InterleavedZeroBubble",
            "ScheduleInterleavedZeroBubble",
            "2.5",
            True,
            None,
            "loop",
            True,
        ),
        ScheduleSpec("ZBVZeroBubble", "ScheduleZBVZeroBubble", "2.6", True, 2, "v", True),
        ScheduleSpec("DualPipeV", "ScheduleDualPipeV", "2.9", True, 2, "v", True),
    )
}


def schedule_class(name: str) -> Any:
    """torch's class for schedule ``name``, or ``None`` where this torch lacks it."""
    from torch.distributed.pipelining import schedules

    return getattr(schedules, SCHEDULES[name].cls, None)


def same_rank_hand_off() -> bool:
    """Whether this torch's ``PipelineStage`` passes activations between two stages on one
    rank in place (``_is_same_rank``), as the V schedules need."""
    from torch.distributed.pipelining import PipelineStage

    return hasattr(PipelineStage, "_is_same_rank")


def check_schedule(name: Any, pp: int, stages_per_rank: Any, microbatches: Any) -> ScheduleSpec:
    """Every rule of the table in the module docstring; ``ValueError`` (``TypeError`` for a
    non-int) naming the rule, the same on every rank."""
    if not isinstance(name, str) or name not in SCHEDULES:
        raise ValueError(
            f"unknown pipeline schedule {name!r}; known: {list(SCHEDULES)} "
            "(torch.distributed.pipelining's)"
        )
    spec = SCHEDULES[name]
    if schedule_class(name) is None:
        raise ValueError(
            f"schedule {name!r} needs torch {spec.since} or later "
            f"(torch.distributed.pipelining.{spec.cls}); this is torch {torch.__version__}"
        )
    for what, value in (("stages_per_rank", stages_per_rank), ("microbatches", microbatches)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{what} must be an int, got {value!r}")
        if value < 1:
            raise ValueError(f"{what} must be >= 1, got {value}")
    if spec.style == "v" and not same_rank_hand_off():
        raise ValueError(
            f"schedule {name!r} puts two consecutive stages on one rank, and this torch "
            f"({torch.__version__}) sends the activations between them through the process "
            "group, which fails (a send to itself); torch releases whose PipelineStage hands "
            "them over in place (_is_same_rank: torch 2.13 has it) run it; use "
            "'Interleaved1F1B' here"
        )
    v, m = stages_per_rank, microbatches
    if spec.per_rank is not None and v != spec.per_rank:
        raise ValueError(
            f"schedule {name!r} runs exactly {spec.per_rank} "
            f"stage{'s' if spec.per_rank > 1 else ''} a rank; got stages_per_rank={v}"
            + ("" if spec.multi else " (use 'Interleaved1F1B' for several stages a rank)")
        )
    if spec.multi and spec.per_rank is None and v < 2:
        raise ValueError(
            f"schedule {name!r} interleaves several stages a rank: stages_per_rank must be >= 2, "
            f"got {v} (use '1F1B' for one stage a rank)"
        )
    if name == "1F1B" and m < pp:
        raise ValueError(
            f"schedule '1F1B' needs at least as many micro-batches as pipeline stages: "
            f"microbatches={m} < pp={pp}"
        )
    if name in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, m // pp)
        if m % rounds:
            raise ValueError(
                f"schedule {name!r} needs the micro-batches to be a multiple of the rounds "
                f"max(1, microbatches // pp) = {rounds}: microbatches={m}, pp={pp} (use a "
                f"multiple of pp)"
            )
    if spec.style == "v" and m < 2 * pp:
        raise ValueError(
            f"schedule {name!r} needs at least as many micro-batches as stages (2·pp = "
            f"{2 * pp}); got microbatches={m}"
        )
    return spec


def stages_of_rank(spec: ScheduleSpec, pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """The stage indices pp rank ``pp_rank`` holds, in increasing order (see the module
    docstring)."""
    if spec.style == "v":
        return sorted({pp_rank, 2 * pp - 1 - pp_rank})
    return [pp_rank + k * pp for k in range(stages_per_rank)]
