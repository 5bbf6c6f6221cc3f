"""Process-group cache: one torch process group per distinct (rank set, backend).

torch 2.13 creates fresh groups on every ``DeviceMesh._unflatten``; long-running jobs that
build meshes repeatedly leak communicators. Here every group is created once, and a rank set
seen before (from a mesh of ours or from a torch mesh we were given) is reused.

Symmetry is what keeps this deadlock-free: ``torch.distributed.new_group`` must be called by
every process, for every group, in the same order. Every function that touches the cache
does so with arguments that are identical on all ranks (the rank sets of a whole dim, sibling
partitions included), so all ranks create exactly the same groups in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch.distributed import ProcessGroup

from hyper_parallel.dtensor.cache import WorldCache

__all__ = ["group_for", "groups_created", "register_groups"]

_Key = tuple[tuple[int, ...], str | None]
# value: the group if this process is a member, else None (created, but not ours); after
# destroy_process_group and a new init_process_group, groups of the old world are never
# handed out (the cache is world-scoped)
_CACHE: WorldCache[_Key, ProcessGroup | None] = WorldCache()
_CREATED = 0


def _key(ranks: Sequence[int], backend: str | None) -> _Key:
    return (tuple(sorted(int(r) for r in ranks)), backend)


def groups_created() -> int:
    """How many process groups this cache has created in this process."""
    return _CREATED


def register_groups(
    rank_sets: Sequence[Sequence[int]], own: ProcessGroup, backend: str | None = None
) -> None:
    """Record that the groups of ``rank_sets`` already exist and that ``own`` is this process's
    one among them. Call with the same ``rank_sets`` on every rank."""
    me = dist.get_rank()
    for ranks in rank_sets:
        key = _key(ranks, backend)
        if key not in _CACHE:
            _CACHE[key] = own if me in ranks else None


def group_for(rank_sets: Sequence[Sequence[int]], backend: str | None = None) -> ProcessGroup:
    """Return this process's group among ``rank_sets`` (a partition of the ranks), creating
    the missing ones in order. Must be called with the same ``rank_sets`` on every rank."""
    global _CREATED
    me = dist.get_rank()
    world = dist.get_world_size()
    mine: ProcessGroup | None = None
    for ranks in rank_sets:
        key = _key(ranks, backend)
        if key not in _CACHE:
            if key[0] == tuple(range(world)) and backend is None:
                group: ProcessGroup | None = dist.group.WORLD
            else:
                group = dist.new_group(ranks=list(key[0]), backend=backend)
                _CREATED += 1
            _CACHE[key] = group if me in ranks else None
        if me in ranks:
            mine = _CACHE[key]
    if mine is None:
        raise ValueError(f"rank {me} is in none of the rank sets {list(rank_sets)}")
    return mine
