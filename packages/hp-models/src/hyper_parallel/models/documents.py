"""Packed documents: several documents in one row, each seeing only itself.

Hugging Face's packing convention (``DataCollatorWithFlattening``): one row ``[1, T]`` holding
the documents back to back, ``position_ids`` restarting at 0 at every document, ``labels``
``-100`` at each document's first token, optionally ``cu_seq_lens_q``/``cu_seq_lens_k`` (the
flash-attention offsets ``[0, …, T]``) and ``max_length_q``/``max_length_k``.

:func:`~hyper_parallel.models.shard_batch` reads the documents from the full batch
(:func:`packed_documents`: a document starts at 0 and wherever a position is not its
predecessor's plus one) and hands every rank the global offsets as ``cu_seqlens``; the
parallelised model's forward (:func:`pass_documents`) passes them to every layer: the KDA
layers (``parallelize_kda``: recurrence and short convolution restart at each start) and the
MLA layers (``parallelize_mla``: document-causal attention after the exchange); a DeepSeek-V3
model gets the block's plain causal mask, so Hugging Face does not build its own packed mask
from the per-document positions (which the context-parallel attention would reject). The
result equals the serial model run on each document alone: loss, logits and gradients.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["TABLE_KEYS", "document_positions", "packed_documents", "pass_documents"]

TABLE_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
"""Hugging Face's flash-attention packing keys, accepted by ``shard_batch``."""


def _offsets(table: Any, key: str, seq: int) -> list[int]:
    if not isinstance(table, Tensor) or table.dim() != 1 or table.numel() < 2:
        raise ValueError(f"shard_batch: {key} must be a 1-D tensor [0, …, T] of document offsets")
    if table.dtype.is_floating_point or table.dtype.is_complex or table.dtype == torch.bool:
        raise ValueError(f"shard_batch: {key} must be an integer tensor, got {table.dtype}")
    values = [int(v) for v in table.tolist()]
    if values[0] != 0 or values[-1] != seq or any(b <= a for a, b in zip(values, values[1:])):
        raise ValueError(
            f"shard_batch: {key} must increase strictly from 0 to the sequence length T={seq}, "
            f"got {values}"
        )
    return values


def document_positions(offsets: list[int], device: Any = None) -> Tensor:
    """``[1, T]`` positions restarting at 0 at every document of ``offsets``."""
    parts = [torch.arange(b - a, device=device) for a, b in zip(offsets, offsets[1:])]
    return torch.cat(parts)[None]


def packed_documents(
    batch: dict[str, Tensor], pos: Tensor | None, bsz: int, seq: int
) -> tuple[Tensor | None, Tensor | None]:
    """``(cu_seqlens, position_ids)`` of a full batch: the global document offsets (int64
    ``[n + 1]``, None for one document per row) and the positions to use (``pos``, or the
    per-document positions when only a table was given). ``ValueError`` (the same on every
    rank: the batch is) for a table that is not ``[0, …, T]`` strictly increasing, tables that
    disagree with each other or with the positions, or documents with ``B > 1``."""
    tables = {k: _offsets(batch[k], k, seq) for k in TABLE_KEYS[:2] if batch.get(k) is not None}
    if len({tuple(t) for t in tables.values()}) > 1:
        raise ValueError("shard_batch: cu_seq_lens_q and cu_seq_lens_k differ")
    from_table = next(iter(tables.values()), None)
    from_pos = None
    if pos is not None:
        rows = pos.expand(bsz, seq)
        starts = torch.ones(bsz, seq, dtype=torch.bool, device=pos.device)
        starts[:, 1:] = rows[:, 1:] != rows[:, :-1] + 1
        if bool(starts[:, 1:].any()):
            if bsz != 1:
                raise ValueError(
                    f"shard_batch: position_ids pack several documents into a row, with B={bsz}"
                    " rows; packed documents need one row (B = 1, the flattening collator's "
                    "form)"
                )
            from_pos = [int(t) for t in starts[0].nonzero().flatten().tolist()] + [seq]
    if from_table is not None and from_pos is not None and from_table != from_pos:
        raise ValueError(
            f"shard_batch: the documents of position_ids {from_pos} and of the cu_seq_lens "
            f"table {from_table} differ"
        )
    offsets = from_pos if from_pos is not None else from_table
    if offsets is None or len(offsets) == 2:
        return None, pos  # one document per row: the plain causal model
    if bsz != 1:
        raise ValueError(f"shard_batch: packed documents need one row (B = 1), got B={bsz}")
    if pos is None:
        pos = document_positions(offsets, batch["input_ids"].device)
    return torch.tensor(offsets, dtype=torch.int64, device=batch["input_ids"].device), pos


def pass_documents(kwargs: dict[str, Any], family: str) -> dict[str, Any]:
    """The keyword arguments of a parallelised model's call with the documents handed to every
    layer: given ``cu_seqlens`` (from ``shard_batch``) or HF's ``cu_seq_lens_q`` /
    ``cu_seq_lens_k``, the table goes on as ``cu_seqlens`` (the ``max_length_*`` hints are
    dropped) and, for DeepSeek-V3, the block's plain causal mask ``[1, 1, S, S]`` is passed
    (see the module docstring). ``kwargs`` is updated in place and returned."""
    table = kwargs.pop("cu_seqlens", None)
    for key in TABLE_KEYS:
        value = kwargs.pop(key, None)
        if key.startswith("cu_") and table is None:
            table = value
    if table is not None:
        kwargs["cu_seqlens"] = table
        ids = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        if family == "deepseek-v3" and isinstance(ids, Tensor):
            s = ids.shape[1]
            causal = torch.ones(s, s, dtype=torch.bool, device=ids.device).tril()
            kwargs["attention_mask"] = causal[None, None]
    return kwargs
