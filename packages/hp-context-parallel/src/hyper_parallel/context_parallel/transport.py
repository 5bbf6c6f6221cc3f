"""This package's use of hp-dtensor's communication runtime (:mod:`hyper_parallel.dtensor.comm`).

The collectives of this package — all-to-all, all-gather, reduce-scatter (sum), over dim 0 of
a stacked buffer — are started by ``comm.start_*`` and finished by ``Work.wait()``, exactly
once, so they are recorded, named in a ``torch.profiler`` trace and counted by the modeled
link like every other layer's. Every started collective is listed in comm's pending registry
until it is waited, tagged with the owner that started it (``"user"`` for handles given to
callers, :data:`BLOCK_OWNER` for those started inside a context-parallel block).
"""

from __future__ import annotations

from typing import Any

from hyper_parallel.dtensor import comm
from hyper_parallel.dtensor.comm import (
    Group,
    Work,
    leak_message,
    leaked_by,
    pending_collectives,
    raise_if_pending,
    start_all_gather,
    start_all_to_all,
    start_reduce_scatter,
)

__all__ = [
    "BLOCK_OWNER",
    "Group",
    "Work",
    "leak_message",
    "leaked_by",
    "pending_collectives",
    "raise_if_pending",
    "resolve_group",
    "start_all_gather",
    "start_all_to_all",
    "start_reduce_scatter",
]

BLOCK_OWNER = "parallel_mla"  # collectives started inside a context-parallel MLA block


def resolve_group(mesh: Any) -> Group:
    """A 1-D DeviceMesh (rank order checked against its group) or a ProcessGroup."""
    return comm.resolve_group(mesh, "context parallelism")
