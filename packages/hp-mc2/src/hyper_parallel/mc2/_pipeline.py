"""The ``torch`` implementation of the MLP block: one pipeline over the row chunks, forward
and backward (README, "Design", "The gated block").

Notation: ``x`` ``[m, D]`` is this rank's rows, ``X = AllGather_m(x)`` ``[ws·m, D]``; the input
projections ``w_in`` are ``(W_g, W_u)`` (gated) or ``(W_u,)`` (plain), each ``[F/ws, D]``, and
``W_d`` ``[D, F/ws]``; their pre-activations ``pre`` are ``(G, U)`` or ``(U,)``. Every step is
row-wise, so chunk j (rows ``off_j … off_j + m_j - 1`` of every rank) runs the whole block while
the collectives of its neighbours are in flight; ``H``, ``dH``, ``dG``, ``dU`` exist one chunk
at a time.
"""

from __future__ import annotations

from typing import Any

import torch

from hyper_parallel.mc2._chunked import Splits, _Gather
from hyper_parallel.mc2._collectives import reduce_scatter_async
from hyper_parallel.mc2._hidden import Act, backward_activation, hidden

__all__ = ["chunk_rows", "pipelined_backward", "pipelined_forward"]


def chunk_rows(t: torch.Tensor, ws: int, off: int, mj: int) -> torch.Tensor:
    """Chunk ``(off, mj)`` of a chunk-major ``[ws·m, k]`` buffer, as ``[ws·m_j, k]``: chunk j
    holds rows ``off … off + m_j - 1`` of every rank, contiguously (ranks in group order)."""
    return t[ws * off : ws * (off + mj)]


def pipelined_forward(
    x: torch.Tensor,
    w_in: tuple[torch.Tensor, ...],
    wd: torch.Tensor,
    b_in: tuple[Any, ...],
    act: Act,
    group: Any,
    ws: int,
    parts: Splits,
    keep_x: bool = False,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor | None]:
    """``(Y, pre, X)`` with ``pre = (G, U)`` (``w_in = (W_g, W_u)``, gated) or ``(U,)``
    (``w_in = (W_u,)``, plain), each ``[ws·m, F/ws]``, and ``X`` ``[ws·m, D]`` the gathered
    input when ``keep_x`` (else ``None``), both chunk-major (:func:`chunk_rows`), one pipeline
    over the row chunks: chunk j is gathered under chunk j-1's input-projection/activation/down
    matmuls, and chunk j's reduce-scatter runs under chunk j+1's (the link carries ``X_{j+1}``
    before ``RS_j``). Only the first gather and the last reduce-scatter have no matmul to hide
    under. ``H`` exists one chunk at a time."""
    m, fl = x.shape[0], w_in[0].shape[0]
    single = len(parts) == 1
    big_x: torch.Tensor | None = None
    if keep_x and not single:  # the chunks are gathered straight into it
        big_x = x.new_empty(ws * m, x.shape[1])
    gather = _Gather(x, group, ws, parts, into=big_x)
    first: torch.Tensor | None = gather.next()
    # allocated once the first chunk has arrived (see _chunked); chunk-major (chunk_rows)
    full = [x.new_empty(ws * m, fl) for _ in w_in]
    y = x.new_empty(m, wd.shape[0])
    pending = []
    for off, mj in parts:
        chunk = first if first is not None else gather.next()  # [ws, m_j, D]
        first = None
        rows = chunk.view(ws * mj, -1)
        pre = []
        for f, w, b in zip(full, w_in, b_in):
            p = torch.mm(rows, w.t(), out=chunk_rows(f, ws, off, mj))  # [ws·m_j, F/ws]
            if b is not None:
                p.add_(b)
            pre.append(p)
        if keep_x and single:
            big_x = rows
        del chunk, rows
        partial = torch.mm(hidden(act, tuple(pre)), wd.t())  # [ws·m_j, D], summed over ranks
        del pre
        pending.append((reduce_scatter_async(y[off : off + mj], partial, group), partial))
        del partial
    for work, _ in pending:
        work.wait()
    return y, tuple(full), big_x


def pipelined_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    pre: tuple[torch.Tensor, ...],
    w_in: tuple[torch.Tensor, ...],
    wd: torch.Tensor,
    act: Act,
    group: Any,
    ws: int,
    parts: Splits,
    need: tuple[bool, ...],
    saved_x: torch.Tensor | None = None,
) -> list[Any]:
    """``[dx, *dW_in, dW_d, *db_in, db_d]`` (``None`` where not needed; ``need`` in the same
    order), one pipeline over the row chunks. Chunk j: ``dY_j`` arrives (``dY_{j+1}``
    starts), ``H_j`` is recomputed, ``dH_j = dY_j W_d``, ``dW_d += dY_jᵀ H_j``, the
    pre-activation gradients (``dG_j``, ``dU_j``; plain: ``dU_j``), ``dx_j = dG_j W_g + dU_j
    W_u`` (plain: ``dU_j W_u``) is reduce-scattered once ``X_j`` (gathered again) has arrived,
    under ``dW += dᵀ X_j`` and the next chunk's work. Only the first ``dY`` chunk has no matmul
    to hide under. The gated form consumes ``pre``. Given ``saved_x`` (``[ws·m, D]``, kept by
    the forward), ``X`` is not gathered again. ``pre`` and ``saved_x`` are chunk-major
    (:func:`chunk_rows`), as :func:`pipelined_forward` returns them."""
    k = len(w_in)
    need_x, need_w, need_wd = need[0], need[1 : 1 + k], need[1 + k]
    need_b, need_bd = need[2 + k : 2 + 2 * k], need[2 + 2 * k]
    m, dm = dy.shape
    fl = w_in[0].shape[0]
    need_act = need_x or any(need_w) or any(need_b)
    gdy = _Gather(dy, group, ws, parts)
    first: torch.Tensor | None = gdy.next()
    gx = _Gather(x, group, ws, parts) if any(need_w) and saved_x is None else None
    dx = dy.new_empty(m, x.shape[1]) if need_x else None
    dw = [dy.new_zeros(w.shape) if n else None for w, n in zip(w_in, need_w)]
    dwd = dy.new_zeros(wd.shape) if need_wd else None
    db = [dy.new_zeros(fl) if n else None for n in need_b]
    dbd = dy.new_zeros(dm) if need_bd else None
    pending = []
    for off, mj in parts:
        dyj = (first if first is not None else gdy.next()).view(ws * mj, dm)
        first = None
        prej = tuple(chunk_rows(p, ws, off, mj) for p in pre)  # [ws·m_j, F/ws] each
        h, pre_grads = backward_activation(act, prej, dwd is not None)
        if dwd is not None and h is not None:
            dwd.addmm_(dyj.t(), h)
        del h
        if dbd is not None:
            dbd.add_(dyj.sum(dim=0))
        if not need_act:
            continue
        dpre = pre_grads(torch.mm(dyj, wd))
        del dyj, prej, pre_grads
        for acc, d in zip(db, dpre):
            if acc is not None:
                acc.add_(d.sum(dim=0))
        partial = None
        if dx is not None:
            partial = torch.mm(dpre[0], w_in[0])  # [ws·m_j, D], summed over ranks below
            for d, w in zip(dpre[1:], w_in[1:]):
                partial.addmm_(d, w)
        xj = gx.next().view(ws * mj, -1) if gx is not None else None
        if saved_x is not None and any(need_w):
            xj = chunk_rows(saved_x, ws, off, mj)
        if dx is not None and partial is not None:
            pending.append((reduce_scatter_async(dx[off : off + mj], partial, group), partial))
            del partial
        if xj is not None:
            for acc, d in zip(dw, dpre):
                if acc is not None:
                    acc.addmm_(d.t(), xj)
            del xj
        del dpre
    for work, _ in pending:
        work.wait()
    return [dx, *dw, dwd, *db, dbd]
