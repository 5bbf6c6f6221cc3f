"""The count exchange and the plan it gives every rank: the one host sync of a forward.

Notation: ``P`` ranks in the ep group, rank ``r`` owns experts ``r·E_l … (r+1)·E_l − 1``
(``E_l = E / P``); ``c[s, e]``: the (token, slot) pairs rank s routes to expert e.

Each rank all-gathers one small int64 vector: its ``c[r, :]`` (``[E]``), a *verdict* (0, or the
code of the first problem with its own inputs) and the id of the dtype its rows travel in.
From the gathered ``[P, E + 2]`` every rank derives, identically:

- the verdicts: any rank's problem raises the same ``ValueError`` on every rank, before any
  row is exchanged (no hang);
- the send splits (rows to rank j: ``Σ_{e ∈ j} c[r, e]``) and receive splits (rows from s:
  ``Σ_{e ∈ r} c[s, e]``) of dispatch (the combine's are the same, reversed);
- the chunks: the rows one rank sends another are cut into ``C`` contiguous slices (slice
  ``q`` of ``n`` rows: ``⌊q·n/C⌋ … ⌊(q+1)·n/C⌋``); chunk q is slice q of every pair, so its
  per-expert counts follow from ``c`` alone, with no further exchange;
- the global per-expert counts ``Σ_s c[s, e]`` (:func:`~hyper_parallel.moe.expert_counts`).

A dispatcher (:mod:`hyper_parallel.moe.dispatch`) folds its per-call limits into the verdict
(codes :data:`TOKENS_OVER`, :data:`TOKENS_UNDER`, :data:`DTYPE_REFUSED`, :data:`INFERENCE_ONLY`
with its own wording, ``reasons``), so they too raise on every rank before any row moves.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from hyper_parallel.dtensor import comm

__all__ = [
    "DTYPE_REFUSED",
    "INFERENCE_ONLY",
    "TOKENS_OVER",
    "TOKENS_UNDER",
    "Plan",
    "exchange_counts",
    "local_verdict",
]

OWNER = "hp-moe"

# verdict codes -> what is wrong (the message names the ranks)
_VERDICTS = {
    1: "top_k_index holds an expert id outside [0, E)",
    2: "top_k_index is not an integer tensor of shape [N, K] matching hidden [N, H]",
    3: "top_k_weights is not a floating tensor of the shape of top_k_index",
    4: "hidden is not [N, H] with H the experts' hidden size",
    5: "hidden's dtype differs from the expert weights' (outside autocast)",
}
# verdict codes a dispatcher gives its per-call limits (the wording is the dispatcher's)
TOKENS_OVER, TOKENS_UNDER, DTYPE_REFUSED, INFERENCE_ONLY = 6, 7, 8, 9
_DTYPES = [
    torch.float64,
    torch.float32,
    torch.bfloat16,
    torch.float16,
]


def local_verdict(
    hidden: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    num_experts: int,
    hidden_size: int,
    weight_dtype: torch.dtype,
    compute_dtype: torch.dtype,
) -> int:
    """0 when this rank's inputs can be computed exactly, else the code of the first problem.
    Reads only shapes and dtypes, except for the range of ``top_k_index`` (one reduction on
    device, read with the counts)."""
    if hidden.dim() != 2 or hidden.shape[1] != hidden_size:
        return 4
    if (
        top_k_index.dim() != 2
        or top_k_index.shape[0] != hidden.shape[0]
        or top_k_index.dtype.is_floating_point
        or top_k_index.dtype.is_complex
        or top_k_index.dtype == torch.bool
    ):
        return 2
    if top_k_weights.shape != top_k_index.shape or not top_k_weights.dtype.is_floating_point:
        return 3
    if compute_dtype != weight_dtype and hidden.dtype == compute_dtype:
        return 5
    return 0


@dataclass(frozen=True)
class Plan:
    """What the count exchange tells this rank (every number a host int).

    ``counts[s][e]``: pairs rank s routes to expert e; ``rank``, ``size``: this rank and P;
    ``local``: ``E_l``; ``chunks``: C."""

    counts: tuple[tuple[int, ...], ...]
    rank: int
    size: int
    local: int
    chunks: int

    def _owned(self, s: int, j: int) -> tuple[int, ...]:
        """Rank s's counts for rank j's experts."""
        return self.counts[s][j * self.local : (j + 1) * self.local]

    def pair_rows(self, s: int, j: int) -> int:
        """Rows rank s sends rank j in dispatch."""
        return sum(self._owned(s, j))

    def slice_bounds(self, n: int, q: int) -> tuple[int, int]:
        """Slice q of ``n`` rows."""
        c = self.chunks
        return (q * n) // c, ((q + 1) * n) // c

    def send_splits(self, q: int) -> list[int]:
        """Dispatch rows of chunk q to each rank."""
        out = []
        for j in range(self.size):
            a, b = self.slice_bounds(self.pair_rows(self.rank, j), q)
            out.append(b - a)
        return out

    def recv_splits(self, q: int) -> list[int]:
        """Dispatch rows of chunk q from each rank."""
        out = []
        for s in range(self.size):
            a, b = self.slice_bounds(self.pair_rows(s, self.rank), q)
            out.append(b - a)
        return out

    def chunk_rows(self, q: int) -> int:
        """Rows of chunk q over the whole group (0: every rank skips the chunk)."""
        total = 0
        for s in range(self.size):
            for j in range(self.size):
                a, b = self.slice_bounds(self.pair_rows(s, j), q)
                total += b - a
        return total

    def send_ranges(self, q: int) -> list[tuple[int, int]]:
        """The ranges of this rank's sorted rows (by expert) that chunk q sends, rank by rank."""
        out, start = [], 0
        for j in range(self.size):
            n = self.pair_rows(self.rank, j)
            a, b = self.slice_bounds(n, q)
            out.append((start + a, start + b))
            start += n
        return out

    def received_by_expert(self, q: int) -> tuple[list[int], list[tuple[int, int]]]:
        """Chunk q as received (source-major, each source's slice ordered by expert): the
        per-local-expert row counts ``[E_l]`` and, in expert-major order, the
        (start, length) segments of the received buffer that make each expert's rows."""
        segments: list[list[tuple[int, int]]] = [[] for _ in range(self.local)]
        offset = 0
        for s in range(self.size):
            owned = self._owned(s, self.rank)
            a, b = self.slice_bounds(sum(owned), q)
            lo = 0  # expert e of s's block spans [lo, lo + owned[e]) of the pair's rows
            for e, n in enumerate(owned):
                x, y = max(lo, a), min(lo + n, b)
                if y > x:
                    segments[e].append((offset + x - a, y - x))
                lo += n
            offset += b - a
        counts = [sum(n for _, n in seg) for seg in segments]
        return counts, [piece for seg in segments for piece in seg]

    def expert_splits(self, s: int, j: int, q: int) -> list[int]:
        """Chunk q of the rows rank s sends rank j, per local expert of j ``[E_l]`` (the pair's
        rows are ordered by expert, so the slice's counts follow from ``c`` alone)."""
        owned = self._owned(s, j)
        a, b = self.slice_bounds(sum(owned), q)
        out, lo = [], 0
        for n in owned:
            out.append(max(0, min(lo + n, b) - max(lo, a)))
            lo += n
        return out

    def send_counts_by_expert(self, q: int) -> list[int]:
        """Chunk q's dispatch rows to each (rank j, local expert of j), ``[P·E_l]`` j-major."""
        return [n for j in range(self.size) for n in self.expert_splits(self.rank, j, q)]

    def recv_counts_by_expert(self, q: int) -> list[int]:
        """Chunk q's dispatch rows from each (rank s, local expert), ``[P·E_l]`` s-major."""
        return [n for s in range(self.size) for n in self.expert_splits(s, self.rank, q)]

    def tokens(self, s: int, top_k: int) -> int:
        """Rank s's token count ``N`` (its pairs over ``K``)."""
        return sum(self.counts[s]) // max(top_k, 1)

    def global_counts(self) -> list[int]:
        """Pairs routed to each expert over the group ``[E]``."""
        return [sum(col) for col in zip(*self.counts)]


def _raise_verdicts(
    codes: list[int], dtypes: list[int], what: str, reasons: Mapping[int, str] | None = None
) -> None:
    bad: dict[int, list[int]] = {}
    for rank, code in enumerate(codes):
        if code:
            bad.setdefault(code, []).append(rank)
    if bad:
        known = {**_VERDICTS, **(reasons or {})}
        parts = "; ".join(
            f"ranks {ranks}: {known.get(c, f'verdict {c}')}" for c, ranks in sorted(bad.items())
        )
        raise ValueError(f"{what}: {parts} (raised on every rank of the ep group)")
    if len(set(dtypes)) > 1:
        by: dict[str, list[int]] = {}
        for rank, d in enumerate(dtypes):
            by.setdefault(str(_DTYPES[d]) if 0 <= d < len(_DTYPES) else "?", []).append(rank)
        raise ValueError(
            f"{what}: the ranks' rows travel in different dtypes ({by}); run every rank of the "
            "ep group under the same autocast and dtype"
        )


def exchange_counts(
    top_k_index: Tensor,
    verdict: int,
    compute_dtype: torch.dtype,
    num_experts: int,
    group: comm.Group,
    chunks: int,
    what: str,
    reasons: Mapping[int, str] | None = None,
) -> Plan:
    """All-gather this rank's per-expert counts with its verdict and row dtype (the one host
    sync), raise the same error on every rank if any rank's verdict is bad, and return the
    plan. ``chunks``: C (validated by the caller); ``reasons``: the wording of verdict codes
    beyond the input checks' (a dispatcher's per-call limits; the same on every rank)."""
    vec = torch.zeros(num_experts + 2, dtype=torch.int64, device=top_k_index.device)
    if verdict == 0 and top_k_index.numel():
        flat = top_k_index.reshape(-1)
        inside = (flat >= 0) & (flat < num_experts)
        vec[:num_experts] = torch.bincount(flat.clamp(0, num_experts - 1), minlength=num_experts)
        # out of range: verdict 1, read with the counts (no extra sync)
        vec[num_experts] = (~inside.all()).to(torch.int64)
    else:
        vec[num_experts] = verdict
    vec[num_experts + 1] = _DTYPES.index(compute_dtype) if compute_dtype in _DTYPES else 99
    if group.size > 1:
        every = comm.start_all_gather(vec.unsqueeze(0), 0, group, "moe:counts", "forward", OWNER)
        table = every.wait().tolist()
    else:
        table = [vec.tolist()]
    codes = [row[num_experts] for row in table]
    _raise_verdicts(codes, [row[-1] for row in table], what, reasons)
    counts = tuple(tuple(int(n) for n in row[:num_experts]) for row in table)
    return Plan(counts, group.rank, group.size, num_experts // group.size, chunks)
