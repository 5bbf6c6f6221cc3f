"""Ulysses all-to-alls and sequence all-gathers: blocking, and as async single-use handles.

Notation: P ranks on a 1-D mesh (or process group), rank r holds the contiguous sequence
block r of length S/P. ``seq_to_head``: ``[.., S/P, .., H, ..] -> [.., S, .., H/P, ..]`` (rank r
keeps heads ``[r·H/P, (r+1)·H/P)`` of every token); ``head_to_seq`` is its exact inverse.

Async launches are two autograd nodes sharing one channel: the *launch* node starts the
collective in forward and, in backward, waits for the gradient's collective; the *wait* node
waits in forward and, in backward, launches the gradient's collective (the inverse
all-to-all, or the reduce-scatter of an all-gather). Whatever autograd runs between the two
nodes in backward overlaps the gradient's communication.

Every collective launched here and not yet waited is listed by :func:`pending_collectives`;
the parallel MLA forward refuses to start while one launched by a parallel MLA block is
pending (an exception between its launch and wait, or a backward collective whose paired node
was pruned by a partial ``torch.autograd.grad``); user handles may stay in flight across it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd import Function

from hyper_parallel.context_parallel import recorder as _rec
from hyper_parallel.dtensor import DeviceMesh, check_rank_order

__all__ = [
    "CollectiveHandle",
    "launch_all_gather",
    "launch_head_to_seq",
    "launch_seq_to_head",
    "pending_collectives",
    "shard_sequence",
    "ulysses_head_to_seq",
    "ulysses_seq_to_head",
]

MeshLike = Any  # a 1-D DeviceMesh or a ProcessGroup

_PENDING: dict[int, tuple[str, str]] = {}  # id -> (owner, description)
_IDS = itertools.count(1)


def pending_collectives() -> list[str]:
    """Descriptions of the collectives launched by this package and not waited yet."""
    return [desc for _, desc in _PENDING.values()]


def _raise_if_pending(where: str, owner: str) -> None:
    """Report (and forget) collectives launched by ``owner`` and never waited: the owner
    waits everything it launches, so any left over were leaked (an exception between launch
    and wait, or a pruned backward node). Collectives of other owners may legitimately be in
    flight and are left alone."""
    ids = [i for i, (o, _) in _PENDING.items() if o == owner]
    if ids:
        leaked = sorted(_PENDING.pop(i)[1] for i in ids)
        raise RuntimeError(
            f"{where}: {len(leaked)} collective(s) were launched and never waited: {leaked}. "
            "Every handle must be waited exactly once; a backward collective stays pending "
            "when a partial torch.autograd.grad pruned its paired wait node (unsupported: "
            "differentiate the whole block, e.g. w.r.t. its input and parameters)."
        )


# ---- groups and validation ----------------------------------------------------------------
@dataclass(frozen=True)
class _Group:
    pg: Any
    size: int
    rank: int


def _resolve(mesh: MeshLike) -> _Group:
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
    return _Group(pg, dist.get_world_size(pg), dist.get_rank(pg))


def _norm_dim(dim: Any, ndim: int, what: str) -> int:
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise ValueError(f"{what} must be an int, got {dim!r}")
    if not -ndim <= dim < ndim:
        raise ValueError(f"{what}={dim} out of range for a {ndim}-D tensor")
    return dim % ndim


def _check_ulysses(
    x: Tensor, seq_dim: int, head_dim: int, size: int, split: str
) -> tuple[int, int]:
    if not isinstance(x, Tensor):
        raise TypeError(f"expected a Tensor, got {type(x).__name__}")
    seq_dim = _norm_dim(seq_dim, x.dim(), "seq_dim")
    head_dim = _norm_dim(head_dim, x.dim(), "head_dim")
    if seq_dim == head_dim:
        raise ValueError(f"seq_dim and head_dim must differ, both are {seq_dim}")
    d = head_dim if split == "head" else seq_dim
    if x.size(d) % size:
        what = "heads" if split == "head" else "sequence length"
        raise ValueError(f"{what} ({x.size(d)}, dim {d}) not divisible by the CP size {size}")
    return seq_dim, head_dim


# ---- one launched collective ------------------------------------------------------------
class _Work:
    """A launched collective: ``wait()`` blocks and returns the finished tensor, once."""

    __slots__ = ("_done", "_finish", "_id", "_op_id", "_work", "name", "phase")

    def set_owner(self, owner: str) -> _Work:
        if self._id in _PENDING:
            _PENDING[self._id] = (owner, _PENDING[self._id][1])
        return self

    def __init__(self, work: Any, finish: Callable[[], Tensor], name: str, phase: str, nbytes: int):
        self._work = work
        self._finish = finish
        self.name = name
        self.phase = phase
        self._done = False
        self._id = next(_IDS)
        self._op_id = -1
        _PENDING[self._id] = ("user", f"{name} ({phase})")
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


# torch >= 2.13 renames the tensor variants; the old names still work there but warn.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _start_a2a(x: Tensor, split_dim: int, cat_dim: int, g: _Group, name: str, phase: str) -> _Work:
    if g.size == 1:
        return _Work(None, x.clone, name, phase, 0)
    send = torch.stack(x.chunk(g.size, split_dim)).contiguous()
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, group=g.pg, async_op=True)
    # recv[j] is rank j's block of my split chunk: concatenating along cat_dim restores order
    return _Work(
        work,
        lambda: torch.cat(recv.unbind(0), dim=cat_dim),
        name,
        phase,
        _nbytes(recv) * (g.size - 1) // g.size,
    )


def _start_all_gather(
    x: Tensor, dim: int, g: _Group, name: str, phase: str, portable: bool = False
) -> _Work:
    if g.size == 1:
        return _Work(None, x.clone, name, phase, 0)
    send = x.movedim(dim, 0).contiguous()
    out = send.new_empty((g.size * send.shape[0], *send.shape[1:]))
    work = None
    if not portable:
        try:
            work = _ALL_GATHER(out, send, group=g.pg, async_op=True)
        except (RuntimeError, NotImplementedError):  # backends without the tensor variant
            work = None
    if work is None:
        work = dist.all_gather(list(out.chunk(g.size)), send, group=g.pg, async_op=True)
    return _Work(work, lambda: out.movedim(0, dim), name, phase, _nbytes(send) * (g.size - 1))


def _start_reduce_scatter(
    x: Tensor, dim: int, g: _Group, name: str, phase: str, portable: bool = False
) -> _Work:
    if g.size == 1:
        return _Work(None, x.clone, name, phase, 0)
    send = x.movedim(dim, 0).contiguous()
    n = send.shape[0] // g.size
    nbytes = _nbytes(send) * (g.size - 1) // g.size
    if not portable:
        out = send.new_empty((n, *send.shape[1:]))
        try:
            work = _REDUCE_SCATTER(out, send, op=dist.ReduceOp.SUM, group=g.pg, async_op=True)
            return _Work(work, lambda: out.movedim(0, dim), name, phase, nbytes)
        except (RuntimeError, NotImplementedError):
            pass
    # Portable twin (e.g. gloo on older torch): exchange the chunks, then sum locally.
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, group=g.pg, async_op=True)
    return _Work(
        work,
        lambda: recv.view(g.size, n, *send.shape[1:]).sum(0).movedim(0, dim),
        name,
        phase,
        nbytes,
    )


# ---- exchanges: a forward collective and its gradient's collective ----------------------
@dataclass
class _Exchange:
    kind: str  # "s2h" | "h2s" | "ag"
    group: _Group
    dim_a: int  # seq dim (s2h/h2s) or gather dim (ag)
    dim_b: int  # head dim (s2h/h2s); unused for ag
    name: str
    owner: str = "user"
    fwd: _Work | None = field(default=None, repr=False)
    bwd: _Work | None = field(default=None, repr=False)

    def launch(self, x: Tensor) -> _Work:
        return self._launch(x).set_owner(self.owner)

    def launch_grad(self, gr: Tensor) -> _Work:
        return self._launch_grad(gr).set_owner(self.owner)

    def _launch(self, x: Tensor) -> _Work:
        g, s, h = self.group, self.dim_a, self.dim_b
        if self.kind == "s2h":
            return _start_a2a(x, h, s, g, self.name, "forward")
        if self.kind == "h2s":
            return _start_a2a(x, s, h, g, self.name, "forward")
        return _start_all_gather(x, s, g, self.name, "forward")

    def _launch_grad(self, gr: Tensor) -> _Work:
        g, s, h = self.group, self.dim_a, self.dim_b
        name = _grad_name(self.name)
        if self.kind == "s2h":
            return _start_a2a(gr, s, h, g, name, "backward")
        if self.kind == "h2s":
            return _start_a2a(gr, h, s, g, name, "backward")
        return _start_reduce_scatter(gr, s, g, name, "backward")


def _grad_name(name: str) -> str:
    op, _, label = name.partition(":")
    inverse = {"a2a": "a2a", "all_gather": "reduce_scatter"}.get(op, op)
    return f"{inverse}:d{label}" if label else f"{inverse}:grad"


class _Launch(Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, ex: _Exchange) -> Tensor:  # type: ignore[override]
        ex.fwd = ex.launch(x)
        ctx.ex = ex
        return x.new_empty(0)

    @staticmethod
    def backward(ctx: Any, _token_grad: Tensor) -> Any:  # type: ignore[override]
        ex: _Exchange = ctx.ex
        work, ex.bwd = ex.bwd, None
        if work is None:
            raise RuntimeError(
                f"backward of {ex.name}: the paired wait node never launched the gradient's "
                "collective (was the handle waited and its result used?)"
            )
        return work.wait(), None


class _Wait(Function):
    @staticmethod
    def forward(ctx: Any, token: Tensor, ex: _Exchange) -> Tensor:  # type: ignore[override]
        ctx.ex = ex
        work, ex.fwd = ex.fwd, None
        assert work is not None
        return work.wait()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:  # type: ignore[override]
        ex: _Exchange = ctx.ex
        ex.bwd = ex.launch_grad(grad.contiguous())
        return grad.new_empty(0), None


class _Blocking(Function):
    """The same exchange as one node: launch and wait at once, forward and backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, ex: _Exchange) -> Tensor:  # type: ignore[override]
        ctx.ex = ex
        return ex.launch(x).wait()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:  # type: ignore[override]
        return ctx.ex.launch_grad(grad.contiguous()).wait(), None


class CollectiveHandle:
    """A launched collective. ``wait()`` returns its (differentiable) result exactly once."""

    def __init__(self, x: Tensor, ex: _Exchange) -> None:
        self._ex = ex
        self._token: Tensor | None = _Launch.apply(x, ex)

    @property
    def name(self) -> str:
        return self._ex.name

    def wait(self) -> Tensor:
        if self._token is None:
            raise RuntimeError(
                f"handle for {self._ex.name} was already waited (handles are single-use)"
            )
        token, self._token = self._token, None
        return _Wait.apply(token, self._ex)


# ---- public API ---------------------------------------------------------------------------
def _exchange(
    kind: str, x: Tensor, a: int, b: int, mesh: MeshLike, name: str, owner: str = "user"
) -> _Exchange:
    g = _resolve(mesh)
    if kind == "ag":
        if not isinstance(x, Tensor):
            raise TypeError(f"expected a Tensor, got {type(x).__name__}")
        a = _norm_dim(a, x.dim(), "dim")
    else:
        a, b = _check_ulysses(x, a, b, g.size, "head" if kind == "s2h" else "seq")
    return _Exchange(kind, g, a, b, name, owner)


def ulysses_seq_to_head(x: Tensor, seq_dim: int, head_dim: int, mesh: MeshLike) -> Tensor:
    """``[.., S/P, .., H, ..] -> [.., S, .., H/P, ..]`` over the P ranks of ``mesh``.

    Rank r receives heads ``[r·H/P, (r+1)·H/P)`` of all S tokens (sequence blocks in rank
    order). Differentiable: the backward is :func:`ulysses_head_to_seq` of the gradient.
    ``ValueError`` (before any communication) when the dims coincide or are out of range or
    H is not divisible by P. A mesh of size 1 returns ``x``.
    """
    return _Blocking.apply(x, _exchange("s2h", x, seq_dim, head_dim, mesh, "a2a:seq_to_head"))


def ulysses_head_to_seq(x: Tensor, seq_dim: int, head_dim: int, mesh: MeshLike) -> Tensor:
    """``[.., S, .., H/P, ..] -> [.., S/P, .., H, ..]``: the exact inverse of
    :func:`ulysses_seq_to_head` (``ValueError`` when S is not divisible by P)."""
    return _Blocking.apply(x, _exchange("h2s", x, seq_dim, head_dim, mesh, "a2a:head_to_seq"))


def launch_seq_to_head(
    x: Tensor, seq_dim: int, head_dim: int, mesh: MeshLike, *, name: str = "seq_to_head"
) -> CollectiveHandle:
    """Start :func:`ulysses_seq_to_head` asynchronously; ``handle.wait()`` gives its result.

    In backward the inverse all-to-all of the gradient is launched when the result's
    gradient is ready and waited when the input's gradient is needed.
    """
    return CollectiveHandle(x, _exchange("s2h", x, seq_dim, head_dim, mesh, f"a2a:{name}"))


def launch_head_to_seq(
    x: Tensor, seq_dim: int, head_dim: int, mesh: MeshLike, *, name: str = "head_to_seq"
) -> CollectiveHandle:
    """Start :func:`ulysses_head_to_seq` asynchronously (see :func:`launch_seq_to_head`)."""
    return CollectiveHandle(x, _exchange("h2s", x, seq_dim, head_dim, mesh, f"a2a:{name}"))


def launch_all_gather(
    x: Tensor, dim: int, mesh: MeshLike, *, name: str = "gather"
) -> CollectiveHandle:
    """Start an all-gather of ``x`` along ``dim`` (rank blocks concatenated in rank order).

    ``[.., n, ..] -> [.., P·n, ..]``. The gradient of the result is summed over ranks and
    reduce-scattered back along ``dim`` (asynchronously, in the paired backward nodes).
    """
    return CollectiveHandle(x, _exchange("ag", x, dim, -1, mesh, f"all_gather:{name}"))


def _all_gather(x: Tensor, dim: int, mesh: MeshLike, name: str = "gather") -> Tensor:
    return _Blocking.apply(x, _exchange("ag", x, dim, -1, mesh, f"all_gather:{name}"))


def shard_sequence(x: Tensor, mesh: MeshLike, dim: int = 1) -> Tensor:
    """This rank's contiguous block of ``x`` along ``dim``: ``[.., S, ..] -> [.., S/P, ..]``
    (block r on mesh rank r). ``ValueError`` when S is not divisible by P."""
    g = _resolve(mesh)
    if not isinstance(x, Tensor):
        raise TypeError(f"expected a Tensor, got {type(x).__name__}")
    dim = _norm_dim(dim, x.dim(), "dim")
    if x.size(dim) % g.size:
        raise ValueError(
            f"sequence length {x.size(dim)} (dim {dim}) is not divisible by the CP size {g.size}"
        )
    return x.chunk(g.size, dim)[g.rank]
