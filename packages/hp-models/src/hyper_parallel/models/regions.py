"""Which region of a parameter's whole tensor a rank holds, and gathering a parameter over some
of its mesh dims only.

A parameter of a parallelised model is a plain tensor (whole on every rank, or this rank's
experts at ``ep > 1`` with the all-reduce), or a DTensor whose placements are ``Shard``,
``Replicate`` or FSDP2's ``_StridedShard`` over its mesh. With torch's chunk rule (chunk
``⌈n/k⌉``, the last ones shorter or empty) every rank's local tensor is one box of the whole
tensor: ``global[offset : offset + shape]``. :func:`box_of` computes it for any coordinate,
collective-free, the same on every torch (torch's own ``compute_local_shape_and_global_offset``
changed its ``_StridedShard`` rule between releases).

Order of the splits on one tensor dim: plain ``Shard`` s in mesh-dim order, then the
``_StridedShard`` s (FSDP2 marks its shard of a dim that tensor or expert parallelism already
split with ``_StridedShard(sf=k)``: FSDP's split is applied inside the other's chunk).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hyper_parallel.dtensor import comm

__all__ = ["Box", "box_of", "gather_over", "local_box", "mesh_device"]


@dataclass(frozen=True)
class Box:
    """``global[offset[d] : offset[d] + shape[d]]`` for every dim ``d``."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def _dtensor_cls() -> Any:
    from torch.distributed.tensor import DTensor

    return DTensor


def _is_strided(placement: Any) -> bool:
    return type(placement).__name__ == "_StridedShard"


def _shard_dim(placement: Any) -> int | None:
    dim = getattr(placement, "dim", None)
    is_shard = type(placement).__name__ in ("Shard", "_StridedShard") or placement.is_shard()
    return dim if isinstance(dim, int) and is_shard else None


def _split_order(placements: Sequence[Any], skip: frozenset[int]) -> list[int]:
    """Mesh dims that split the tensor, in the order their splits apply."""
    plain = [
        i for i, p in enumerate(placements) if _shard_dim(p) is not None and not _is_strided(p)
    ]
    strided = [i for i, p in enumerate(placements) if _shard_dim(p) is not None and _is_strided(p)]
    return [i for i in plain + strided if i not in skip]


def box_of(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    coord: Sequence[int],
    placements: Sequence[Any],
    skip: frozenset[int] = frozenset(),
) -> Box:
    """The box of a tensor of global ``shape`` held at mesh coordinate ``coord`` under
    ``placements``; mesh dims in ``skip`` count as ``Replicate`` (what the rank holds after
    gathering over them)."""
    offset = [0] * len(shape)
    extent = list(shape)
    for i in _split_order(placements, skip):
        d = _shard_dim(placements[i])
        assert d is not None
        k, c, n = mesh_shape[i], coord[i], extent[d]
        chunk = -(-n // k) if n else 0
        start = min(c * chunk, n)
        offset[d] += start
        extent[d] = min(chunk, n - start)
    return Box(tuple(offset), tuple(extent))


def local_box(t: Tensor) -> Box:
    """The box of ``t``'s whole tensor this rank holds: all of it for a plain tensor."""
    if isinstance(t, _dtensor_cls()):
        coord = t.device_mesh.get_coordinate()
        if coord is None:
            raise RuntimeError("this rank is not on the parameter's mesh")
        box = box_of(tuple(t.shape), tuple(t.device_mesh.mesh.shape), coord, t.placements)
        if tuple(t.to_local().shape) != box.shape:
            raise RuntimeError(
                f"a DTensor of shape {tuple(t.shape)} with placements {t.placements} holds "
                f"{tuple(t.to_local().shape)} here, not the expected {box.shape}"
            )
        return box
    return Box((0,) * t.dim(), tuple(t.shape))


def gather_over(t: Tensor, keep: Sequence[str], name: str, owner: str) -> tuple[Tensor, Box]:
    """``t``'s region after gathering over every mesh dim not named in ``keep`` (the dims'
    all-gathers run innermost split first, so every intermediate holding is a box):
    ``(data, box)``, on every rank of the mesh. A plain tensor is returned as it is."""
    if not isinstance(t, _dtensor_cls()):
        return t.detach(), local_box(t)
    mesh = t.device_mesh
    names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
    kept = frozenset(i for i, n in enumerate(names) if n in keep)
    order = _split_order(t.placements, kept)
    coord = mesh.get_coordinate()
    assert coord is not None
    data = t.to_local().detach()
    gathered: set[int] = set()
    shape, mshape = tuple(t.shape), tuple(mesh.mesh.shape)
    for i in reversed(order):
        # the dim's group, not mesh[name]: torch 2.7 cannot slice a sliced mesh (HSDP)
        g = comm.resolve_group(mesh.get_group(i), "gathering a parameter")
        peers = []
        for j in range(mshape[i]):
            c = list(coord)
            c[i] = j
            peers.append(box_of(shape, mshape, c, t.placements, frozenset(gathered)))
        gathered.add(i)
        mine = box_of(shape, mshape, coord, t.placements, frozenset(gathered))
        if _tiles_dim0(peers, mine) and data.is_contiguous():
            # equal chunks in rank order along dim 0: gather straight into the result (one
            # whole tensor alive, not three)
            out = data.new_empty(mine.shape)
            comm.start_all_gather(data, 0, g, f"all_gather:{name}", "save", owner, out=out).wait()
            data = out
            continue
        top = tuple(max(b.shape[d] for b in peers) for d in range(len(shape)))
        padded = data.new_zeros(top)
        padded[tuple(slice(0, n) for n in data.shape)] = data
        del data  # its rows are in padded
        parts = comm.start_all_gather(
            padded.unsqueeze(0), 0, g, f"all_gather:{name}", "save", owner
        ).wait()
        del padded
        out = parts.new_empty(mine.shape)
        for j, b in enumerate(peers):
            dst = tuple(slice(o - m, o - m + n) for o, m, n in zip(b.offset, mine.offset, b.shape))
            out[dst] = parts[j][tuple(slice(0, n) for n in b.shape)]
        del parts
        data = out
    return data, box_of(shape, mshape, coord, t.placements, frozenset(gathered))


def _tiles_dim0(peers: list[Box], whole: Box) -> bool:
    """The peers' boxes are equal, in order along dim 0, and together exactly ``whole``."""
    first = peers[0]
    rows = first.shape[0] if first.shape else 0
    return (
        bool(first.shape)
        and all(
            b.shape == first.shape
            and b.offset[0] == whole.offset[0] + j * rows
            and b.offset[1:] == whole.offset[1:]
            for j, b in enumerate(peers)
        )
        and rows * len(peers) == whole.shape[0]
        and first.shape[1:] == whole.shape[1:]
    )


def mesh_device(mesh: Any) -> torch.device:
    """The device a mesh's collectives run on: the current one of its type."""
    kind = mesh.device_type
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, torch.get_device_module(kind).current_device())
