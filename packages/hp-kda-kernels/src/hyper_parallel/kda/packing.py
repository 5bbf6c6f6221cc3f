"""Packed documents under context parallelism: where this rank's block lies among them.

A packed row holds several documents back to back; ``cu_seqlens`` (flash-linear-attention's
convention) lists their global offsets ``[0, …, T]`` over the whole sequence, identical on
every rank, for ``B == 1``. The recurrence restarts from zero at every document start after
the first: a block that contains a start has the summary ``(S, M = 0)`` — its outgoing state
does not depend on the incoming one — so the state exchange is unchanged (the same ``(S, M)``
per rank, whatever the number of documents). The short convolution reads no row of an earlier
document (its halo and in-block rows before the start are cut).

Blocks may differ in length, so a rank learns its global offset from one all-gather of the
block lengths (``P`` int64 values, the only extra communication, once per call). The table's
own checks (integer 1-D, starts at 0, strictly increasing, ``B == 1``) run before it, on every
rank alike; its end ``T = Σ_r T_r`` is checked right after it, on every rank alike, before the
layer's first exchange. Consistency mode compares the table's values first (as part of the
calling entry point's signature).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hyper_parallel.dtensor import comm, rank_list
from hyper_parallel.dtensor.consistency import checked_entry

from ._checks import check_cu_seqlens, document_resets, document_starts, read_field
from .halo import OWNER

__all__ = ["PackedBlock", "packed_block"]


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


def _table_fields(cu_seqlens: Any, mesh: Any, *_: Any) -> tuple[Any, dict[str, Any]] | None:
    """:func:`packed_block`'s consistency signature: the table's values (read, not checked)."""
    if getattr(mesh, "ndim", None) != 1:
        return None
    table = read_field(lambda: tuple(int(x) for x in cu_seqlens.reshape(-1).tolist()))
    return mesh.get_group(0), {"cu_seqlens": table}


@checked_entry("packed_block", _table_fields)
def packed_block(cu_seqlens: Any, mesh: Any, B: int, T: int, device: Any, what: str) -> PackedBlock:
    """Check ``cu_seqlens`` and place this rank's block of ``T`` tokens (``B == 1``) in it.

    Collective over the 1-D ``mesh`` (one all-gather of the block lengths); ``ValueError`` on
    every rank for a bad table: before the gather for a malformed one, after it (identically
    everywhere) for one that does not end at the total length. Consistency mode: called on
    its own, the ranks first compare the table's values (inside ``kda_context_parallel`` or a
    ``parallelize_kda``-ed forward, that entry point's signature holds them)."""
    offsets = check_cu_seqlens(cu_seqlens, B, None, what)
    group = mesh.get_group(0)
    P = mesh.size()
    mine = torch.tensor([T], dtype=torch.int64, device=device)
    if P > 1:
        gather = comm.start_all_gather(
            mine, 0, comm.resolve_group(group), "all_gather:block_lengths", "forward", OWNER
        )
        lengths = [int(x) for x in gather.wait().tolist()]
    else:
        lengths = [T]
    r = list(rank_list(mesh)).index(dist.get_rank()) if P > 1 else 0
    total = sum(lengths)
    if offsets[-1] != total:
        raise ValueError(
            f"{what}: cu_seqlens must end at the sequence length T={total} (the ranks' blocks "
            f"{lengths} together), got {offsets[-1]}"
        )
    start = sum(lengths[:r])
    return PackedBlock(
        tuple(offsets), start, T, total,
        document_resets(offsets, start, T, device), document_starts(offsets, start, T, device),
    )  # fmt: skip
