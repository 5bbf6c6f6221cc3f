"""Pure layout algebra of device meshes: no processes, no torch.

A mesh is described relative to its *root* mesh. The root's global ranks, read row-major,
form the ``rank_map`` (slot ``i`` of the root holds global rank ``rank_map[i]``). Every mesh
derived from that root (by slicing, flattening or unflattening) is a :class:`Layout`: for each
of its dims ``d`` a tuple ``offsets[d]`` of slot offsets, one per coordinate along the dim
(``offsets[d][0] == 0``). A mesh *instance* is one translate of the layout: the slots
``base + Σ_d offsets[d][c_d]``. The layout tiles the root: its instances partition the root's
slots, and each process belongs to exactly one instance (its mesh) and, for every dim, to
exactly one of that dim's rank sets. The rank sets of a dim across *all* instances are the
groups a new dim needs: the sibling partitions included.

Example: root ``(cp=4, dp=2)`` over ranks 0..7 (cp outer)::

    >>> root = Layout.root((4, 2))
    >>> cp = root.slice([0])                     # offsets ((0, 2, 4, 6),)
    >>> cp.instance_ranks(0)
    [0, 2, 4, 6]
    >>> sub = cp.unflatten(0, (2, 2))            # offsets ((0, 4), (0, 2))
    >>> sub.dim_groups(1)
    [(0, 2), (4, 6), (1, 3), (5, 7)]
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Layout", "LayoutError"]


class LayoutError(ValueError):
    """A layout operation that has no valid result (the message says why)."""


def _row_major_offsets(shape: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    return tuple(tuple(i * s for i in range(n)) for n, s in zip(shape, strides))


@dataclass(frozen=True)
class Layout:
    """Dims of a mesh as slot offsets over a root rank map (see the module docstring)."""

    offsets: tuple[tuple[int, ...], ...]
    rank_map: tuple[int, ...]

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def root(cls, shape: Sequence[int], rank_map: Sequence[int] | None = None) -> Layout:
        """The root layout of ``shape``; ``rank_map`` defaults to ``range(prod(shape))``."""
        shape = tuple(int(s) for s in shape)
        if not shape or any(s < 1 for s in shape):
            raise LayoutError(f"mesh shape must be non-empty with positive sizes, got {shape}")
        n = math.prod(shape)
        ranks = tuple(range(n)) if rank_map is None else tuple(int(r) for r in rank_map)
        if len(ranks) != n or len(set(ranks)) != n:
            raise LayoutError(f"rank map {ranks} must hold {n} distinct ranks for shape {shape}")
        return cls(_row_major_offsets(shape), ranks)

    @classmethod
    def of_instance(cls, root_ranks: Sequence[int], mesh_ranks: Any) -> Layout:
        """Recover the layout of a mesh from its rank tensor (nested lists, row-major) and its
        root's flattened ranks. Raises :class:`LayoutError` if the mesh is not a layout
        over that root (a rank outside the root, or offsets that are not additive)."""
        root_ranks = tuple(int(r) for r in root_ranks)
        slot = {r: i for i, r in enumerate(root_ranks)}
        shape: list[int] = []
        level = mesh_ranks
        while isinstance(level, list | tuple):
            shape.append(len(level))
            level = level[0]
        flat = list(_flatten_nested(mesh_ranks))
        if any(r not in slot for r in flat):
            raise LayoutError(f"mesh ranks {flat} are not all in the root mesh {root_ranks}")
        strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
        base = slot[flat[0]]
        offsets = tuple(
            tuple(slot[flat[i * strides[d]]] - base for i in range(shape[d]))
            for d in range(len(shape))
        )
        layout = cls(offsets, root_ranks)
        if layout.instance_slots(base) != [slot[r] for r in flat]:
            raise LayoutError(f"mesh {mesh_ranks} is not a regular layout over root {root_ranks}")
        return layout

    # ---- properties ---------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(len(o) for o in self.offsets)

    @property
    def ndim(self) -> int:
        return len(self.offsets)

    def numel(self) -> int:
        return math.prod(self.shape)

    def flat_offsets(self) -> tuple[int, ...]:
        """Offsets of every coordinate, row-major."""
        return tuple(sum(c) for c in itertools.product(*self.offsets))

    # ---- instances and groups -----------------------------------------------------------
    def _tiles(self, offsets: Sequence[int]) -> list[int]:
        """Bases of the translates of ``offsets`` that partition the root's slots, in order
        of their first slot. Raises if ``offsets`` does not tile the root."""
        n = len(self.rank_map)
        taken = [False] * n
        bases = []
        for base in range(n):
            if taken[base]:
                continue
            for o in offsets:
                s = base + o
                if s >= n or taken[s]:
                    raise LayoutError(f"offsets {tuple(offsets)} do not tile a root of {n} ranks")
                taken[s] = True
            bases.append(base)
        return bases

    def instance_bases(self) -> list[int]:
        """First slot of every instance of this layout, in order."""
        return self._tiles(self.flat_offsets())

    def instance_slots(self, base: int) -> list[int]:
        return [base + o for o in self.flat_offsets()]

    def base_of(self, global_rank: int) -> int:
        """Base slot of the instance that contains ``global_rank``."""
        slot = self.rank_map.index(global_rank)
        flat = set(self.flat_offsets())
        for base in self.instance_bases():
            if slot - base in flat:
                return base
        raise LayoutError(f"rank {global_rank} is in no instance of {self}")  # pragma: no cover

    def instance_ranks(self, global_rank: int) -> Any:
        """Global ranks of the instance holding ``global_rank`` as nested lists (mesh shape)."""
        base = self.base_of(global_rank)
        flat = [self.rank_map[s] for s in self.instance_slots(base)]
        return _nest(flat, self.shape)

    def dim_groups(self, dim: int) -> list[tuple[int, ...]]:
        """Global rank sets of ``dim`` across every instance (siblings included), each in
        coordinate order, listed instance by instance in row-major order of the other dims.
        Every process computes the same list in the same order."""
        self._check_dim(dim)
        others = [o for d, o in enumerate(self.offsets) if d != dim]
        groups = []
        for base in self.instance_bases():
            for rest in itertools.product(*others):
                start = base + sum(rest)
                groups.append(tuple(self.rank_map[start + o] for o in self.offsets[dim]))
        return groups

    def group_of(self, dim: int, global_rank: int) -> tuple[int, ...]:
        """The rank set of ``dim`` that holds ``global_rank``."""
        for g in self.dim_groups(dim):
            if global_rank in g:
                return g
        raise LayoutError(f"rank {global_rank} is not in this layout")  # pragma: no cover

    # ---- algebra ------------------------------------------------------------------------
    def slice(self, dims: Sequence[int]) -> Layout:
        """The layout of the submesh over ``dims`` (in the order given)."""
        dims = list(dims)
        for d in dims:
            self._check_dim(d)
        if len(set(dims)) != len(dims) or not dims:
            raise LayoutError(f"slice needs distinct dims, got {dims}")
        return Layout(tuple(self.offsets[d] for d in dims), self.rank_map)

    def flatten(self, dims: Sequence[int] | None = None) -> Layout:
        """Merge ``dims`` (default all, row-major) into one dim placed where the first was."""
        dims = list(range(self.ndim)) if dims is None else list(dims)
        sub = self.slice(dims)
        merged = sub.flat_offsets()
        rest = [o for d, o in enumerate(self.offsets) if d not in dims]
        rest.insert(min(dims), merged)
        return Layout(tuple(rest), self.rank_map)

    def unflatten(self, dim: int, sizes: Sequence[int]) -> Layout:
        """Replace ``dim`` by ``len(sizes)`` dims of those sizes, row-major (last fastest)."""
        self._check_dim(dim)
        sizes = tuple(int(s) for s in sizes)
        old = self.offsets[dim]
        if not sizes or any(s < 1 for s in sizes):
            raise LayoutError(f"unflatten sizes must be positive, got {sizes}")
        if math.prod(sizes) != len(old):
            raise LayoutError(
                f"unflatten sizes {sizes} multiply to {math.prod(sizes)}, "
                f"but dim {dim} has size {len(old)}"
            )
        inner = [math.prod(sizes[j + 1 :]) for j in range(len(sizes))]
        new = [tuple(old[i * inner[j]] for i in range(s)) for j, s in enumerate(sizes)]
        for flat, coord in enumerate(itertools.product(*(range(s) for s in sizes))):
            if old[flat] != sum(new[j][c] for j, c in enumerate(coord)):
                raise LayoutError(
                    f"dim {dim} with slot offsets {old} cannot be split into {sizes}: "
                    "the split does not align with how the dim was built"
                )
        offsets = self.offsets[:dim] + tuple(new) + self.offsets[dim + 1 :]
        return Layout(offsets, self.rank_map)

    def _check_dim(self, dim: int) -> None:
        if not isinstance(dim, int) or isinstance(dim, bool) or not 0 <= dim < self.ndim:
            raise LayoutError(f"dim {dim!r} out of range for a {self.ndim}-D layout")


def _flatten_nested(x: Any) -> Any:
    if isinstance(x, list | tuple):
        for item in x:
            yield from _flatten_nested(item)
    else:
        yield int(x)


def _nest(flat: list[int], shape: Sequence[int]) -> Any:
    if len(shape) == 1:
        return list(flat)
    step = math.prod(shape[1:])
    return [_nest(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]
