"""Started collectives: one :class:`Work` per collective in flight, and the pending registry.

Notation: P ranks on a 1-D mesh (or process group). The three dim-0 transports used by this
package — all-to-all, all-gather, reduce-scatter (sum) — are started asynchronously here and
finished by ``Work.wait()``, exactly once. Every started collective is listed in the pending
registry until it is waited, tagged with the owner that started it (``"user"`` for handles
given to callers, :data:`BLOCK_OWNER` for those started inside a context-parallel block).

The tensor all-gather and reduce-scatter are always hp-dtensor's ``all_gather_single`` /
``reduce_scatter_single``: there is no per-rank fallback, so every rank issues the same
collective.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from hyper_parallel.context_parallel import recorder as _rec
from hyper_parallel.dtensor import (
    DeviceMesh,
    all_gather_single,
    check_rank_order,
    reduce_scatter_single,
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
_PENDING: dict[int, tuple[str, str]] = {}  # id -> (owner, description)
_IDS = itertools.count(1)


def pending_collectives() -> list[str]:
    """Descriptions of the collectives launched by this package and not waited yet."""
    return [desc for _, desc in _PENDING.values()]


def leaked_by(owner: str) -> list[str]:
    """Forget and return (sorted) the collectives of ``owner`` that are still pending."""
    ids = [i for i, (o, _) in _PENDING.items() if o == owner]
    return sorted(_PENDING.pop(i)[1] for i in ids)


def raise_if_pending(where: str, owner: str) -> None:
    """Report (and forget) collectives launched by ``owner`` and never waited: the owner
    waits everything it launches, so any left over were leaked (an exception between launch
    and wait, or a pruned backward node). Collectives of other owners may legitimately be in
    flight and are left alone."""
    leaked = leaked_by(owner)
    if leaked:
        raise RuntimeError(leak_message(where, leaked))


def leak_message(where: str, leaked: list[str]) -> str:
    return (
        f"{where}: {len(leaked)} collective(s) were launched and never waited: {leaked}. "
        "Every handle must be waited exactly once; a backward collective stays pending "
        "when a partial torch.autograd.grad pruned its paired wait node (unsupported: "
        "differentiate the whole block, e.g. w.r.t. its input and parameters)."
    )


@dataclass(frozen=True)
class Group:
    """A resolved 1-D process group: the group handle, its size P and this rank's index."""

    pg: Any
    size: int
    rank: int


def resolve_group(mesh: Any) -> Group:
    """A 1-D DeviceMesh (rank order checked against its group) or a ProcessGroup."""
    if isinstance(mesh, DeviceMesh):
        if mesh.ndim != 1:
            raise ValueError(
                f"context parallelism needs a 1-D mesh, got a {mesh.ndim}-D mesh "
                f"{mesh.mesh_dim_names}; slice or flatten it to its CP dim first"
            )
        check_rank_order(mesh)
        pg = mesh.get_group(0)
    elif isinstance(mesh, dist.ProcessGroup):
        pg = mesh
    else:
        raise TypeError(f"expected a 1-D DeviceMesh or a ProcessGroup, got {type(mesh).__name__}")
    return Group(pg, dist.get_world_size(pg), dist.get_rank(pg))


class Work:
    """A started collective: ``wait()`` blocks and returns the finished tensor, once."""

    __slots__ = ("_done", "_finish", "_id", "_op_id", "_work", "name", "phase")

    def __init__(
        self,
        work: Any,
        finish: Callable[[], Tensor],
        name: str,
        phase: str,
        nbytes: int,
        owner: str,
    ) -> None:
        self._work = work
        self._finish = finish
        self.name = name
        self.phase = phase
        self._done = False
        self._id = next(_IDS)
        self._op_id = -1
        _PENDING[self._id] = (owner, f"{name} ({phase})")
        rec = _rec._ACTIVE
        if rec is not None:
            self._op_id = rec.new_op_id()
            rec.add("launch", name, phase, self._op_id, nbytes)

    def wait(self) -> Tensor:
        if self._done:
            raise RuntimeError(f"collective {self.name} ({self.phase}) was already waited")
        self._done = True
        rec = _rec._ACTIVE
        if rec is not None:
            rec.add("wait_begin", self.name, self.phase, self._op_id)
        if self._work is not None:
            self._work.wait()
        out = self._finish()
        _PENDING.pop(self._id, None)
        if rec is not None:
            rec.add("wait", self.name, self.phase, self._op_id)
        return out


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def start_all_to_all(
    x: Tensor, split_dim: int, cat_dim: int, g: Group, name: str, phase: str, owner: str
) -> Work:
    """Chunk ``x`` along ``split_dim`` (chunk j to rank j); the result concatenates the
    received chunks along ``cat_dim`` in rank order."""
    if g.size == 1:
        return Work(None, x.clone, name, phase, 0, owner)
    send = torch.stack(x.chunk(g.size, split_dim)).contiguous()
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, group=g.pg, async_op=True)
    # recv[j] is rank j's block of my split chunk: concatenating along cat_dim restores order
    nbytes = _nbytes(recv) * (g.size - 1) // g.size
    return Work(work, lambda: torch.cat(recv.unbind(0), dim=cat_dim), name, phase, nbytes, owner)


def start_all_gather(x: Tensor, dim: int, g: Group, name: str, phase: str, owner: str) -> Work:
    """``[.., n, ..] -> [.., P·n, ..]`` along ``dim`` (rank blocks in rank order)."""
    if g.size == 1:
        return Work(None, x.clone, name, phase, 0, owner)
    send = x.movedim(dim, 0).contiguous()
    out = send.new_empty((g.size * send.shape[0], *send.shape[1:]))
    work = all_gather_single(out, send, group=g.pg, async_op=True)
    nbytes = _nbytes(send) * (g.size - 1)
    return Work(work, lambda: out.movedim(0, dim), name, phase, nbytes, owner)


def start_reduce_scatter(x: Tensor, dim: int, g: Group, name: str, phase: str, owner: str) -> Work:
    """``[.., P·n, ..] -> [.., n, ..]``: the sum over ranks, this rank's block along ``dim``."""
    if g.size == 1:
        return Work(None, x.clone, name, phase, 0, owner)
    send = x.movedim(dim, 0).contiguous()
    out = send.new_empty((send.shape[0] // g.size, *send.shape[1:]))
    work = reduce_scatter_single(out, send, group=g.pg, async_op=True, op=dist.ReduceOp.SUM)
    nbytes = _nbytes(send) * (g.size - 1) // g.size
    return Work(work, lambda: out.movedim(0, dim), name, phase, nbytes, owner)
