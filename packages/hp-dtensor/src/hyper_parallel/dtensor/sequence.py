"""One sequence context for every token mixer: how a sequence lies over a context-parallel group.

A :class:`SequenceContext` says, for one forward, everything a context-parallel op needs to
know about the sequence beyond its own block: the group (a resolved ``comm.Group``, block
``r`` on group rank ``r``), every rank's block length (so this rank's offset ``start``, its
``length`` and the ``total``), and, for packed documents, the table of global document offsets
``[0, …, T]`` twice — ``documents`` (int64 on the block's device, for masks and gathers) and
``offsets`` (the same values as host ints, for schedules and kernels that take host ints) —
with its :func:`~hyper_parallel.dtensor.fingerprint.table_fingerprint`.

Who builds it:

- a model that knows the block layout (hp-models: ``T/P`` tokens a rank) builds one per forward
  with :func:`sequence_context` — local, the table validated and read to the host once — and
  hands it to every token mixer (``sequence_context=`` in the layers' forward keywords);
- a layer called alone builds its own from the ``cu_seqlens`` it was given: with equal blocks
  (:func:`sequence_context`), or with one all-gather of every rank's ``[length,
  fingerprint]`` when it does not know the other ranks' lengths
  (:func:`gather_sequence_context`).

A layer given a context reads no table back to the host and gathers no block lengths. The
fingerprint check: ranks given different tables must not silently compute a wrong answer, so
before the forward returns every rank compares the fingerprints inside a collective it runs
anyway and raises the same :class:`~hyper_parallel.dtensor.fingerprint.SequenceMismatchError`
(``ValueError``) when they differ — once per context: :func:`gather_sequence_context` does it
in its gather; hp-models in its loss-token all-reduce; otherwise the first layer that gets the
context unchecked folds it into its first symmetric exchange
(:meth:`SequenceContext.fingerprinted`) or, having none, runs :meth:`SequenceContext.verify`
(one all-gather of the fingerprints). A context whose group has one rank, or with no table,
needs no check. Ranks of which only some hold a table are consistency mode's to catch (like
blocks of different shapes): their collectives differ in shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from hyper_parallel.dtensor import comm
from hyper_parallel.dtensor.fingerprint import (
    FingerprintedExchange,
    check_fingerprints,
    table_fingerprint,
)

__all__ = [
    "SEQUENCE_OWNER",
    "SequenceContext",
    "check_documents",
    "gather_sequence_context",
    "sequence_context",
]

SEQUENCE_OWNER = "sequence"
"""The owner the context's own collectives are started under (``comm``)."""


def check_documents(
    table: Any,
    *,
    total: int | None = None,
    batch: int | None = None,
    what: str = "cu_seqlens",
    length_name: str = "T",
) -> tuple[int, ...]:
    """The one validator of a packed-documents table: a 1-D integer tensor ``[0, …, T]`` of
    strictly increasing global document offsets (every document non-empty), ending at
    ``total`` when given, for ``batch == 1`` when given. Returns its values as host ints (the
    one read: a device-to-host sync for a table on an accelerator). ``ValueError`` naming
    ``what`` (and ``length_name`` for the sequence length) otherwise."""
    if not isinstance(table, Tensor) or table.dim() != 1 or table.numel() < 2:
        got = tuple(table.shape) if isinstance(table, Tensor) else type(table).__name__
        raise ValueError(
            f"{what} must be a 1-D tensor [0, …, {length_name}] of document offsets with at "
            f"least 2 entries, got {got}"
        )
    if table.dtype.is_floating_point or table.dtype.is_complex or table.dtype == torch.bool:
        raise ValueError(f"{what} must be an integer tensor, got {table.dtype}")
    values = tuple(int(v) for v in table.tolist())
    if values[0] != 0:
        raise ValueError(f"{what} must start at 0, got {values[0]} ({list(values)})")
    if any(b <= a for a, b in zip(values, values[1:])):
        raise ValueError(
            f"{what} must be strictly increasing (every document non-empty), got {list(values)}"
        )
    if total is not None and values[-1] != total:
        raise ValueError(
            f"{what} must end at the sequence length {length_name}={total}, got {values[-1]}"
        )
    if batch is not None and batch != 1:
        raise ValueError(
            f"packed documents ({what}) need batch size 1 (one packed row), got B={batch}"
        )
    return values


class _Checked:
    """Whether the ranks compared the context's fingerprint (shared by the frozen context)."""

    __slots__ = ("done",)

    def __init__(self, done: bool = False) -> None:
        self.done = done


@dataclass(frozen=True, eq=False)
class SequenceContext:
    """How one sequence lies over a context-parallel group, for one forward (see the module
    docstring). ``group``: the resolved group, block ``r`` on group rank ``r``; ``lengths``:
    every rank's block length in block order; ``documents`` / ``offsets``: the packed
    documents' global offsets ``[0, …, total]`` (int64 on the block's device / host ints) or
    None; ``fingerprint``: the table's (0 for none)."""

    group: comm.Group
    lengths: tuple[int, ...]
    documents: Tensor | None = None
    offsets: tuple[int, ...] | None = None
    fingerprint: int = 0
    _checked: _Checked = field(default_factory=_Checked, repr=False)

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def length(self) -> int:
        """This rank's block length."""
        return self.lengths[self.group.rank]

    @property
    def start(self) -> int:
        """This rank's block offset in the sequence."""
        return sum(self.lengths[: self.group.rank])

    @property
    def total(self) -> int:
        return sum(self.lengths)

    @property
    def packed(self) -> bool:
        """Whether the sequence packs documents (a table was given)."""
        return self.offsets is not None

    @property
    def needs_check(self) -> bool:
        """Whether the ranks still have to compare the fingerprint (a table, more than one
        rank, not compared yet): the same on every rank of a group given the same kind of
        context."""
        return self.offsets is not None and self.group.size > 1 and not self._checked.done

    def mark_checked(self) -> None:
        """Record that the ranks compared the fingerprint and agreed."""
        self._checked.done = True

    def check(self, fingerprints: Sequence[int], what: str) -> None:
        """Compare every rank's fingerprint (group order, the same list on every rank):
        ``SequenceMismatchError`` on every rank if they differ, else the context is checked."""
        check_fingerprints(fingerprints, what)
        self.mark_checked()

    def fingerprinted(self, exchange: Any, dim: int = 1) -> FingerprintedExchange:
        """``exchange`` (whose result concatenates every rank's block along ``dim``) carrying
        this rank's fingerprint; after its forward, ``self.check(wrapped.received(), what)``."""
        return FingerprintedExchange(exchange, self.fingerprint, self.size, dim)

    def verify(self, device: Any, what: str) -> None:
        """If the context :attr:`needs_check`: one all-gather of every rank's fingerprint
        (``all_gather:sequence_fingerprint``, int64 on ``device``), then :meth:`check`. For an
        op with no symmetric collective to carry it. Collective over the group."""
        if not self.needs_check:
            return
        mine = torch.full((1,), self.fingerprint, dtype=torch.int64, device=device)
        work = comm.start_all_gather(
            mine, 0, self.group, "all_gather:sequence_fingerprint", "forward", SEQUENCE_OWNER
        )
        self.check(work.wait().tolist(), what)

    def check_block(self, size: int, rank: int, length: int, what: str) -> None:
        """``ValueError`` unless this context describes a block of ``length`` tokens on group
        rank ``rank`` of ``size`` (the layer's own group and input)."""
        if (self.size, self.rank) != (size, rank) or self.length != length:
            raise ValueError(
                f"{what}: the sequence context describes block {self.rank} of {self.size} "
                f"({self.length} tokens), but this layer runs block {rank} of {size} with "
                f"{length} tokens; build the context over the layer's own group"
            )

    def positions(self, device: Any = None) -> Tensor:
        """``[length]`` int64: the global positions of this rank's tokens."""
        if device is None and self.documents is not None:
            device = self.documents.device
        return torch.arange(self.start, self.start + self.length, device=device)

    def document_starts(self) -> Tensor:
        """``[length]`` int64 on the table's device: the global offset of the document each
        of this rank's tokens belongs to (computed there: no copy to or from the host)."""
        if self.documents is None:
            raise ValueError("document_starts: the sequence context packs no documents")
        cu, pos = self.documents, self.positions()
        idx = torch.searchsorted(cu, pos, right=True) - 1
        return cu[idx.clamp(0, cu.numel() - 1)]

    def document_resets(self) -> Tensor:
        """``[1, length]`` 0/1 float32 on the table's device: 1 at the tokens where a document
        other than the first begins."""
        pos = self.positions()
        return ((self.document_starts() == pos) & (pos > 0)).to(torch.float32)[None]


def _group(mesh: Any, what: str) -> comm.Group:
    if isinstance(mesh, comm.Group):
        return mesh
    return comm.resolve_group(mesh, what)


def _documents(table: Tensor, offsets: tuple[int, ...], device: Any) -> Tensor:
    """The validated table as int64 on ``device`` (its own when None) without waiting for the
    device: a table already there is cast in place (no copy if int64); otherwise the host
    values are copied from a fresh pageable tensor, which CUDA stages before returning
    (``non_blocking``: no stream sync); other accelerators copy blocking."""
    device = table.device if device is None else torch.device(device)
    if table.device == device:
        return table.to(torch.int64)
    host = torch.tensor(offsets, dtype=torch.int64)
    return host.to(device, non_blocking=device.type == "cuda")


def sequence_context(
    mesh: Any,
    lengths: int | Sequence[int],
    *,
    cu_seqlens: Tensor | None = None,
    batch: int | None = None,
    device: Any = None,
    what: str = "cu_seqlens",
    length_name: str = "T",
) -> SequenceContext:
    """The context of a sequence whose block layout the caller knows, with no communication.

    ``mesh``: a 1-D DeviceMesh (rank order checked), a ProcessGroup or a ``comm.Group``;
    ``lengths``: every rank's block length in block order, or one int (every block that
    long). ``cu_seqlens`` (optional): the packed documents' global offsets, validated by
    :func:`check_documents` (ending at the total length, ``batch == 1`` when ``batch`` is
    given; ``ValueError`` naming ``what`` and ``length_name``), read to the host once, kept
    as int64 on ``device`` (the table's own when None). The context starts unchecked (see the
    module docstring)."""
    g = _group(mesh, "sequence_context")
    sizes = (int(lengths),) * g.size if isinstance(lengths, int) else tuple(map(int, lengths))
    if len(sizes) != g.size or any(n < 0 for n in sizes):
        raise ValueError(
            f"sequence_context: lengths must give a non-negative block length for each of the "
            f"{g.size} ranks, got {list(sizes)}"
        )
    if cu_seqlens is None:
        return SequenceContext(g, sizes)
    offsets = check_documents(
        cu_seqlens, total=sum(sizes), batch=batch, what=what, length_name=length_name
    )
    return SequenceContext(
        g, sizes, _documents(cu_seqlens, offsets, device), offsets, table_fingerprint(offsets)
    )


def gather_sequence_context(
    mesh: Any,
    length: int,
    *,
    cu_seqlens: Tensor | None = None,
    batch: int | None = None,
    device: Any = None,
    what: str = "cu_seqlens",
) -> SequenceContext:
    """The context of a sequence whose blocks may differ in length, for a caller that knows
    only its own ``length``: one all-gather of every rank's ``[length, fingerprint]`` (int64
    on ``device``, ``all_gather:block_lengths``), so the context comes back checked.

    ``cu_seqlens`` is validated before the gather (:func:`check_documents` without its end;
    ``ValueError`` on every rank given it) and its end against the gathered total after it;
    ranks given different tables all raise ``SequenceMismatchError`` after the gather.
    Collective over the group; a group of one rank communicates nothing."""
    g = _group(mesh, "gather_sequence_context")
    offsets = None
    if cu_seqlens is not None:
        offsets = check_documents(cu_seqlens, batch=batch, what=what)
        if device is None:
            device = cu_seqlens.device
    fp = table_fingerprint(offsets)
    if g.size > 1:
        mine = torch.empty(2, dtype=torch.int64, device=device)
        mine[0], mine[1] = int(length), fp  # fills with host scalars: no copy to the device
        work = comm.start_all_gather(
            mine, 0, g, "all_gather:block_lengths", "forward", SEQUENCE_OWNER
        )
        rows = work.wait().view(g.size, 2).tolist()
        sizes = tuple(int(r[0]) for r in rows)
        check_fingerprints([int(r[1]) for r in rows], what)
    else:
        sizes = (int(length),)
    if cu_seqlens is None or offsets is None:
        return SequenceContext(g, sizes, _checked=_Checked(True))
    if offsets[-1] != sum(sizes):
        raise ValueError(
            f"{what} must end at the sequence length T={sum(sizes)} (the ranks' blocks "
            f"{list(sizes)} together), got {offsets[-1]}"
        )
    documents = _documents(cu_seqlens, offsets, device)
    return SequenceContext(g, sizes, documents, offsets, fp, _Checked(True))
