"""The communication runtime every layer starts its collectives through.

One group resolver, one started-collective type and one byte rule, so that every layer's
collectives are recorded (:mod:`hyper_parallel.dtensor.recorder`), named in a user's own
``torch.profiler`` trace, counted the same way by the recorder and by the modeled link
(:mod:`hyper_parallel.dtensor.simlink`), and listed while pending.

Notation: P ranks in a 1-D group, this rank's index ``rank``.

- :func:`resolve_group`: a 1-D ``DeviceMesh`` (its rank order checked against its group's) or
  a ``ProcessGroup`` -> :class:`Group` (handle, P, rank, the global ranks in group order, the
  device type, the neighbours ``prev``/``next`` in a chain).
- ``start_*`` -> :class:`Work`: :func:`start_all_gather` (``[.., n, ..] -> [.., P·n, ..]``),
  :func:`start_reduce_scatter` (the sum, this rank's block), :func:`start_all_to_all`
  (chunk j of ``split_dim`` to rank j, received chunks concatenated along ``cat_dim``),
  :func:`start_all_to_all_v` (uneven rows: ``send_splits[j]`` leading rows to rank j,
  ``recv_splits[j]`` from rank j; every rank joins even with nothing to send or receive),
  :func:`start_all_reduce` (in place, sum), :func:`start_broadcast` (from a group rank, in
  place), :func:`start_send` / :func:`start_recv` (to / from a group rank, with a tag). A
  group of one rank, or an empty tensor, communicates nothing and returns a finished ``Work``.
- ``Work.wait()`` blocks and returns the finished tensor, exactly once. Every started
  ``Work`` is listed by :func:`pending_collectives` until waited, tagged with its ``owner``
  (a layer's name), so a layer can detect collectives it leaked (:func:`raise_if_pending`).
- :func:`link_bytes` (the byte rule): the bytes this rank moves over its link —
  ``(P−1)/P`` of the gathered, scattered or exchanged buffer (an uneven all-to-all: the rows
  it sends to other ranks, :func:`all_to_all_v_bytes`), ``2(P−1)/P`` of an all-reduced
  one, the whole tensor of a send or receive; 0 for one rank.
- Profiler: while a ``torch.profiler`` (or ``torch.autograd.profiler``) session records, each
  launch and each wait is a ``record_function`` range named ``hp.comm.launch <name>`` /
  ``hp.comm.wait <name>``; nothing is added otherwise.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from hyper_parallel.dtensor import recorder as _rec
from hyper_parallel.dtensor.collectives import all_gather_single, reduce_scatter_single
from hyper_parallel.dtensor.mesh import check_rank_order

__all__ = [
    "Group",
    "Work",
    "all_to_all_v_bytes",
    "leak_message",
    "leaked_by",
    "set_lane",
    "link_bytes",
    "pending_collectives",
    "raise_if_pending",
    "resolve_group",
    "start_all_gather",
    "start_all_reduce",
    "start_all_to_all",
    "start_all_to_all_v",
    "start_broadcast",
    "start_recv",
    "start_reduce_scatter",
    "start_send",
]

_PENDING: dict[int, tuple[str, str, int]] = {}  # id -> (owner, description, lane)
_LANE = 0  # which interleaved computation is running (0: none interleaved)
_IDS = itertools.count(1)


# ---- the byte rule ----------------------------------------------------------------------------
def link_bytes(op: str, buffer_bytes: int, size: int) -> int:
    """Bytes one rank moves over its link for collective ``op`` on a group of ``size`` ranks.

    ``buffer_bytes``: the gathered output (``"all_gather"``), the scattered input
    (``"reduce_scatter"``), the exchanged buffer (``"all_to_all"``), the reduced tensor
    (``"all_reduce"``), the tensor sent or received (``"send"``, ``"recv"``, ``"broadcast"``).
    """
    if size <= 1:
        return 0
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return buffer_bytes * (size - 1) // size
    if op == "all_reduce":
        return 2 * buffer_bytes * (size - 1) // size
    if op in ("send", "recv", "broadcast"):
        return buffer_bytes
    raise ValueError(f"link_bytes: unknown collective {op!r}")


def all_to_all_v_bytes(row_bytes: int, send_splits: list[int] | tuple[int, ...], rank: int) -> int:
    """Bytes an uneven all-to-all moves over this rank's link: the rows it sends to the other
    ranks (``send_splits[j]`` rows of ``row_bytes`` bytes to rank j; its own rows stay)."""
    if len(send_splits) <= 1:
        return 0
    return row_bytes * (sum(send_splits) - send_splits[rank])


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


# ---- groups -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Group:
    """A resolved 1-D process group: the handle ``pg``, its size P, this rank's index, the
    global ranks in group order and the device type of the mesh (``None`` for a bare group)."""

    pg: Any
    size: int
    rank: int
    ranks: tuple[int, ...] = ()
    device_type: str | None = None

    @property
    def prev(self) -> int | None:
        """The group rank before this one in a chain (``None`` on the first)."""
        return self.rank - 1 if self.rank > 0 else None

    @property
    def next(self) -> int | None:
        """The group rank after this one in a chain (``None`` on the last)."""
        return self.rank + 1 if self.rank + 1 < self.size else None


def resolve_group(mesh: Any, what: str = "this layer") -> Group:
    """A 1-D DeviceMesh (rank order checked against its group) or a ProcessGroup -> Group.

    ``ValueError`` for an n-D mesh or a mesh whose rank order differs from its group's,
    ``TypeError`` for anything else; ``what`` names the caller in the messages."""
    if isinstance(mesh, DeviceMesh):
        if mesh.ndim != 1:
            raise ValueError(
                f"{what} needs a 1-D mesh, got a {mesh.ndim}-D mesh {mesh.mesh_dim_names}; "
                "slice or flatten it to the one dim first"
            )
        check_rank_order(mesh)
        pg, device_type = mesh.get_group(0), str(mesh.device_type)
    elif isinstance(mesh, dist.ProcessGroup):
        pg, device_type = mesh, None
    else:
        raise TypeError(f"expected a 1-D DeviceMesh or a ProcessGroup, got {type(mesh).__name__}")
    size = dist.get_world_size(pg)
    ranks = tuple(dist.get_global_rank(pg, i) for i in range(size))
    return Group(pg, size, dist.get_rank(pg), ranks, device_type)


# ---- the pending registry ---------------------------------------------------------------------
def pending_collectives() -> list[str]:
    """Descriptions of the collectives started through this module and not waited yet."""
    return [desc for _, desc, _ in _PENDING.values()]


def set_lane(lane: int) -> int:
    """Mark which of several interleaved computations runs from now on (returns the previous
    mark; 0: none). A micro-batch runner that interleaves two computations at their in-flight
    points (``overlap.in_flight``) sets it on each switch, so that one computation's
    collectives in flight are not taken for the other's leaks (:func:`leaked_by` looks at the
    running lane only)."""
    global _LANE
    previous, _LANE = _LANE, lane
    return previous


def leaked_by(owner: str) -> list[str]:
    """Forget and return (sorted) the collectives of ``owner`` that are still pending, among
    those started by the running lane (:func:`set_lane`)."""
    ids = [i for i, (o, _, lane) in _PENDING.items() if o == owner and lane == _LANE]
    return sorted(_PENDING.pop(i)[1] for i in ids)


def raise_if_pending(where: str, owner: str) -> None:
    """``RuntimeError`` naming the collectives ``owner`` started and never waited (and forget
    them): an owner that waits everything it starts has leaked any left over. Collectives of
    other owners may be in flight and are left alone."""
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


# ---- started collectives ----------------------------------------------------------------------
def _profiling() -> bool:
    return torch.autograd._profiler_enabled()


class Work:
    """A started collective: ``wait()`` blocks and returns the finished tensor, exactly once.

    ``work``: the c10d handle (``None`` when nothing was sent); ``finish``: builds the result
    once the handle is done; ``nbytes``: :func:`link_bytes` of the collective."""

    __slots__ = ("_done", "_finish", "_id", "_op_id", "_work", "name", "nbytes", "phase")

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
        self.name, self.phase, self.nbytes = name, phase, nbytes
        self._done = False
        self._id = next(_IDS)
        self._op_id = -1
        _PENDING[self._id] = (owner, f"{name} ({phase})", _LANE)
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
            if _profiling():
                with torch.profiler.record_function(f"hp.comm.wait {self.name}"):
                    self._work.wait()
            else:
                self._work.wait()
        out = self._finish()
        _PENDING.pop(self._id, None)
        if rec is not None:
            rec.add("wait", self.name, self.phase, self._op_id)
        return out


def _start(launch: Callable[[], Any], name: str) -> Any:
    if _profiling():
        with torch.profiler.record_function(f"hp.comm.launch {name}"):
            return launch()
    return launch()


def _done(x: Tensor, name: str, phase: str, owner: str) -> Work:
    return Work(None, x.clone, name, phase, 0, owner)


def start_all_to_all(
    x: Tensor, split_dim: int, cat_dim: int, g: Group, name: str, phase: str, owner: str
) -> Work:
    """Chunk ``x`` along ``split_dim`` (chunk j to rank j); the result concatenates the
    received chunks along ``cat_dim`` in rank order."""
    if g.size == 1 or x.numel() == 0:
        return _done(x, name, phase, owner)
    send = torch.stack(x.chunk(g.size, split_dim)).contiguous()
    recv = torch.empty_like(send)
    work = _start(lambda: dist.all_to_all_single(recv, send, group=g.pg, async_op=True), name)
    # recv[j] is rank j's block of my split chunk: concatenating along cat_dim restores order
    nbytes = link_bytes("all_to_all", _nbytes(recv), g.size)
    return Work(work, lambda: torch.cat(recv.unbind(0), dim=cat_dim), name, phase, nbytes, owner)


def start_all_to_all_v(
    x: Tensor,
    send_splits: list[int] | tuple[int, ...],
    recv_splits: list[int] | tuple[int, ...],
    g: Group,
    name: str,
    phase: str,
    owner: str,
) -> Work:
    """Uneven all-to-all of rows: ``x [sum(send_splits), ...]``, its first ``send_splits[0]``
    rows to group rank 0, the next ``send_splits[1]`` to rank 1, ...; the result
    ``[sum(recv_splits), ...]`` holds the rows of rank 0, then rank 1, ... (``recv_splits[j]``
    from rank j). The splits are host ints that must mirror each other over the group (rank
    i's ``send_splits[j]`` is rank j's ``recv_splits[i]``). Every rank joins the collective even
    when it sends and receives nothing: whether to skip an exchange must be decided from what
    every rank knows (e.g. all counts zero), never from this rank's rows alone."""
    if len(send_splits) != g.size or len(recv_splits) != g.size:
        raise ValueError(
            f"start_all_to_all_v: {len(send_splits)} send and {len(recv_splits)} receive splits "
            f"for a group of {g.size}"
        )
    if x.shape[0] != sum(send_splits):
        raise ValueError(f"start_all_to_all_v: {x.shape[0]} rows, splits sum to {sum(send_splits)}")
    if g.size == 1:
        return _done(x, name, phase, owner)
    send = x.contiguous()
    recv = send.new_empty((sum(recv_splits), *send.shape[1:]))
    send_l, recv_l = [int(n) for n in send_splits], [int(n) for n in recv_splits]
    work = _start(
        lambda: dist.all_to_all_single(recv, send, recv_l, send_l, group=g.pg, async_op=True),
        name,
    )
    row = math.prod(send.shape[1:]) * send.element_size()  # also with no rows to send
    nbytes = all_to_all_v_bytes(row, send_l, g.rank)
    # the finisher keeps the send buffer alive until the collective is waited
    return Work(work, lambda kept=send: recv, name, phase, nbytes, owner)  # type: ignore[misc]


def start_all_gather(
    x: Tensor,
    dim: int,
    g: Group,
    name: str,
    phase: str,
    owner: str,
    *,
    out: Tensor | None = None,
) -> Work:
    """``[.., n, ..] -> [.., P·n, ..]`` along ``dim`` (rank blocks in rank order). ``out``:
    optionally the contiguous ``[P·n, ..]`` buffer to gather into (``dim`` 0 only)."""
    if out is not None and (dim != 0 or not out.is_contiguous()):
        raise ValueError("start_all_gather: out= needs dim 0 and a contiguous buffer")
    if g.size == 1 or x.numel() == 0:
        if out is not None:
            if x.numel():
                out.view_as(x).copy_(x)
            return Work(None, lambda: out, name, phase, 0, owner)
        if g.size > 1:  # every rank's block is empty too (the shapes agree): P·0 rows
            shape = list(x.shape)
            shape[dim] *= g.size
            return Work(None, lambda: x.new_empty(shape), name, phase, 0, owner)
        return _done(x, name, phase, owner)
    send = x.movedim(dim, 0).contiguous()
    if out is None:
        buf = send.new_empty((g.size * send.shape[0], *send.shape[1:]))
    else:
        buf = out.view(g.size * send.shape[0], *send.shape[1:])
    work = _start(lambda: all_gather_single(buf, send, group=g.pg, async_op=True), name)
    nbytes = link_bytes("all_gather", _nbytes(buf), g.size)
    if out is not None:
        return Work(work, lambda: out, name, phase, nbytes, owner)
    return Work(work, lambda: buf.movedim(0, dim), name, phase, nbytes, owner)


def start_reduce_scatter(
    x: Tensor,
    dim: int,
    g: Group,
    name: str,
    phase: str,
    owner: str,
    *,
    out: Tensor | None = None,
) -> Work:
    """``[.., P·n, ..] -> [.., n, ..]``: the sum over ranks, this rank's block along ``dim``.
    ``out``: optionally the ``[n, ..]`` buffer to reduce into (``dim`` 0 only)."""
    if out is not None and dim != 0:
        raise ValueError("start_reduce_scatter: out= needs dim 0")
    if g.size == 1 or x.numel() == 0:
        if out is not None:
            if out.numel():
                out.copy_(x.reshape(out.shape))
            return Work(None, lambda: out, name, phase, 0, owner)
        if g.size > 1:
            shape = list(x.shape)
            shape[dim] //= g.size
            return Work(None, lambda: x.new_empty(shape), name, phase, 0, owner)
        return _done(x, name, phase, owner)
    send = x.movedim(dim, 0).contiguous()
    if out is None:
        buf = send.new_empty((send.shape[0] // g.size, *send.shape[1:]))
    else:
        buf = out
        send = send.view(-1, *out.shape[1:])
    work = _start(
        lambda: reduce_scatter_single(buf, send, group=g.pg, async_op=True, op=dist.ReduceOp.SUM),
        name,
    )
    nbytes = link_bytes("reduce_scatter", _nbytes(send), g.size)
    if out is not None:  # the send buffer stays alive until the collective is waited
        return Work(work, lambda kept=send: out, name, phase, nbytes, owner)  # type: ignore[misc]
    return Work(work, lambda: buf.movedim(0, dim), name, phase, nbytes, owner)


def start_all_reduce(x: Tensor, g: Group, name: str, phase: str, owner: str) -> Work:
    """The sum of ``x`` over the group, in place (``x`` must not be read before the wait);
    ``wait()`` returns ``x``."""
    if g.size == 1 or x.numel() == 0:
        return Work(None, lambda: x, name, phase, 0, owner)
    work = _start(lambda: dist.all_reduce(x, group=g.pg, async_op=True), name)
    nbytes = link_bytes("all_reduce", _nbytes(x), g.size)
    return Work(work, lambda: x, name, phase, nbytes, owner)


def start_send(
    x: Tensor, dst: int, g: Group, name: str, phase: str, owner: str, *, tag: int = 0
) -> Work:
    """Send ``x`` to group rank ``dst``; ``wait()`` returns ``x`` once it may be reused."""
    send = x.contiguous()
    peer = g.ranks[dst] if g.ranks else dist.get_global_rank(g.pg, dst)
    work = _start(lambda: dist.isend(send, peer, group=g.pg, tag=tag), name)
    nbytes = link_bytes("send", _nbytes(send), g.size)
    # the finisher holds the send buffer, so it stays alive until the send is waited
    return Work(work, lambda kept=send: x, name, phase, nbytes, owner)  # type: ignore[misc]


def start_recv(
    out: Tensor, src: int, g: Group, name: str, phase: str, owner: str, *, tag: int = 0
) -> Work:
    """Receive into the contiguous ``out`` from group rank ``src``; ``wait()`` returns it."""
    peer = g.ranks[src] if g.ranks else dist.get_global_rank(g.pg, src)
    work = _start(lambda: dist.irecv(out, peer, group=g.pg, tag=tag), name)
    return Work(work, lambda: out, name, phase, link_bytes("recv", _nbytes(out), g.size), owner)


def start_broadcast(x: Tensor, src: int, g: Group, name: str, phase: str, owner: str) -> Work:
    """``x`` of group rank ``src`` into ``x`` on every rank (in place); ``wait()`` returns it."""
    if g.size == 1 or x.numel() == 0:
        return Work(None, lambda: x, name, phase, 0, owner)
    peer = g.ranks[src] if g.ranks else dist.get_global_rank(g.pg, src)
    work = _start(lambda: dist.broadcast(x, peer, group=g.pg, async_op=True), name)
    return Work(work, lambda: x, name, phase, link_bytes("broadcast", _nbytes(x), g.size), owner)
