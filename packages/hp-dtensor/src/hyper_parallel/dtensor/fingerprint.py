"""The packed-document table's fingerprint, and the ways ranks compare it inside collectives
they run anyway.

A table ``[0, …, T]`` (host ints) has a fingerprint (:func:`table_fingerprint`): a nonzero
int64 hash of its values, 0 for no table. Ranks of one context-parallel group must hold the
same table; the exchanges of a token mixer do not depend on it, so ranks given different
tables compute a wrong answer with no error unless they compare. Consistency mode compares the
tables' values in a signature collective of its own; with it off, the fingerprint rides on a
collective the schedule already runs, and every rank raises the same
:class:`SequenceMismatchError` when they differ:

- :func:`check_fingerprints`: every rank's fingerprint in group order (after an all-gather
  that carries them, e.g. hp-dtensor's :func:`~hyper_parallel.dtensor.sequence.
  gather_sequence_context`, which gathers the block lengths with them).
- :class:`FingerprintedExchange`: an exchange whose result concatenates every rank's block
  along a dim (an all-gather along the sequence, a sequence-to-head all-to-all) carries one
  extra row along that dim holding the fingerprint's 8 bytes; the result and the gradient are
  the unwrapped exchange's, bit for bit. :meth:`~FingerprintedExchange.received` reads the
  rows back (one device-to-host read).
- :func:`summed_slots` / :func:`check_summed`: words to add to an all-reduce (sum) the caller
  runs anyway — for each of ``replicas`` groups, ``(Σ w, Σ w²)`` of three 21-bit words of the
  fingerprint; by Cauchy–Schwarz ``(Σ w)² = n·Σ w²`` over the ``n`` ranks of a group exactly
  when their words are equal, a verdict every rank computes alike from the sums.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "FingerprintedExchange",
    "SequenceMismatchError",
    "check_fingerprints",
    "check_summed",
    "summed_slots",
    "table_fingerprint",
]

_WORD_BITS = 21
_WORDS = 3  # three 21-bit words: 63 bits of the fingerprint


class SequenceMismatchError(ValueError):
    """The ranks of one context-parallel group hold different packed-document tables.
    ``fingerprints`` maps each table fingerprint (0: no table) to the group ranks holding it,
    when the collective that compared them carried every rank's (else empty)."""

    def __init__(self, what: str, fingerprints: dict[int, list[int]], detail: str = "") -> None:
        self.fingerprints = fingerprints
        held = "; ".join(
            f"ranks {ranks}: {_show(fp)}" for fp, ranks in sorted(fingerprints.items())
        )
        super().__init__(
            f"{what}: the ranks of the context-parallel group were given different "
            f"packed-document tables (cu_seqlens) {held or detail}; every rank of the group "
            "must be given the same global table [0, …, T] (consistency mode, "
            "HP_CHECK_CONSISTENCY=1, compares the tables' values before any collective)"
        )


def _show(fp: int) -> str:
    return "no table" if fp == 0 else f"table fingerprint {fp & 0xFFFFFFFFFFFFFFFF:016x}"


def table_fingerprint(offsets: Sequence[int] | None) -> int:
    """A nonzero signed int64 hash of a table's values (BLAKE2b of their little-endian int64
    bytes), computed on the host; 0 for no table."""
    if offsets is None:
        return 0
    digest = hashlib.blake2b(struct.pack(f"<{len(offsets)}q", *offsets), digest_size=8)
    fp = int.from_bytes(digest.digest(), "little", signed=True)
    return fp or 1


def check_fingerprints(fingerprints: Sequence[int], what: str) -> None:
    """Raise :class:`SequenceMismatchError` unless every rank's fingerprint (in group order,
    the same list on every rank) is the same: the same verdict and message everywhere."""
    held: dict[int, list[int]] = {}
    for rank, fp in enumerate(fingerprints):
        held.setdefault(int(fp), []).append(rank)
    if len(held) > 1:
        raise SequenceMismatchError(what, held)


# ---- riding on an exchange that concatenates every rank's block ----------------------------
class FingerprintedExchange:
    """``inner`` (an exchange driven by hp-dtensor's overlapped-exchange node pair, see
    :mod:`hyper_parallel.dtensor.overlap`) whose forward result concatenates the ``size``
    ranks' blocks along ``dim`` in group order, with this rank's ``fingerprint`` riding on it.

    ``start(x)`` sends ``x`` with one more row along ``dim``: zeros but for the first 8 bytes
    of each last-dim vector, which hold the fingerprint (so any split of the other dims, like a
    sequence-to-head all-to-all's split of the heads, carries it whole to every rank);
    ``finish()`` returns the result without those rows (keeping them for :meth:`received`).
    Backward: the result's gradient goes out with zero rows in their place and the input's
    gradient comes back without its row. Needs ``x``'s last dim to hold at least 8 bytes
    (:meth:`fits`). The collectives move raw bytes, so the result and the gradients are the
    unwrapped exchange's, bit for bit; the cost is one row more per rank and a copy of the
    block each way."""

    def __init__(self, inner: Any, fingerprint: int, size: int, dim: int = 1) -> None:
        self.inner, self.fingerprint, self.size, self.dim = inner, fingerprint, size, dim
        self._rows = -1
        self._trailers: Tensor | None = None

    def __getattr__(self, name: str) -> Any:  # the inner exchange's name, group, ...
        return getattr(self.inner, name)

    @staticmethod
    def fits(x: Tensor) -> bool:
        """Whether ``x``'s last-dim vectors hold the fingerprint's 8 bytes."""
        return x.dim() >= 2 and x.shape[-1] * x.element_size() >= 8

    def start(self, x: Tensor) -> None:
        d = self.dim % x.dim()
        self._rows = x.shape[d]
        shape = list(x.shape)
        shape[d] = 1
        row = x.new_zeros(shape)
        raw = row.view(torch.uint8)  # [..., last·itemsize]: contiguous, fresh
        for i, byte in enumerate(struct.pack("<q", self.fingerprint)):
            if byte:
                raw[..., i] = byte  # a fill with a host scalar: no copy to the device
        self.inner.start(torch.cat([x, row], dim=d))

    def finish(self) -> Tensor:
        y = self.inner.finish()
        d = self.dim % y.dim()
        blocks = y.unflatten(d, (self.size, self._rows + 1))
        self._trailers = blocks.select(d + 1, self._rows).movedim(d, 0)
        return blocks.narrow(d + 1, 0, self._rows).flatten(d, d + 1)

    def start_grad(self, grad: Tensor) -> None:
        d = self.dim % grad.dim()
        blocks = grad.unflatten(d, (self.size, self._rows))
        shape = list(blocks.shape)
        shape[d + 1] = 1
        padded = torch.cat([blocks, grad.new_zeros(shape)], dim=d + 1).flatten(d, d + 1)
        self.inner.start_grad(padded.contiguous())

    def finish_grad(self) -> Tensor:
        g = self.inner.finish_grad()
        return g.narrow(self.dim % g.dim(), 0, self._rows)

    def received(self) -> list[int]:
        """Every rank's fingerprint, in group order, from the finished forward (one
        device-to-host read)."""
        if self._trailers is None:
            raise RuntimeError("FingerprintedExchange.received() before finish()")
        t = self._trailers.reshape(self.size, -1)  # rank j's row: its first vector leads
        raw = t.contiguous().view(torch.uint8)
        words = raw[:, :8].contiguous().view(torch.int64)
        return [int(v) for v in words.reshape(-1).tolist()]


# ---- riding on an all-reduce (sum) ---------------------------------------------------------
def _words(fp: int) -> list[int]:
    u = fp & ((1 << (_WORD_BITS * _WORDS)) - 1)
    return [(u >> (_WORD_BITS * i)) & ((1 << _WORD_BITS) - 1) for i in range(_WORDS)]


SLOTS_PER_GROUP = 2 * _WORDS
"""int64 entries :func:`summed_slots` adds per group."""


def summed_slots(fingerprint: int, group: int, groups: int) -> list[tuple[int, int]]:
    """``(index, value)`` of the nonzero entries this rank adds to a zero int64 vector of
    ``groups · SLOTS_PER_GROUP`` entries that an all-reduce (sum) over every rank of the
    ``groups`` groups carries: ``(w, w²)`` of each word of ``fingerprint``, in the slots of its
    ``group``. (Entries, not a tensor: the caller fills its device buffer with host scalars,
    copying nothing to the device.)"""
    base = group * SLOTS_PER_GROUP
    out = []
    for i, w in enumerate(_words(fingerprint)):
        if w:
            out += [(base + 2 * i, w), (base + 2 * i + 1, w * w)]
    return out


def check_summed(sums: Sequence[int], group_size: int, what: str) -> None:
    """Raise :class:`SequenceMismatchError` unless, in every group of the summed vector (see
    :func:`summed_slots`), the ``group_size`` ranks added equal words: ``(Σ w)² = n·Σ w²``."""
    for g in range(len(sums) // SLOTS_PER_GROUP):
        part = sums[g * SLOTS_PER_GROUP : (g + 1) * SLOTS_PER_GROUP]
        for i in range(_WORDS):
            s1, s2 = int(part[2 * i]), int(part[2 * i + 1])
            if s1 * s1 != group_size * s2:
                raise SequenceMismatchError(
                    what, {}, f"(found by the summed fingerprints of sequence group {g})"
                )
