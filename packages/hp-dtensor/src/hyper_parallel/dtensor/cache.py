"""World-scoped caches: a mapping that belongs to one default process group.

Groups, meshes and executors built from them are only valid in the world (the default process
group) they were created in: after ``destroy_process_group`` and a new ``init_process_group``,
an object of the old world must never be handed out, even when its key (rank sets, mesh shape,
a structurally equal ``DeviceMesh``) compares equal. :class:`WorldCache` is the one rule every
such cache in the layers follows: it empties itself the first time it is touched in a new
world. Keys are the caller's; the values are held strongly until the world changes.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import torch.distributed as dist

__all__ = ["WorldCache"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class WorldCache(Generic[K, V]):
    """A dict scoped to the current ``torch.distributed`` world (``dist.group.WORLD``)."""

    __slots__ = ("_data", "_world")

    def __init__(self) -> None:
        self._data: dict[K, V] = {}
        self._world: object = None

    def _current(self) -> dict[K, V]:
        world = dist.group.WORLD
        if self._world is not world:
            self._data.clear()
            self._world = world
        return self._data

    def get(self, key: K, default: V | None = None) -> V | None:
        return self._current().get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._current()

    def __getitem__(self, key: K) -> V:
        return self._current()[key]

    def __setitem__(self, key: K, value: V) -> None:
        self._current()[key] = value

    def __len__(self) -> int:
        return len(self._current())

    def get_or_create(self, key: K, create: Callable[[], V]) -> V:
        """The value under ``key`` in this world, created by ``create()`` the first time."""
        data = self._current()
        if key not in data:
            data[key] = create()
        return data[key]

    def clear(self) -> None:
        self._data.clear()
