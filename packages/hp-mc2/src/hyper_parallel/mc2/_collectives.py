"""Async dim-0 all-gather / reduce-scatter on any process group, returning work handles.

Both start through hp-dtensor's communication runtime (``comm``), into the caller's buffer:
recorded by hp-dtensor's ``record_events``, named in a ``torch.profiler`` trace, counted by the
one byte rule, with comm's empty-tensor and one-rank shortcuts (the same on every rank of a
group, so every rank runs the same collectives).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hyper_parallel.dtensor import comm
from hyper_parallel.dtensor.cache import WorldCache

OWNER = "mc2"  # the owner tag of this package's collectives
_GROUPS: WorldCache[int, comm.Group] = WorldCache()


def _group(group: Any) -> comm.Group:
    pg = group if group is not None else dist.group.WORLD
    cached = _GROUPS.get(id(pg))
    if cached is None or cached.pg is not pg:
        cached = _GROUPS[id(pg)] = comm.resolve_group(pg, "hp-mc2")
    return cached


def _phase() -> str:
    """``"backward"`` inside an autograd backward pass (torch >= 2.7.1 always has the task id)."""
    return "backward" if torch._C._current_graph_task_id() != -1 else "forward"


def all_gather_async(
    out: torch.Tensor, inp: torch.Tensor, group: Any, name: str = "all_gather:x"
) -> Any:
    """Start ``out = cat([inp of rank r for r in group], dim=0)``; ``out`` must be contiguous."""
    rows = out.view(-1, *inp.shape[1:])
    return comm.start_all_gather(inp, 0, _group(group), name, _phase(), OWNER, out=rows)


def reduce_scatter_async(
    out: torch.Tensor, inp: torch.Tensor, group: Any, name: str = "reduce_scatter:partial"
) -> Any:
    """Start ``out = (Σ_ranks inp)[rank·len(out) : (rank+1)·len(out)]`` along dim 0."""
    return comm.start_reduce_scatter(inp, 0, _group(group), name, _phase(), OWNER, out=out)
