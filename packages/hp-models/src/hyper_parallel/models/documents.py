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
MLA and GQA layers (``parallelize_mla``, ``parallelize_attention``: document-causal attention
after the exchange), the Gated DeltaNet layers like KDA's; a DeepSeek-V3
model gets the block's plain causal mask, so Hugging Face does not build its own packed mask
from the per-document positions (which the context-parallel attention would reject). The
result equals the serial model run on each document alone: loss, logits and gradients.

The forward hands the layers the table as one hp-dtensor
:class:`~hyper_parallel.dtensor.SequenceContext` (``sequence_context``), built once per forward
(:func:`pass_documents`): the table validated by hp-dtensor's ``check_documents`` and read to
the host once, the block layout the mesh's (``T/P`` tokens a rank), so no layer reads the table
back or gathers block lengths. Ranks of one sequence given different tables must not compute a
silently wrong answer (the layers' exchanges do not depend on the table): the table's
fingerprint rides on the loss-token all-reduce the forward runs anyway
(:func:`count_tokens`), and every rank raises the same ``SequenceMismatchError``; without
labels (no such all-reduce), the first layer compares it in one of its own collectives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from hyper_parallel.dtensor import SequenceContext, check_documents, comm, sequence_context
from hyper_parallel.dtensor.fingerprint import SLOTS_PER_GROUP, check_summed, summed_slots

if TYPE_CHECKING:
    from hyper_parallel.models.families import ModelFamily

__all__ = [
    "TABLE_KEYS",
    "count_tokens",
    "document_positions",
    "packed_documents",
    "pass_documents",
]

TABLE_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
"""Hugging Face's flash-attention packing keys, accepted by ``shard_batch``."""


def _offsets(table: Any, key: str, seq: int) -> list[int]:
    return list(check_documents(table, total=seq, what=f"shard_batch: {key}"))


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


def pass_documents(kwargs: dict[str, Any], family: ModelFamily, mesh: Any = None) -> Any:
    """The keyword arguments of a parallelised model's call with the documents handed to every
    layer: given ``cu_seqlens`` (from ``shard_batch``) or HF's ``cu_seq_lens_q`` /
    ``cu_seq_lens_k``, the table goes on as ``cu_seqlens`` (the ``max_length_*`` hints are
    dropped), and the masks are set as the family's model takes them
    (:meth:`~hyper_parallel.models.families.ModelFamily.forward_masks`: every layer type's
    mask ``None``, or, for a model building its own mask given documents, the block's plain
    causal mask ``[1, 1, S, S]``; see the module docstring). ``kwargs`` is updated in place.

    ``mesh`` (the forward's :class:`~hyper_parallel.models.SequenceMesh`): the table goes on
    as one ``sequence_context`` instead (hp-dtensor's ``SequenceContext`` over the flattened
    mesh, ``S`` tokens a rank; validated, ``ValueError`` on every rank given the same bad
    table), which is returned (one without documents when there is no table: not passed on).
    Without ``mesh``, ``kwargs`` is returned."""
    table = kwargs.pop("cu_seqlens", None)
    for key in TABLE_KEYS:
        value = kwargs.pop(key, None)
        if key.startswith("cu_") and table is None:
            table = value
    ids = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    family.forward_masks(kwargs, packed=table is not None)
    if mesh is None:
        if table is not None:
            kwargs["cu_seqlens"] = table
        return kwargs
    b, s = (ids.shape[0], ids.shape[1]) if isinstance(ids, Tensor) else (None, 0)
    device = ids.device if isinstance(ids, Tensor) else None
    ctx = sequence_context(mesh.flat_group, s, cu_seqlens=table, batch=b, device=device)
    if ctx.packed:
        kwargs["sequence_context"] = ctx
    return ctx


def count_tokens(count: Tensor, ctx: SequenceContext, mesh: Any, owner: str) -> Tensor:
    """The number of loss tokens of the whole batch (the sum of every rank's ``count``, a 0-d
    int64 tensor) — the all-reduce (``all_reduce:loss_tokens``) over every rank of the batch
    that also carries the table fingerprints: for each of the ``dp`` sequence groups the sums
    of the words of its ranks' fingerprints (hp-dtensor's ``summed_slots``; the same size on
    every rank, zeros without a table, written on the device from host scalars). A rank
    holding a table reads the sums (one device-to-host read) and raises
    ``SequenceMismatchError``, like every rank of the batch holding one, if the ranks of any
    sequence group were given different tables; the context is then checked (the layers
    compare nothing more)."""
    groups = mesh.dp_size
    group = (mesh.mesh.get_coordinate() or [0])[0] if groups > 1 else 0
    buf = torch.zeros(1 + groups * SLOTS_PER_GROUP, dtype=torch.int64, device=count.device)
    buf[:1].copy_(count.reshape(1))
    for i, value in summed_slots(ctx.fingerprint, group, groups):
        buf[1 + i] = value  # a fill with a host scalar: nothing copied to the device
    g = comm.resolve_group(mesh.batch, "the parallelised forward")
    buf = comm.start_all_reduce(buf, g, "all_reduce:loss_tokens", "forward", owner).wait()
    if ctx.needs_check:
        check_summed(buf[1:].tolist(), ctx.size, "the parallelised model forward")
        ctx.mark_checked()
    return buf[0]
