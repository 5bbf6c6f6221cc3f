"""The ``torch`` implementation of the two duals: the dim-0 collectives split into chunks and
overlapped with matmuls, and the chunk count.

Notation (README, "Design"): ``x`` is this rank's ``[m, k]`` rows, ``ws`` the group size,
``X = AllGather_m(x)`` the ``[ws·m, k]`` rows of every rank in group-rank order. Each of the
``m`` local rows is cut into the same ``splits``; chunk ``j`` of ``X`` is ``[ws, m_j, k]``
(rows ``off_j … off_j + m_j - 1`` of every rank). The async collective of one chunk runs
while the matmul of another computes; every chunk count, including 1, gives the same result.

A phase's output buffers are allocated only once its first gathered chunk has arrived (that
chunk has no matmul to hide under anyway): gloo stages an all-gather through a buffer of the
gathered size that lives until the wait, and it should not coincide with the outputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hyper_parallel.mc2._collectives import all_gather_async, reduce_scatter_async

Splits = list[tuple[int, int]]


def default_chunks(rows: int, k: int, n: int, world_size: int, device_type: str = "cpu") -> int:
    """Chunk count of the ``torch`` implementation for a chunked dim of ``rows`` local rows.

    A pure function of the shapes, the group size and the device type, so every rank of a
    group computes the same count and runs the same sequence of collectives (a count read
    from a rank's own CPU affinity or thread count could differ between ranks). Each chunk
    should still be a matmul worth overlapping: >= 64 rows and >= ~134 MFLOP over all ranks'
    rows (``2·rows·ws·k·n / chunks >= 2**27``). Within that, at most 8 chunks on CPU (gloo)
    and 4 on an accelerator. On CPU the cap is what the benchmark's modeled link measured
    (README, "Chunk count"): 8 chunks hide the most of the link at its shapes (4 and 16
    within a few percent, 1 and 2 far behind). The accelerators' 4 is not measured here.
    """
    flops = 2 * rows * world_size * k * n
    cap = 8 if device_type == "cpu" else 4
    return max(1, min(cap, rows // 64, flops // (1 << 27)))


def splits(rows: int, chunks: int) -> Splits:
    """``(offset, length)`` of ``chunks`` near-equal, non-empty pieces of ``rows`` rows."""
    chunks = max(1, min(chunks, rows))
    base, extra = divmod(rows, chunks)
    out, off = [], 0
    for j in range(chunks):
        length = base + (1 if j < extra else 0)
        out.append((off, length))
        off += length
    return out


class _Gather:
    """Chunk-by-chunk ``AllGather_m(x)``: :meth:`next` returns chunk j as ``[ws, m_j, k]``
    after starting chunk j+1, so the gather of j+1 runs under the caller's work on j.

    With ``into`` (a contiguous ``[ws·m, k]``), chunk j is gathered straight into its rows
    ``ws·off_j … ws·(off_j + m_j) - 1`` (chunk-major: each chunk's ``[ws, m_j, k]`` block is
    contiguous), so the whole gathered input is kept without a copy."""

    def __init__(
        self, x: torch.Tensor, group: Any, ws: int, parts: Splits, into: torch.Tensor | None = None
    ) -> None:
        self.x, self.group, self.ws, self.parts, self.into = x, group, ws, parts, into
        self.j = 0
        self.pending = self._start(0)

    def _start(self, j: int) -> tuple[torch.Tensor, Any]:
        off, mj = self.parts[j]
        if self.into is not None:
            buf = self.into[self.ws * off : self.ws * (off + mj)].view(self.ws, mj, -1)
        else:
            buf = self.x.new_empty(self.ws, mj, self.x.shape[1])
        return buf, all_gather_async(buf.view(self.ws * mj, -1), self.x[off : off + mj], self.group)

    def next(self) -> torch.Tensor:
        buf, work = self.pending
        work.wait()
        self.j += 1
        if self.j < len(self.parts):
            self.pending = self._start(self.j)
        return buf


def gather_matmuls(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    group: Any,
    ws: int,
    parts: Splits,
    *,
    keep: bool,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``[X @ Wᵢᵀ for Wᵢ in weights]`` (each ``[ws·m, n_i]``), one gather of ``X`` shared by
    every weight. Returns the products and, when ``keep``, the gathered chunks (for dW)."""
    m = x.shape[0]
    gather = _Gather(x, group, ws, parts)
    first: torch.Tensor | None = gather.next()
    outs = [x.new_empty(ws * m, w.shape[0]) for w in weights]
    kept = []
    for off, mj in parts:
        chunk = first if first is not None else gather.next()
        first = None
        for w, out in zip(weights, outs):
            if len(parts) == 1:
                torch.mm(chunk.view(ws * m, -1), w.t(), out=out)
            else:
                out.view(ws, m, -1)[:, off : off + mj] = torch.matmul(chunk, w.t())
        if keep:
            kept.append(chunk)
        del chunk
    return outs, kept


def matmuls_reduce_scatter_grads(
    dys: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor],
    x: torch.Tensor | None,
    kept: Sequence[torch.Tensor],
    group: Any,
    ws: int,
    parts: Splits,
    *,
    need_dx: bool,
    need_dw: Sequence[bool],
) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    """Backward of :func:`gather_matmuls`: ``dX = ReduceScatter_m(Σᵢ dYᵢ @ Wᵢ)`` ``[m, k]`` and
    ``dWᵢ = dYᵢᵀ @ X``. ``X`` comes from ``kept`` chunks, or is gathered again from ``x``
    chunk by chunk (``kept`` empty) under chunk j's dX matmul. Chunk j's dX is reduce-scattered
    under chunk j's dW matmuls; it is launched once chunk j of ``X`` has arrived, so gloo's
    staging buffers of the two collectives are never live together."""
    k = weights[0].shape[1]
    m = dys[0].shape[0] // ws
    gather = _Gather(x, group, ws, parts) if any(need_dw) and not kept and x is not None else None
    dx = dys[0].new_empty(m, k) if need_dx else None
    dws = [dy.new_zeros(w.shape) if need else None for dy, w, need in zip(dys, weights, need_dw)]
    single = len(parts) == 1
    pending = []
    for j, (off, mj) in enumerate(parts):
        dyjs = [dy.view(ws, m, -1)[:, off : off + mj] for dy in dys]
        partial = None
        if dx is not None:
            partial = torch.matmul(dyjs[0], weights[0])  # [ws, m_j, k], summed over ranks below
            for dyj, w in zip(dyjs[1:], weights[1:]):
                partial.baddbmm_(dyj, w.expand(ws, *w.shape))
        xj = None
        if any(need_dw):
            xj = (gather.next() if gather is not None else kept[j]).view(ws * mj, k)
        if dx is not None and partial is not None:
            pending.append((reduce_scatter_async(dx[off : off + mj], partial, group), partial))
            del partial
        if xj is not None:
            for dyj, dw in zip(dyjs, dws):
                if dw is not None:
                    g = dyj.reshape(ws * mj, -1) if not single else dyj.view(ws * mj, -1)
                    dw.addmm_(g.t(), xj)
            del xj
    for work, _ in pending:
        work.wait()
    return dx, dws


def matmul_reduce_scatter_fwd(
    x: torch.Tensor, weight: torch.Tensor, group: Any, ws: int, parts: Splits
) -> torch.Tensor:
    """``Y = ReduceScatter_m(x @ Wᵀ)`` ``[m/ws, n]`` for ``x`` ``[m, k]``: chunk j's
    reduce-scatter runs under chunk j+1's matmul."""
    m, k = x.shape
    mo, n = m // ws, weight.shape[0]
    wt = weight.t()
    x3 = x.view(ws, mo, k)
    y = x.new_empty(mo, n)
    pending = []
    for off, mj in parts:
        partial = torch.mm(x, wt) if len(parts) == 1 else torch.matmul(x3[:, off : off + mj], wt)
        pending.append((reduce_scatter_async(y[off : off + mj], partial, group), partial))
        del partial
    for work, _ in pending:
        work.wait()
    return y


def matmul_reduce_scatter_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    group: Any,
    ws: int,
    parts: Splits,
    *,
    need_dx: bool,
    need_dw: bool,
    need_db: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Backward of :func:`matmul_reduce_scatter_fwd`: ``dY_full = AllGather_m(dY)`` chunk by
    chunk (chunk j+1 gathers under chunk j's work), ``dX = dY_full @ W`` ``[m, k]``,
    ``dW = dY_fullᵀ @ x``, ``db = Σ_m dY_full``."""
    n, k = weight.shape
    mo = dy.shape[0]
    gather = _Gather(dy, group, ws, parts)
    first: torch.Tensor | None = gather.next()
    dx = dy.new_empty(ws * mo, k) if need_dx else None
    dw = dy.new_zeros(n, k) if need_dw else None
    db = dy.new_zeros(n) if need_db else None
    x3 = x.view(ws, mo, k)
    single = len(parts) == 1
    for off, mj in parts:
        g = first if first is not None else gather.next()
        first = None
        if dx is not None:
            if single:
                torch.mm(g.view(ws * mo, n), weight, out=dx)
            else:
                dx.view(ws, mo, k)[:, off : off + mj] = torch.matmul(g, weight)
        if dw is not None:
            xj = x if single else x3[:, off : off + mj].reshape(ws * mj, k)
            dw.addmm_(g.view(ws * mj, n).t(), xj)
        if db is not None:
            db.add_(g.sum(dim=(0, 1)))
        del g
    return dx, dw, db
