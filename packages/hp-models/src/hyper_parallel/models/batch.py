"""Cutting a batch into this rank's sequence block, and putting a sequence back together.

``shard_batch`` runs on the full batch, which is identical on every rank, so every check it
makes fails on every rank alike, before the model issues any collective.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from hyper_parallel.dtensor import DeviceMesh, checked_entry, comm
from hyper_parallel.models.documents import TABLE_KEYS, packed_documents
from hyper_parallel.models.mesh import check_mesh, cp_tp, sequence_mesh
from hyper_parallel.models.state import OWNER

__all__ = ["IGNORE_INDEX", "gather_sequence", "shard_batch"]

IGNORE_INDEX = -100
"""Label value that takes no part in the loss (Hugging Face's convention)."""

_KNOWN = ("input_ids", "labels", "attention_mask", "position_ids")


def shard_batch(batch: dict[str, Tensor], mesh: DeviceMesh) -> dict[str, Tensor]:
    """This rank's block of a full ``[B, T]`` batch, ready for ``model(**local)``.

    ``batch`` must be the same on every rank: ``input_ids`` ``[B, T]`` (required),
    optionally ``labels`` ``[B, T]`` (unshifted, Hugging Face's convention: position ``i``
    predicts ``labels[:, i + 1]``), ``attention_mask`` ``[B, T]`` (all ones only: padding is
    not supported under context parallelism) and ``position_ids`` ``[B, T]`` or ``[1, T]``
    (default ``0..T-1``).

    Returns, for the rank holding block ``b`` of ``P = cp·tp`` (``S = T/P``):
    ``input_ids`` ``[B, S]`` = columns ``[b·S, (b+1)·S)``; ``position_ids`` ``[B, S]``, the
    global positions of those tokens; and when labels are given, ``shift_labels`` ``[B, S]``,
    the labels shifted by one on the FULL sequence before cutting (so the target of the last
    token of a block is the first token of the next block; the very last token gets
    ``IGNORE_INDEX``), plus ``labels`` (the same tensor; Hugging Face computes a loss only when
    ``labels`` is given and then uses ``shift_labels`` as the targets).

    Packed documents (``B = 1``, Hugging Face's ``DataCollatorWithFlattening`` form):
    ``position_ids`` restarting at 0 at every document and/or ``cu_seq_lens_q`` /
    ``cu_seq_lens_k`` (offsets ``[0, …, T]``; ``max_length_q``/``_k`` accepted) add
    ``cu_seqlens``, the global document offsets, to every rank's block; ``model(**local)``
    then equals the serial model run on each document alone (labels ``-100`` at each
    document's first token, as the collator writes them; see
    :mod:`hyper_parallel.models.documents`).

    On a 3-D ``("dp", "cp", "tp")`` mesh the rank at dp coordinate ``d`` first takes rows
    ``[d·B/dp, (d+1)·B/dp)`` (``B % dp == 0``), then its sequence block of those: every
    returned tensor is ``[B/dp, S]``. Packed documents with dp > 1: ``B = dp`` rows (one packed
    row per replica), each row's documents read from its own ``position_ids``; the replica's
    ``cu_seqlens`` are its row's offsets (different replicas may hold different documents).
    A ``cu_seq_lens_q``/``_k`` table (one row's) with dp > 1, or several documents in a
    replica of ``B/dp > 1`` rows, raises ``ValueError``.

    ``ValueError`` (on every rank alike): missing or non-2-D ``input_ids``, shapes that differ,
    ``T % (cp·tp) != 0``, ``B % dp != 0``, an attention mask with zeros, unknown keys; plus the
    mesh checks.
    """
    check_mesh(mesh)
    unknown = sorted(set(batch) - set(_KNOWN) - set(TABLE_KEYS))
    if unknown:
        raise ValueError(f"shard_batch: unknown batch keys {unknown}; known: {list(_KNOWN)}")
    ids = batch.get("input_ids")
    if not isinstance(ids, Tensor) or ids.dim() != 2:
        raise ValueError("shard_batch needs input_ids as a [B, T] tensor")
    bsz, seq = ids.shape
    cp, tp = cp_tp(mesh)
    p = cp * tp
    if seq % p:
        raise ValueError(
            f"sequence length T={seq} is not divisible by cp·tp = {cp}·{tp} = {p}; pad or cut "
            f"the batch to a multiple of {p}"
        )
    dp = mesh.size(0) if mesh.ndim == 3 else 1
    if bsz % dp:
        raise ValueError(
            f"batch size B={bsz} is not divisible by dp = {dp}: each data-parallel rank takes "
            "B/dp rows"
        )
    for key in ("labels", "attention_mask"):
        t = batch.get(key)
        if t is not None and tuple(t.shape) != (bsz, seq):
            raise ValueError(
                f"shard_batch: {key} has shape {tuple(t.shape)}, expected {(bsz, seq)}"
            )
    mask = batch.get("attention_mask")
    if mask is not None and not bool((mask != 0).all()):
        raise ValueError(
            "shard_batch: the attention mask pads some tokens; padding is not supported under "
            "context parallelism (pack or cut the sequences to full length instead)"
        )
    pos = batch.get("position_ids")
    if pos is None:
        pos = torch.arange(seq, device=ids.device).unsqueeze(0)
    if pos.dim() != 2 or pos.shape[1] != seq or pos.shape[0] not in (1, bsz):
        raise ValueError(
            f"shard_batch: position_ids must be [B, T] or [1, T], got {tuple(pos.shape)}"
        )
    # every dp replica's documents from its own rows, all computed on every rank (the same
    # verdict everywhere); one replica's documents are the same on its cp·tp ranks
    shares = [_replica_documents(batch, bsz, seq, dp, r) for r in range(dp)]
    d = (mesh.get_coordinate() or [0])[0] if dp > 1 else 0
    documents, pos = shares[d]
    if pos is None:
        pos = torch.arange(seq, device=ids.device).unsqueeze(0)

    block = sequence_mesh(mesh).block
    s = seq // p
    cols = slice(block * s, (block + 1) * s)
    rows = slice(d * (bsz // dp), (d + 1) * (bsz // dp))  # this dp rank's share of the batch
    local: dict[str, Tensor] = {
        "input_ids": ids[rows, cols].contiguous(),
        "position_ids": pos.expand(bsz // dp, seq)[:, cols].contiguous(),
    }
    labels = batch.get("labels")
    if labels is not None:
        shifted = torch.full_like(labels, IGNORE_INDEX)
        shifted[:, :-1] = labels[:, 1:]
        local["shift_labels"] = shifted[rows, cols].contiguous()
        local["labels"] = local["shift_labels"]
    if documents is not None:  # the row's global offsets, the same on its cp·tp ranks
        local["cu_seqlens"] = documents
    return local


def _replica_documents(
    batch: dict[str, Tensor], bsz: int, seq: int, dp: int, replica: int
) -> tuple[Tensor | None, Tensor | None]:
    """``packed_documents`` of dp replica ``replica``'s rows ``[r·B/dp, (r+1)·B/dp)``."""
    pos = batch.get("position_ids")
    if dp == 1:
        return packed_documents(batch, pos, bsz, seq)
    if any(batch.get(k) is not None for k in TABLE_KEYS[:2]):
        raise ValueError(
            f"shard_batch: with dp = {dp} data-parallel replicas (B={bsz} rows), packed "
            "documents come from position_ids (each row restarting at 0 at its documents, "
            "each replica's table derived from its own row); a cu_seq_lens_q/cu_seq_lens_k "
            "table describes one row and is not accepted"
        )
    rows = bsz // dp
    if pos is not None and pos.shape[0] != 1:
        pos = pos[replica * rows : (replica + 1) * rows]
    try:
        return packed_documents(batch, pos, rows, seq)
    except ValueError as exc:
        first = replica * rows
        raise ValueError(
            f"{exc} (dp replica {replica}: rows [{first}, {first + rows}) of B={bsz}; with "
            f"dp = {dp} give B = {dp} rows, one packed row per replica)"
        ) from None


def _seq_dim(args: Any) -> Any:
    """``gather_sequence``'s ``seq_dim`` as compared: counted from 0 when in range."""
    x, seq_dim = args.x, args.seq_dim
    if isinstance(x, Tensor) and isinstance(seq_dim, int) and -x.dim() <= seq_dim < x.dim():
        seq_dim %= x.dim()
    return seq_dim


# over the flattened mesh (a mesh the body refuses: nothing compared)
@checked_entry(
    "gather_sequence",
    compare=("x",),
    group=lambda args: sequence_mesh(args.mesh).flat,
    extra={"seq_dim": _seq_dim},
)
def gather_sequence(x: Tensor, mesh: DeviceMesh, seq_dim: int = 1) -> Tensor:
    """The full sequence from every rank's block, in block order, on every rank.

    ``x`` is this rank's block ``[..., S, ...]`` (``S`` at ``seq_dim``), the same shape on every
    rank; the result is ``[..., P·S, ...]``. For evaluation and checks (no autograd: the
    result is detached). Consistency mode (hp-dtensor's README, "Ranks that disagree"): the
    ranks first compare ``x`` and ``seq_dim``."""
    sm = sequence_mesh(mesh)
    if not -x.dim() <= seq_dim < x.dim():
        raise ValueError(f"seq_dim {seq_dim} out of range for a {x.dim()}-D tensor")
    seq_dim %= x.dim()
    x = x.detach()
    if sm.size == 1:
        return x.clone()
    g = comm.resolve_group(sm.flat, "gather_sequence")
    return comm.start_all_gather(x, seq_dim, g, "all_gather:sequence", "forward", OWNER).wait()
