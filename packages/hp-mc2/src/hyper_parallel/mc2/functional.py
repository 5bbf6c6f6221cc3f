"""The two duals as autograd functions on local 2-D tensors.

Notation (README, "Design"): ``W`` in ``nn.Linear`` layout ``(out, in)``, ``ws`` the group size;
gathers concatenate in group-rank order along dim 0.

- ``all_gather_matmul`` (column parallel): forward ``Y = AllGather_m(x) @ Wᵀ + b``;
  backward ``dX = ReduceScatter_m(dY @ W)``, ``dW = dYᵀ @ AllGather_m(x)``, ``db = Σ_m dY``.
- ``matmul_reduce_scatter`` (row parallel): forward ``Y = ReduceScatter_m(x @ Wᵀ) + b``;
  backward ``dY_full = AllGather_m(dY)``, ``dX = dY_full @ W``, ``dW = dY_fullᵀ @ x``,
  ``db = Σ_m dY_full``.

Each dual is one autograd function that calls the chosen implementation's methods
(:class:`~hyper_parallel.mc2.impls.MC2Impl`: ``column_forward``/``column_backward``,
``row_forward``/``row_backward``): ``torch`` splits the gathered/scattered dim into chunks and
runs the async collective of one chunk while the matmul of another computes, ``npu`` calls the
fused torch_npu kernels. Bias is always added here, outside the collective (the NPU kernels
only accept a zero bias).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hyper_parallel.dtensor.amp import autocast_off, cast_for_autocast, without_autocast
from hyper_parallel.dtensor.consistency import checked_entry
from hyper_parallel.mc2._chunked import default_chunks
from hyper_parallel.mc2._keywords import impl_keyword
from hyper_parallel.mc2._operands import validate_operands
from hyper_parallel.mc2.impls import IMPLS, Call, MC2Impl, check_impl_choice, select_impl

__all__ = ["all_gather_matmul", "matmul_reduce_scatter"]


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        impl: MC2Impl,
        call: Call,
    ) -> torch.Tensor:
        x, weight = x.contiguous(), weight.contiguous()
        y, kept, ctx.state = impl.column_forward(call, x, weight, keep_x=ctx.needs_input_grad[1])
        ctx.impl = impl
        if bias is not None:
            y.add_(bias)
        ctx.save_for_backward(weight, *kept)
        return y

    @staticmethod
    @without_autocast
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        weight, *kept = ctx.saved_tensors
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dy = dy.contiguous()
        dx = dw = None
        if need_dx or need_dw:
            dx, dw = ctx.impl.column_backward(
                ctx.state, dy, weight, kept, need_dx=need_dx, need_dw=need_dw
            )
        db = dy.sum(0) if need_db else None
        return dx, dw, db, None, None


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        impl: MC2Impl,
        call: Call,
    ) -> torch.Tensor:
        x, weight = x.contiguous(), weight.contiguous()
        y, ctx.state = impl.row_forward(call, x, weight)
        ctx.impl = impl
        if bias is not None:
            y.add_(bias)
        ctx.save_for_backward(x, weight)
        return y

    @staticmethod
    @without_autocast
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dy = dy.contiguous()
        dx = dw = db = None
        if need_dx or need_dw or need_db:
            dx, dw, db = ctx.impl.row_backward(
                ctx.state, dy, x, weight, need_dx=need_dx, need_dw=need_dw, need_db=need_db
            )
        return dx, dw, db, None, None


def _prepare(
    op: Any,
    x: torch.Tensor,
    weight: torch.Tensor,
    group: Any,
    bias: torch.Tensor | None,
    impl: str,
    chunks: int | None,
) -> tuple[str, int]:
    """Validate (local, the same on every rank for same-shaped operands), choose the
    implementation and the chunk count."""
    ws = dist.get_world_size(group)
    check_impl_choice(impl)
    validate_operands(op, x, weight, bias, ws, chunks)
    choice, _ = select_impl(impl, op, lambda i: i.failure(op, x, weight, group))
    if chunks is None:
        rows = x.shape[0] if op == "all_gather_matmul" else x.shape[0] // ws
        chunks = default_chunks(rows, x.shape[1], weight.shape[0], ws, x.device.type)
    return choice, chunks


def dual_fields(
    op: Any,
    x: Any,
    weight: Any,
    group: Any,
    bias: Any,
    impl: str,
    chunks: int | None,
) -> dict[str, Any]:
    """What the ranks compare for one dual (consistency mode): the operands as the dual sees
    them (under autocast: cast), the chosen implementation, the chunk count and the group size.
    Only reads (hp-dtensor's ``checked_entry`` guards it); the choice of operands the dual
    rejects is its verdict, ``"<ErrorType>"`` (the body then raises that error on every rank
    that agreed)."""
    ws = dist.get_world_size(group)
    x, weight, bias = cast_for_autocast(x.device.type, x, weight, bias)
    try:
        choice, chunks = _prepare(op, x, weight, group, bias, impl, chunks)
    except Exception as exc:  # the verdict: the body raises it, after the comparison
        choice = f"<{type(exc).__name__}>"
    return {
        "x": x, "weight": weight, "bias": bias, "impl": choice, "chunks": chunks,
        "world_size": ws,
    }  # fmt: skip


def _run(
    fn: Any,
    op: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    group: Any,
    bias: torch.Tensor | None,
    impl: str,
    chunks: int | None,
) -> torch.Tensor:
    """The autograd function ``fn`` of ``op`` with the chosen implementation; under autocast
    the operands in its dtype and the function with autocast off (``dtensor.amp``)."""
    x, weight, bias = cast_for_autocast(x.device.type, x, weight, bias)
    choice, chunks = _prepare(op, x, weight, group, bias, impl, chunks)
    call = Call(group, dist.get_world_size(group), chunks)
    with autocast_off(x.device.type):
        return fn.apply(x, weight, bias, IMPLS[choice], call)


def _column(
    x: torch.Tensor,
    weight: torch.Tensor,
    group: Any,
    bias: torch.Tensor | None,
    impl: str,
    chunks: int | None,
) -> torch.Tensor:
    return _run(_AllGatherMatmul, "all_gather_matmul", x, weight, group, bias, impl, chunks)


def _row(
    x: torch.Tensor,
    weight: torch.Tensor,
    group: Any,
    bias: torch.Tensor | None,
    impl: str,
    chunks: int | None,
) -> torch.Tensor:
    return _run(_MatmulReduceScatter, "matmul_reduce_scatter", x, weight, group, bias, impl, chunks)


def _dual(op: str) -> Any:
    """The consistency fields of the dual ``op``'s call (``checked_entry``'s ``extra``)."""
    return lambda a: dual_fields(op, a.x, a.weight, a.group, a.bias, a.impl, a.chunks)


@impl_keyword("all_gather_matmul")
@checked_entry("all_gather_matmul", group="group", extra=_dual("all_gather_matmul"))
def all_gather_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    group: Any = None,
    *,
    bias: torch.Tensor | None = None,
    impl: str = "auto",
    chunks: int | None = None,
) -> torch.Tensor:
    """Column-parallel linear on a row-sharded input: ``Y = AllGather_m(x) @ Wᵀ + b``.

    Args:
        x: ``[m, k]``, this rank's rows; rank ``r`` holds rows ``r·m … (r+1)·m - 1`` of the
            gathered ``[m·ws, k]`` input.
        weight: ``[n_local, k]``, this rank's output-feature shard (``nn.Linear`` layout).
        group: the tensor-parallel process group (``None``: the default group).
        bias: ``[n_local]``, this rank's bias shard, or ``None``.
        impl: the matmul+collective implementation, ``"auto"``, ``"torch"`` or ``"npu"``
            (see :func:`~hyper_parallel.mc2.select_backend`; ``backend=`` is its deprecated
            name).
        chunks: ``torch`` implementation only: number of pieces ``m`` is split into so the gather of
            one overlaps the matmul of another (``None``: chosen from the shapes; 1: no overlap).

    Returns:
        ``[m·ws, n_local]`` on every rank: all rows, this rank's output features.
        Backward gives ``dX = ReduceScatter_m(dY @ W)`` ``[m, k]``, ``dW = dYᵀ @ AllGather_m(x)``
        and ``db = Σ_m dY`` (both this rank's shard).

    Consistency mode (hp-dtensor's README, "Ranks that disagree"): the ranks of ``group``
    compare ``x``, ``weight``, ``bias``, the chosen ``impl``, ``chunks`` and the group size.
    """
    return _column(x, weight, group, bias, impl, chunks)


@impl_keyword("matmul_reduce_scatter")
@checked_entry("matmul_reduce_scatter", group="group", extra=_dual("matmul_reduce_scatter"))
def matmul_reduce_scatter(
    x: torch.Tensor,
    weight: torch.Tensor,
    group: Any = None,
    *,
    bias: torch.Tensor | None = None,
    impl: str = "auto",
    chunks: int | None = None,
) -> torch.Tensor:
    """Row-parallel linear with a row-scattered output: ``Y = ReduceScatter_m(x @ Wᵀ) + b``.

    Args:
        x: ``[m, k_local]``, all rows, this rank's slice of the input features; ``m`` must be
            divisible by ``ws``.
        weight: ``[n, k_local]``, this rank's input-feature shard (``nn.Linear`` layout).
        group: the tensor-parallel process group (``None``: the default group).
        bias: ``[n]``, the full bias, replicated on every rank, or ``None``.
        impl: ``"auto"``, ``"torch"`` or ``"npu"`` (``backend=``: deprecated name).
        chunks: ``torch`` implementation only: number of pieces each rank's ``m/ws`` output rows are
            split into (``None``: chosen from the shapes).

    Returns:
        ``[m/ws, n]``: rank ``r`` holds rows ``r·m/ws … (r+1)·m/ws - 1`` of the summed product.
        Backward gathers ``dY_full = AllGather_m(dY)`` and gives ``dX = dY_full @ W``,
        ``dW = dY_fullᵀ @ x`` and ``db = Σ_m dY_full`` (the full, replicated bias gradient).

    Consistency mode (hp-dtensor's README, "Ranks that disagree"): the fields of
    :func:`all_gather_matmul`.
    """
    return _row(x, weight, group, bias, impl, chunks)
