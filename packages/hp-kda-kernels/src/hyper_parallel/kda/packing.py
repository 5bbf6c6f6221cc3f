"""Packed documents under context parallelism: where this rank's block lies among them.

A packed row holds several documents back to back; ``cu_seqlens`` (flash-linear-attention's
convention) lists their global offsets ``[0, …, T]`` over the whole sequence, identical on
every rank, for ``B == 1``. The recurrence restarts from zero at every document start after
the first: a block that contains a start has the summary ``(S, M = 0)`` — its outgoing state
does not depend on the incoming one — so the state exchange is unchanged (the same ``(S, M)``
per rank, whatever the number of documents). The short convolution reads no row of an earlier
document (its halo and in-block rows before the start are cut).

Where the block lies comes from hp-dtensor's sequence context
(:class:`~hyper_parallel.dtensor.SequenceContext`):

- given one (``sequence_context=``, e.g. hp-models' per-forward context), nothing is read back
  to the host and nothing is gathered: the block's offset is the context's, each token's
  document start and the resets are computed on the device from its table; if the ranks have
  not compared the table's fingerprint yet (:attr:`SequenceContext.needs_check`), the layer
  does it with one all-gather of the fingerprints (its own exchanges are point-to-point: no
  symmetric collective to carry it), once per context;
- given ``cu_seqlens`` alone, blocks may differ in length, so the layer builds the context
  with one all-gather of every rank's ``[length, fingerprint]``
  (:func:`~hyper_parallel.dtensor.gather_sequence_context`, ``all_gather:block_lengths``):
  the table's own checks (integer 1-D, starts at 0, strictly increasing, ``B == 1``) run
  before it on every rank alike, its end ``T = Σ_r T_r`` right after it, and ranks given
  different tables all raise ``SequenceMismatchError`` after it, before the layer's first
  exchange. Consistency mode compares the table's values first (as part of the calling entry
  point's signature).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hyper_parallel.dtensor import SequenceContext, gather_sequence_context
from hyper_parallel.dtensor.consistency import checked_entry

from ._checks import table_values

__all__ = ["PackedBlock", "document_conv", "packed_block", "place_block"]


@dataclass(frozen=True)
class PackedBlock:
    """This rank's block ``[start, start + length)`` of a packed sequence of ``total`` tokens.

    ``offsets``: the documents' global offsets; ``resets [1, length]`` (0/1 float32): tokens
    where a document other than the first starts; ``doc_start [length]`` (int64): the global
    offset of each token's document."""

    offsets: tuple[int, ...]
    start: int
    length: int
    total: int
    resets: torch.Tensor
    doc_start: torch.Tensor

    @classmethod
    def of(cls, ctx: SequenceContext) -> PackedBlock:
        """The block of a packed sequence context (computed on the table's device)."""
        assert ctx.offsets is not None
        return cls(
            ctx.offsets, ctx.start, ctx.length, ctx.total,
            ctx.document_resets(), ctx.document_starts(),
        )  # fmt: skip


@checked_entry(
    "packed_block", group="mesh", extra={"cu_seqlens": lambda args: table_values(args.cu_seqlens)}
)
def packed_block(cu_seqlens: Any, mesh: Any, B: int, T: int, device: Any, what: str) -> PackedBlock:
    """Check ``cu_seqlens`` and place this rank's block of ``T`` tokens (``B == 1``) in it.

    Collective over the 1-D ``mesh`` (one all-gather of every rank's block length and table
    fingerprint); ``ValueError`` on every rank for a bad table: before the gather for a
    malformed one, after it (identically everywhere) for one that does not end at the total
    length or differs between ranks (``SequenceMismatchError``). Consistency mode (hp-dtensor's
    README, "Ranks that disagree"): called on its own, the ranks first compare the table's
    values (inside ``kda_context_parallel`` or a ``parallelize_kda``-ed forward, that entry
    point's signature holds them)."""
    ctx = gather_sequence_context(
        mesh, T, cu_seqlens=cu_seqlens, batch=B, device=device, what=f"{what}: cu_seqlens"
    )
    return PackedBlock.of(ctx)


def place_block(
    mesh: Any,
    B: int,
    T: int,
    device: Any,
    what: str,
    *,
    cu_seqlens: Any = None,
    packed: PackedBlock | None = None,
    context: Any = None,
) -> PackedBlock | None:
    """This rank's block of packed documents for one KDA call over the 1-D ``mesh``, or None
    for one document: from the caller's sequence ``context`` (checked
    against the call, its fingerprint compared once if not yet: see the module docstring), a
    placed ``packed`` block, or ``cu_seqlens`` (:func:`packed_block`, one all-gather).
    ``ValueError`` for a context given with a table or a placed block, or not describing this
    call's block; a packed context with ``B > 1``."""
    if context is None:
        if cu_seqlens is not None and packed is None:
            return packed_block(cu_seqlens, mesh, B, T, device, what)
        return packed
    if not isinstance(context, SequenceContext):
        raise ValueError(
            f"{what}: sequence_context must be a hyper_parallel.dtensor.SequenceContext, got "
            f"{type(context).__name__}"
        )
    if cu_seqlens is not None or packed is not None:
        raise ValueError(
            f"{what}: give the documents either as cu_seqlens (or a placed block) or in "
            "sequence_context, not both"
        )
    context.check_block(mesh.size(), mesh.get_local_rank(), T, what)
    if not context.packed:
        return None
    if B != 1:
        raise ValueError(
            f"{what}: packed documents (sequence_context) need batch size 1 (one packed row), "
            f"got B={B}"
        )
    context.verify(device, what)
    return PackedBlock.of(context)


def document_conv(
    rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedBlock
) -> torch.Tensor:
    """The depthwise causal convolution of ``rows [B, C, W−1+T]`` (halo, then the block) that
    reads no row of an earlier document: tap ``j`` of output ``t`` reads global row
    ``start + t − (W−1) + j``, kept only when it is not before ``t``'s document start (the
    serial convolution of each document alone pads with zeros there)."""
    W, T = weight.shape[-1], packed.length
    pos = torch.arange(packed.start, packed.start + T, device=rows.device) - (W - 1)
    out = None
    for j in range(W):
        keep = (pos + j >= packed.doc_start).to(rows.dtype)
        term = rows[..., j : j + T] * (weight[:, 0, j, None] * keep)
        out = term if out is None else out + term
    assert out is not None
    return out if bias is None else out + bias[:, None]
