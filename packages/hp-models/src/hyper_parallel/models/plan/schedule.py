"""Pipeline schedules as the planner needs them: the order in which torch's schedules run each
rank's forwards and backwards, the bubble that order leaves, and the activations it keeps in
flight.

The orders are torch's own. The multi-stage schedules (``Interleaved1F1B``,
``InterleavedZeroBubble``, ``ZBVZeroBubble``, ``DualPipeV``) run from the action lists their
classes build from ``pp``, ``m`` and the stages a rank (``F``: forward, ``B``: full backward,
``I``/``W``: a backward split into input and weight gradients, ``OVERLAP_F_B``: a forward and
a backward together), which torch's schedule visualizer builds over mock stages (no process
group, no model); ``GPipe`` and ``1F1B`` run one stage a rank from a loop of their own
(``_step_microbatches``), which :func:`rank_actions` writes out the same way.

hp-models' ``pipeline_model`` runs the zero-bubble schedules with torch's ``dw_builder``: the
``I`` step computes the whole backward (input and weight gradients) and ``W`` does nothing
(its layers' backward collectives cannot be split; ``pipeline/schedules.py``). The planner
models that by default (``split_backward=False``); torch's own split is there to compare.

**In flight.** A forward of micro-batch ``k`` through stage ``s`` keeps ``A_s`` bytes (the
stage's activations for ``B/(dp·m)`` rows) until its backward frees them (``B``, or ``I``
under ``pipeline_model``; with torch's split, ``W``: ``stage_backward_input`` keeps the graph,
``retain_graph=True``, for the weight gradients). A backward runs with its own peak ``P_s``
(its saved bytes plus what its backward adds) in place of its ``A_s``. A rank's peak is the
most, over its action list, of what is in flight plus the running backward's extra
(:func:`in_flight_peak`). From torch's orders, with equal stages (``A`` a stage's bytes for one
micro-batch; stage or rank ``r`` of ``pp``; ``v`` stages a rank; ``m`` micro-batches):

- ``GPipe``: every forward before any backward: ``m`` micro-batches on every rank;
- ``1F1B``: stage ``r`` runs ``min(m, pp − r)`` forwards before its first backward, then one
  forward after each backward: ``min(m, pp − r)``, the first stage the most (``min(m, pp)``);
- ``Interleaved1F1B`` (stage ``s`` on rank ``s % pp``): rank ``r`` warms up with
  ``w_r = min((v − 1)·mpr + 2·(pp − 1 − r), v·m)`` forwards (``mpr = m / max(1, m // pp)``,
  ``pp`` where ``pp`` divides ``m``) and runs one more before its first backward:
  ``min(w_r + 1, v·m)`` stage-forwards of a ``v``-th of the rank's layers each; rank 0 keeps
  ``(pp + (pp − 1)/v)`` times what its layers keep for one micro-batch, against ``1F1B``'s
  ``pp``;
- ``InterleavedZeroBubble``: the same warm-up with ``multiply_factor`` 1: rank ``r`` keeps at
  most ``2·pp − r`` stage-forwards at ``v = 2`` (rank 0: ``pp`` times its layers' bytes, as
  ``1F1B``);
- ``ZBVZeroBubble`` (rank ``r`` holds stages ``r`` and ``2·pp − 1 − r``): rank ``r`` runs
  ``2·(pp − r) − 1`` forwards of stage ``r`` first; every rank peaks at ``2·pp``
  stage-forwards of half its layers (``pp`` times its layers' bytes); ``DualPipeV`` one
  more (``2·pp + 1``).

**Bubble.** :func:`bubble` replays the order with every stage equal (a forward 1, a backward
2; with activation checkpointing a backward 3, the recompute going with the input gradient;
under ``pipeline_model`` a zero-bubble ``I`` the whole backward and ``W`` 0, with torch's split
``I`` and ``W`` 1 each), each action starting once its rank is free and what it needs is done
(the previous stage's forward of the micro-batch; the next stage's backward, or its own forward
on the last stage; ``W`` after its ``I``), communication taken as free; the idle share of the
busiest rank's time is the bubble:

- ``GPipe`` and ``1F1B``: ``(pp − 1)/(m + pp − 1)``;
- ``Interleaved1F1B`` and, under ``pipeline_model``, ``InterleavedZeroBubble``:
  ``(pp − 1)/(v·m + pp − 1)`` where ``pp`` divides ``m``;
- ``ZBVZeroBubble`` under ``pipeline_model``: ``4·(pp − 1)`` idle half-stage forwards against
  ``6·m`` busy: ``2·(pp − 1)/(3·m + 2·(pp − 1))`` (0.2 at ``pp = 4``, ``m = 8``: worse than
  ``Interleaved1F1B``'s 0.16); ``DualPipeV`` its replay (0.19 there);
- with torch's split backward the zero-bubble schedules leave ``pp − 1`` forwards idle:
  ``(pp − 1)/(3·v·m + pp − 1)`` (0.06 at ``pp = 4``, ``m = 8``, ``v = 2``).

The modeled step time divides a rank's compute by ``1 − bubble``
(:mod:`hyper_parallel.models.plan.search`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

__all__ = ["SCHEDULES", "bubble", "in_flight_peak", "rank_actions", "stage_ranks"]

# torch's schedules the planner models, in the runtime's names (pipeline/schedules.py)
SCHEDULES = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")

# an action: (kind, stage, micro-batch); kind one of "F", "B", "I", "W"; an OVERLAP_F_B is
# its two actions, forward first
Action = tuple[str, int, int]


def stage_ranks(schedule: str, pp: int, stages_per_rank: int) -> list[list[int]]:
    """The stages each pp rank holds, in increasing order: ``r, r + pp, ...`` (loop
    schedules) or ``r`` and ``2·pp − 1 − r`` (the V schedules)."""
    if schedule in V_SCHEDULES:
        return [sorted({r, 2 * pp - 1 - r}) for r in range(pp)]
    return [[r + k * pp for k in range(stages_per_rank)] for r in range(pp)]


def _flatten(action: Any) -> list[Action]:
    subs = getattr(action, "sub_actions", None)
    if subs:
        return [a for sub in subs for a in _flatten(sub)]
    kind = str(getattr(action.computation_type, "value", action.computation_type))
    if kind not in ("F", "B", "I", "W"):
        return []  # REDUCE_GRAD and the like: no compute
    return [(kind, int(action.stage_index), int(action.microbatch_index))]


def _single_rank_orders(schedule: str, pp: int, m: int) -> list[list[Action]]:
    """``GPipe`` and ``1F1B`` as torch's ``_step_microbatches`` runs them (their classes'
    own action lists are for display, and ``1F1B``'s is off by one on the last stage): stage
    ``s`` of ``1F1B`` warms up with ``min(m, pp − s)`` forwards, then alternates a backward
    and a forward."""
    out = []
    for s in range(pp):
        if schedule == "GPipe":
            out.append([("F", s, k) for k in range(m)] + [("B", s, k) for k in range(m)])
            continue
        warm = min(m, pp - s)
        ops: list[Action] = [("F", s, k) for k in range(warm)]
        f = warm
        for k in range(m):
            ops.append(("B", s, k))
            if f < m:
                ops.append(("F", s, f))
                f += 1
        out.append(ops)
    return out


@functools.lru_cache(maxsize=256)
def rank_actions(
    schedule: str, pp: int, microbatches: int, stages_per_rank: int
) -> tuple[tuple[Action, ...], ...]:
    """Every pp rank's compute actions in the order torch's ``schedule`` runs them (module
    docstring); ``ValueError`` for a schedule torch refuses with these numbers."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if schedule in ("GPipe", "1F1B"):
        out = _single_rank_orders(schedule, pp, microbatches)
    else:
        try:
            from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

            orders = get_schedule_ops(schedule, pp, microbatches, stages_per_rank)
        except (ImportError, AttributeError, TypeError, AssertionError) as e:
            raise ValueError(
                f"this torch cannot list schedule {schedule!r}'s actions "
                f"(torch.distributed.pipelining's schedule visualizer: {e})"
            ) from None
        out = [[a for action in rank if action is not None for a in _flatten(action)]
               for rank in orders]  # fmt: skip
    if len(out) != pp:
        raise ValueError(f"schedule {schedule!r} gave {len(out)} ranks' actions, not {pp}")
    return tuple(tuple(rank) for rank in out)


def in_flight_peak(
    actions: Sequence[Action],
    saved: dict[int, int],
    peak: dict[int, int],
    split_backward: bool = False,
) -> tuple[int, int, int]:
    """``(peak, most bytes kept by forwards at once, most micro-batch stages in flight)`` of
    one rank running ``actions``: ``saved[s]`` the bytes a forward of stage ``s`` keeps,
    ``peak[s]`` its backward's own peak (module docstring). ``split_backward``: ``I`` keeps
    the graph until ``W`` (torch's split backward); else ``I`` is the whole backward and
    ``W`` nothing (hp-models' pipeline runs the zero-bubble schedules so)."""
    live = top = kept = 0
    held: dict[tuple[int, int], int] = {}
    most = 0
    for kind, s, k in actions:
        if kind == "F":
            held[(s, k)] = saved[s]
            live += saved[s]
            most = max(most, len(held))
            top = max(top, live)
            kept = max(kept, live)
        elif kind in ("B", "I"):
            top = max(top, live - held.get((s, k), 0) + peak[s])
            if kind == "B" or not split_backward:
                live -= held.pop((s, k), 0)
        elif split_backward:  # W
            live -= held.pop((s, k), 0)
    return top, kept, most


@functools.lru_cache(maxsize=256)
def bubble(
    schedule: str,
    pp: int,
    microbatches: int,
    stages_per_rank: int,
    checkpointing: bool = False,
    split_backward: bool = False,
) -> float:
    """The idle share of the busiest rank's step under ``schedule`` with equal stages (module
    docstring); 0 for ``pp = 1``. ``split_backward``: ``I`` and ``W`` each a forward's time
    (torch's split); else ``I`` the whole backward and ``W`` nothing (hp-models' pipeline)."""
    if pp == 1:
        return 0.0
    orders = rank_actions(schedule, pp, microbatches, stages_per_rank)
    num_stages = max(s for rank in orders for _, s, _ in rank) + 1
    back = 3.0 if checkpointing else 2.0
    if split_backward:
        cost = {"F": 1.0, "B": back, "I": back - 1.0, "W": 1.0}
    else:
        cost = {"F": 1.0, "B": back, "I": back, "W": 0.0}
    done: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * pp
    busy = [0.0] * pp
    pos = [0] * pp
    left = sum(len(r) for r in orders)
    while left:
        moved = False
        for r, rank in enumerate(orders):
            while pos[r] < len(rank):
                kind, s, k = rank[pos[r]]
                if kind == "F":
                    deps = [("F", s - 1, k)] if s > 0 else []
                elif kind in ("B", "I"):
                    deps = [("F", s, k)]
                    if s < num_stages - 1:
                        deps.append(("I", s + 1, k))  # a full backward also counts as "I"
                else:
                    deps = [("I", s, k)]
                if any(d not in done for d in deps):
                    break
                start = max([clock[r], *(done[d] for d in deps)])
                clock[r] = start + cost[kind]
                busy[r] += cost[kind]
                done[(kind, s, k)] = clock[r]
                if kind == "B":
                    done[("I", s, k)] = clock[r]
                pos[r] += 1
                left -= 1
                moved = True
        if not moved:
            raise RuntimeError(f"schedule {schedule!r} replay made no progress")
    span = max(clock)
    return 1.0 - max(busy) / span
