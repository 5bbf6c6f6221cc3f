"""The two duals as autograd functions on local 2-D tensors.

Notation (spec-mc2): ``W`` in ``nn.Linear`` layout ``(out, in)``, ``ws`` the group size;
gathers concatenate in group-rank order along dim 0.

- ``all_gather_matmul`` (column parallel): forward ``Y = AllGather_m(x) @ Wᵀ + b``;
  backward ``dX = ReduceScatter_m(dY @ W)``, ``dW = dYᵀ @ AllGather_m(x)``, ``db = Σ_m dY``.
- ``matmul_reduce_scatter`` (row parallel): forward ``Y = ReduceScatter_m(x @ Wᵀ) + b``;
  backward ``dY_full = AllGather_m(dY)``, ``dX = dY_full @ W``, ``dW = dY_fullᵀ @ x``,
  ``db = Σ_m dY_full``.

The ``torch`` backend splits the gathered/scattered dim into chunks and runs the async
collective of one chunk while the matmul of another computes. The ``npu`` backend calls the
fused torch_npu kernels through :mod:`hyper_parallel.mc2.npu_ops`. Bias is always added
outside the collective (the NPU kernels only accept a zero bias).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hyper_parallel.mc2._collectives import all_gather_async, reduce_scatter_async
from hyper_parallel.mc2.backend import default_chunks, select_backend, validate_operands
from hyper_parallel.mc2.npu_ops import current_npu_ops

__all__ = ["all_gather_matmul", "matmul_reduce_scatter"]


def _splits(rows: int, chunks: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of ``chunks`` near-equal, non-empty pieces of ``rows`` rows."""
    chunks = max(1, min(chunks, rows))
    base, extra = divmod(rows, chunks)
    out, off = [], 0
    for j in range(chunks):
        length = base + (1 if j < extra else 0)
        out.append((off, length))
        off += length
    return out


# ---------------------------------------------------------------------------------------------
# torch backend: chunked, overlapped decompositions
# ---------------------------------------------------------------------------------------------


def _ag_mm_forward(
    x: torch.Tensor, weight: torch.Tensor, group: Any, ws: int, splits: list[tuple[int, int]]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``Y = AllGather_m(x) @ Wᵀ`` with chunk j+1 gathering under chunk j's matmul. Returns Y
    and the gathered chunks (``[ws, m_j, k]`` each) for dW."""
    m, k = x.shape
    n = weight.shape[0]
    wt = weight.t()
    parts = [x.new_empty(ws, mj, k) for _, mj in splits]

    def start(j: int) -> Any:
        off, mj = splits[j]
        return all_gather_async(parts[j].view(ws * mj, k), x[off : off + mj], group)

    y = x.new_empty(ws * m, n)
    y3 = y.view(ws, m, n)
    work = start(0)
    for j, (off, mj) in enumerate(splits):
        work.wait()
        if j + 1 < len(splits):
            work = start(j + 1)
        if len(splits) == 1:
            torch.mm(parts[0].view(ws * m, k), wt, out=y)
        else:
            y3[:, off : off + mj] = torch.matmul(parts[j], wt)
    return y, parts


def _ag_mm_backward(
    dy: torch.Tensor,
    weight: torch.Tensor,
    parts: list[torch.Tensor],
    group: Any,
    ws: int,
    splits: list[tuple[int, int]],
    need_dx: bool,
    need_dw: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """dX chunk j is reduce-scattered while dW's chunk j (and dX's chunk j+1) computes."""
    n, k = weight.shape
    m = sum(mj for _, mj in splits)
    dy3 = dy.view(ws, m, n)
    dx = dy.new_empty(m, k) if need_dx else None
    dw = dy.new_zeros(n, k) if need_dw else None
    pending = []
    for j, (off, mj) in enumerate(splits):
        dyj = dy3 if len(splits) == 1 else dy3[:, off : off + mj]
        if dx is not None:
            partial = torch.matmul(dyj, weight)  # [ws, m_j, k], summed over ranks below
            pending.append((reduce_scatter_async(dx[off : off + mj], partial, group), partial))
        if dw is not None:
            dw.addmm_(dyj.reshape(ws * mj, n).t(), parts[j].view(ws * mj, k))
    for work, _ in pending:
        work.wait()
    return dx, dw


def _mm_rs_forward(
    x: torch.Tensor, weight: torch.Tensor, group: Any, ws: int, splits: list[tuple[int, int]]
) -> torch.Tensor:
    """``Y = ReduceScatter_m(x @ Wᵀ)``: chunk j's reduce-scatter runs under chunk j+1's matmul."""
    m, k = x.shape
    mo, n = m // ws, weight.shape[0]
    wt = weight.t()
    x3 = x.view(ws, mo, k)
    y = x.new_empty(mo, n)
    pending = []
    for off, mj in splits:
        partial = torch.mm(x, wt) if len(splits) == 1 else torch.matmul(x3[:, off : off + mj], wt)
        pending.append((reduce_scatter_async(y[off : off + mj], partial, group), partial))
    for work, _ in pending:
        work.wait()
    return y


def _mm_rs_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    group: Any,
    ws: int,
    splits: list[tuple[int, int]],
    need_dx: bool,
    need_dw: bool,
    need_db: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``dY_full = AllGather_m(dY)`` chunk by chunk; chunk j+1 gathers under chunk j's dX/dW."""
    n, k = weight.shape
    mo = dy.shape[0]
    parts = [dy.new_empty(ws, mj, n) for _, mj in splits]

    def start(j: int) -> Any:
        off, mj = splits[j]
        return all_gather_async(parts[j].view(ws * mj, n), dy[off : off + mj], group)

    dx = dy.new_empty(ws * mo, k) if need_dx else None
    dw = dy.new_zeros(n, k) if need_dw else None
    db = dy.new_zeros(n) if need_db else None
    x3 = x.view(ws, mo, k)
    work = start(0)
    for j, (off, mj) in enumerate(splits):
        work.wait()
        if j + 1 < len(splits):
            work = start(j + 1)
        g = parts[j]
        single = len(splits) == 1
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
    return dx, dw, db


# ---------------------------------------------------------------------------------------------
# autograd functions (dispatching to the torch or npu backend)
# ---------------------------------------------------------------------------------------------


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: Any,
        backend: str,
        chunks: int,
    ) -> torch.Tensor:
        ws = dist.get_world_size(group)
        x = x.contiguous()
        weight = weight.contiguous()
        ctx.group, ctx.ws, ctx.backend, ctx.has_bias = group, ws, backend, bias is not None
        if backend == "npu":
            ops = current_npu_ops()
            hcom = ops.comm_name(group)
            y, gathered = ops.npu_all_gather_base_mm(
                x, weight.t(), hcom, ws, bias=None, gather_index=0, gather_output=True
            )
            ctx.ops, ctx.hcom = ops, hcom
            parts = [gathered.view(ws, x.shape[0], x.shape[1])]
            ctx.splits = [(0, x.shape[0])]
        else:
            ctx.splits = _splits(x.shape[0], chunks)
            y, parts = _ag_mm_forward(x, weight, group, ws, ctx.splits)
        if bias is not None:
            y.add_(bias)
        ctx.save_for_backward(weight, *(parts if ctx.needs_input_grad[1] else ()))
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        weight, *parts = ctx.saved_tensors
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dy = dy.contiguous()
        dx = dw = None
        if ctx.backend == "npu":
            if need_dx:
                dx = ctx.ops.npu_mm_reduce_scatter_base(
                    dy, weight, ctx.hcom, ctx.ws, reduce_op="sum", bias=None
                )
            if need_dw:
                dw = dy.t() @ parts[0].view(-1, weight.shape[1])
        elif need_dx or need_dw:
            dx, dw = _ag_mm_backward(
                dy, weight, parts, ctx.group, ctx.ws, ctx.splits, need_dx, need_dw
            )
        db = dy.sum(0) if need_db else None
        return dx, dw, db, None, None, None


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: Any,
        backend: str,
        chunks: int,
    ) -> torch.Tensor:
        ws = dist.get_world_size(group)
        x = x.contiguous()
        weight = weight.contiguous()
        ctx.group, ctx.ws, ctx.backend = group, ws, backend
        if backend == "npu":
            ops = current_npu_ops()
            hcom = ops.comm_name(group)
            y = ops.npu_mm_reduce_scatter_base(x, weight.t(), hcom, ws, reduce_op="sum", bias=None)
            ctx.ops, ctx.hcom = ops, hcom
        else:
            ctx.splits = _splits(x.shape[0] // ws, chunks)
            y = _mm_rs_forward(x, weight, group, ws, ctx.splits)
        if bias is not None:
            y.add_(bias)
        ctx.save_for_backward(x, weight)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dy = dy.contiguous()
        dx = dw = db = None
        if ctx.backend == "npu":
            if need_dx or need_dw or need_db:
                dx, dy_full = ctx.ops.npu_all_gather_base_mm(
                    dy, weight, ctx.hcom, ctx.ws, bias=None, gather_index=0, gather_output=True
                )
                dw = dy_full.t() @ x if need_dw else None
                db = dy_full.sum(0) if need_db else None
                dx = dx if need_dx else None
        elif need_dx or need_dw or need_db:
            dx, dw, db = _mm_rs_backward(
                dy, x, weight, ctx.group, ctx.ws, ctx.splits, need_dx, need_dw, need_db
            )
        return dx, dw, db, None, None, None


def _prepare(
    op: Any,
    x: torch.Tensor,
    weight: torch.Tensor,
    group: Any,
    bias: torch.Tensor | None,
    backend: str,
    chunks: int | None,
) -> tuple[str, int]:
    ws = dist.get_world_size(group)
    validate_operands(op, x, weight, bias, ws, backend, chunks)
    choice, _ = select_backend(op, x, weight, group, backend=backend)
    if chunks is None:
        rows = x.shape[0] if op == "all_gather_matmul" else x.shape[0] // ws
        chunks = default_chunks(rows, x.shape[1], weight.shape[0], ws, x.device.type)
    return choice, chunks


def all_gather_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    group: Any = None,
    *,
    bias: torch.Tensor | None = None,
    backend: str = "auto",
    chunks: int | None = None,
) -> torch.Tensor:
    """Column-parallel linear on a row-sharded input: ``Y = AllGather_m(x) @ Wᵀ + b``.

    Args:
        x: ``[m, k]``, this rank's rows; rank ``r`` holds rows ``r·m … (r+1)·m - 1`` of the
            gathered ``[m·ws, k]`` input.
        weight: ``[n_local, k]``, this rank's output-feature shard (``nn.Linear`` layout).
        group: the tensor-parallel process group (``None``: the default group).
        bias: ``[n_local]``, this rank's bias shard, or ``None``.
        backend: ``"auto"``, ``"torch"`` or ``"npu"`` (see :func:`select_backend`).
        chunks: ``torch`` backend only: number of pieces ``m`` is split into so the gather of
            one overlaps the matmul of another (``None``: chosen from the shapes; 1: no overlap).

    Returns:
        ``[m·ws, n_local]`` on every rank: all rows, this rank's output features.
        Backward gives ``dX = ReduceScatter_m(dY @ W)`` ``[m, k]``, ``dW = dYᵀ @ AllGather_m(x)``
        and ``db = Σ_m dY`` (both this rank's shard).
    """
    choice, chunks = _prepare("all_gather_matmul", x, weight, group, bias, backend, chunks)
    return _AllGatherMatmul.apply(x, weight, bias, group, choice, chunks)


def matmul_reduce_scatter(
    x: torch.Tensor,
    weight: torch.Tensor,
    group: Any = None,
    *,
    bias: torch.Tensor | None = None,
    backend: str = "auto",
    chunks: int | None = None,
) -> torch.Tensor:
    """Row-parallel linear with a row-scattered output: ``Y = ReduceScatter_m(x @ Wᵀ) + b``.

    Args:
        x: ``[m, k_local]``, all rows, this rank's slice of the input features; ``m`` must be
            divisible by ``ws``.
        weight: ``[n, k_local]``, this rank's input-feature shard (``nn.Linear`` layout).
        group: the tensor-parallel process group (``None``: the default group).
        bias: ``[n]``, the full bias, replicated on every rank, or ``None``.
        backend: ``"auto"``, ``"torch"`` or ``"npu"``.
        chunks: ``torch`` backend only: number of pieces each rank's ``m/ws`` output rows are
            split into (``None``: chosen from the shapes).

    Returns:
        ``[m/ws, n]``: rank ``r`` holds rows ``r·m/ws … (r+1)·m/ws - 1`` of the summed product.
        Backward gathers ``dY_full = AllGather_m(dY)`` and gives ``dX = dY_full @ W``,
        ``dW = dY_fullᵀ @ x`` and ``db = Σ_m dY_full`` (the full, replicated bias gradient).
    """
    choice, chunks = _prepare("matmul_reduce_scatter", x, weight, group, bias, backend, chunks)
    return _MatmulReduceScatter.apply(x, weight, bias, group, choice, chunks)
