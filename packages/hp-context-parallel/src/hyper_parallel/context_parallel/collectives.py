"""Ulysses all-to-alls and sequence all-gathers: blocking, and as async single-use handles.

Notation: P ranks on a 1-D mesh (or process group), rank r holds the contiguous sequence
block r of length S/P. ``seq_to_head``: ``[.., S/P, .., H, ..] -> [.., S, .., H/P, ..]`` (rank r
keeps heads ``[r·H/P, (r+1)·H/P)`` of every token); ``head_to_seq`` is its exact inverse.

Each function validates its arguments (the same on every rank, before any communication) and
builds an :class:`~hyper_parallel.context_parallel.exchange.Exchange`; async launches are the
exchange's launch and wait autograd nodes, so the gradient's collective (the inverse
all-to-all, or the reduce-scatter of an all-gather) overlaps whatever autograd runs between
them in backward.

Consistency mode (hp-dtensor's README, "Ranks that disagree"): each collective first compares,
over its group, its kind, ``x``, the normalised dims and the group size.

Every collective launched here and not yet waited is listed by :func:`pending_collectives`;
the parallel MLA forward refuses to start while one launched by a parallel MLA block is
pending (an exception between its launch and wait, or a backward collective whose paired node
was pruned by a partial ``torch.autograd.grad``); user handles may stay in flight across it.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from hyper_parallel.context_parallel.exchange import Exchange, ExchangeKind, blocking, launch, wait
from hyper_parallel.context_parallel.transport import pending_collectives, resolve_group
from hyper_parallel.dtensor import check_consistent

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
USER = "user"  # owner tag of the collectives started through this module


# ---- validation ---------------------------------------------------------------------------
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


class CollectiveHandle:
    """A launched collective. ``wait()`` returns its (differentiable) result exactly once."""

    def __init__(self, x: Tensor, ex: Exchange) -> None:
        self._ex = ex
        self._token: Tensor | None = launch(x, ex)

    @property
    def name(self) -> str:
        return self._ex.name

    def wait(self) -> Tensor:
        if self._token is None:
            raise RuntimeError(
                f"handle for {self._ex.name} was already waited (handles are single-use)"
            )
        token, self._token = self._token, None
        return wait(token, self._ex)


def make_exchange(
    kind: ExchangeKind, x: Tensor, a: int, b: int, mesh: MeshLike, name: str, owner: str = USER
) -> Exchange:
    """Validate ``x`` and the dims for ``kind`` (before any communication) and build the
    exchange: ``a`` is the sequence (gather) dim, ``b`` the head dim."""
    g = resolve_group(mesh)
    if kind == "ag":
        if not isinstance(x, Tensor):
            raise TypeError(f"expected a Tensor, got {type(x).__name__}")
        a = _norm_dim(a, x.dim(), "dim")
    else:
        a, b = _check_ulysses(x, a, b, g.size, "head" if kind == "s2h" else "seq")
    dims = {"dim": a} if kind == "ag" else {"seq_dim": a, "head_dim": b}
    check_consistent(g.pg, name, kind=kind, x=x, **dims, size=g.size)  # off: returns at once
    return Exchange(kind, g, a, b, name, owner)


# ---- public API ---------------------------------------------------------------------------
def ulysses_seq_to_head(x: Tensor, seq_dim: int, head_dim: int, mesh: MeshLike) -> Tensor:
    """``[.., S/P, .., H, ..] -> [.., S, .., H/P, ..]`` over the P ranks of ``mesh``.

    Rank r receives heads ``[r·H/P, (r+1)·H/P)`` of all S tokens (sequence blocks in rank
    order). Differentiable: the backward is :func:`ulysses_head_to_seq` of the gradient.
    ``ValueError`` (before any communication) when the dims coincide or are out of range or
    H is not divisible by P. A mesh of size 1 returns ``x``.
    """
    return blocking(x, make_exchange("s2h", x, seq_dim, head_dim, mesh, "a2a:seq_to_head"))


def ulysses_head_to_seq(x: Tensor, seq_dim: int, head_dim: int, mesh: MeshLike) -> Tensor:
    """``[.., S, .., H/P, ..] -> [.., S/P, .., H, ..]``: the exact inverse of
    :func:`ulysses_seq_to_head` (``ValueError`` when S is not divisible by P)."""
    return blocking(x, make_exchange("h2s", x, seq_dim, head_dim, mesh, "a2a:head_to_seq"))


def launch_seq_to_head(
    x: Tensor, seq_dim: int, head_dim: int, mesh: MeshLike, *, name: str = "seq_to_head"
) -> CollectiveHandle:
    """Start :func:`ulysses_seq_to_head` asynchronously; ``handle.wait()`` gives its result.

    In backward the inverse all-to-all of the gradient is launched when the result's
    gradient is ready and waited when the input's gradient is needed.
    """
    return CollectiveHandle(x, make_exchange("s2h", x, seq_dim, head_dim, mesh, f"a2a:{name}"))


def launch_head_to_seq(
    x: Tensor, seq_dim: int, head_dim: int, mesh: MeshLike, *, name: str = "head_to_seq"
) -> CollectiveHandle:
    """Start :func:`ulysses_head_to_seq` asynchronously (see :func:`launch_seq_to_head`)."""
    return CollectiveHandle(x, make_exchange("h2s", x, seq_dim, head_dim, mesh, f"a2a:{name}"))


def launch_all_gather(
    x: Tensor, dim: int, mesh: MeshLike, *, name: str = "gather"
) -> CollectiveHandle:
    """Start an all-gather of ``x`` along ``dim`` (rank blocks concatenated in rank order).

    ``[.., n, ..] -> [.., P·n, ..]``. The gradient of the result is summed over ranks and
    reduce-scattered back along ``dim`` (asynchronously, in the paired backward nodes).
    """
    return CollectiveHandle(x, make_exchange("ag", x, dim, -1, mesh, f"all_gather:{name}"))


def all_gather_blocking(x: Tensor, dim: int, mesh: MeshLike, name: str = "gather") -> Tensor:
    """Blocking, differentiable all-gather along ``dim`` (gradient: reduce-scatter, sum)."""
    return blocking(x, make_exchange("ag", x, dim, -1, mesh, f"all_gather:{name}"))


def shard_sequence(x: Tensor, mesh: MeshLike, dim: int = 1) -> Tensor:
    """This rank's contiguous block of ``x`` along ``dim``: ``[.., S, ..] -> [.., S/P, ..]``
    (block r on mesh rank r). ``ValueError`` when S is not divisible by P."""
    g = resolve_group(mesh)
    if not isinstance(x, Tensor):
        raise TypeError(f"expected a Tensor, got {type(x).__name__}")
    dim = _norm_dim(dim, x.dim(), "dim")
    if x.size(dim) % g.size:
        raise ValueError(
            f"sequence length {x.size(dim)} (dim {dim}) is not divisible by the CP size {g.size}"
        )
    return x.chunk(g.size, dim)[g.rank]
