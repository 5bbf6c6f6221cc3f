"""The gated MLP block of a tensor + sequence parallel layer as one autograd function.

Notation (README, "Design"): ``x`` ``[m, D]`` is this rank's rows, ``X = AllGather_m(x)``
``[ws·m, D]``; ``W_g, W_u`` ``[F/ws, D]`` and ``W_d`` ``[D, F/ws]`` are this rank's shards.

    G = X W_gᵀ + b_g,   U = X W_uᵀ + b_u,   H = act(G) ⊙ U,   Y = ReduceScatter_m(H W_dᵀ) + b_d

Backward, with ``dY_full = AllGather_m(dY)``:

    dH = dY_full W_d,   dW_d = dY_fullᵀ H,   db_d = Σ dY_full
    dU = dH ⊙ act(G),   dG = act'(G) ⊙ dH ⊙ U,   db_g = Σ dG,   db_u = Σ dU
    dx = ReduceScatter_m(dG W_g + dU W_u),   dW_g = dGᵀ X,   dW_u = dUᵀ X

One gather of ``X`` feeds both gate and up. Saved for backward: ``G`` and ``U`` only (not
``X``, not ``act(G)``, not ``H``): ``H`` and ``act(G)`` are recomputed (one per-element pass)
and ``X`` is gathered again in backward, under the ``dx`` matmuls (README, "Design", for the
measurement behind this choice). ``act'`` comes from autograd on the module's own ``act``,
which must be per-element (:mod:`hyper_parallel.mc2.activation`).

The same pipeline, with no gate, is the plain block ``H = act(U)`` of
:func:`~hyper_parallel.mc2.mlp_block` (:mod:`hyper_parallel.mc2.mlp`): the functions here take
the input projections as a tuple, ``(W_g, W_u)`` or ``(W_u,)``, and the pre-activations they
save likewise, ``(G, U)`` or ``(U,)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hyper_parallel.dtensor.amp import autocast_off, cast_for_autocast, without_autocast
from hyper_parallel.dtensor.consistency import checked_entry
from hyper_parallel.mc2._chunked import Splits, _Gather, splits
from hyper_parallel.mc2._collectives import all_gather_async, reduce_scatter_async
from hyper_parallel.mc2._keywords import impl_keyword
from hyper_parallel.mc2.activation import check_elementwise_activation
from hyper_parallel.mc2.backend import (
    BACKENDS,
    default_chunks,
    dtype_name,
    npu_constraint_failure,
    validate_operands,
)
from hyper_parallel.mc2.npu_ops import current_npu_ops

__all__ = [
    "gated_fields",
    "select_block_backend",
    "validate_block_operands",
    "gated_mlp",
    "run_gated_mlp",
    "select_gated_backend",
    "validate_gated_operands",
]

Act = Callable[[torch.Tensor], torch.Tensor]


def _gated(act: Act, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``H = act(G) ⊙ U`` without touching ``G`` (an identity ``act`` returns ``G`` itself)."""
    a = act(g)
    if a.untyped_storage().data_ptr() == g.untyped_storage().data_ptr():
        return a * u
    return a.mul_(u)


def _hidden(act: Act, pre: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``H`` from the pre-activations: ``act(G) ⊙ U`` (gated, ``pre = (G, U)``) or ``act(U)``
    (plain, ``pre = (U,)``); neither is overwritten."""
    return _gated(act, pre[0], pre[1]) if len(pre) == 2 else act(pre[0])


def _backward_activation(
    act: Act, pre: tuple[torch.Tensor, ...], need_h: bool
) -> tuple[torch.Tensor | None, Callable[[torch.Tensor], tuple[Any, ...]]]:
    """``(H, grads)`` for backward, with ``act`` evaluated once for both: ``H`` as
    :func:`_hidden` (the ``dW_d`` operand; ``None`` unless ``need_h``) and ``grads(dH)``, the
    pre-activation gradients ``(dG, dU)`` (gated) or ``(dU,) = (act'(U) ⊙ dH,)`` (plain),
    ``act'`` from autograd on ``act``. The gated ``grads`` consumes ``U`` and ``dH``
    (overwritten in place); call it at most once."""
    with torch.enable_grad():
        p_ = pre[0].detach().requires_grad_()
        a = act(p_)
    if len(pre) == 1:
        return (a.detach() if need_h else None), lambda dh: torch.autograd.grad(a, p_, dh)
    u = pre[1]
    h = a.detach() * u if need_h else None

    def grads(dh: torch.Tensor) -> tuple[Any, ...]:
        # dH ⊙ U, in U's storage unless U shares G's (the npu path's [G | U]): autograd saved G
        shared = u.untyped_storage().data_ptr() == pre[0].untyped_storage().data_ptr()
        gu = u * dh if shared else u.mul_(dh)
        du = dh.mul_(a.detach())  # dH ⊙ act(G), in dH's storage
        (dg,) = torch.autograd.grad(a, p_, gu)
        return dg, du

    return h, grads


def _chunk_rows(t: torch.Tensor, ws: int, off: int, mj: int) -> torch.Tensor:
    """Chunk ``(off, mj)`` of a chunk-major ``[ws·m, k]`` buffer, as ``[ws·m_j, k]``: chunk j
    holds rows ``off … off + m_j - 1`` of every rank, contiguously (ranks in group order)."""
    return t[ws * off : ws * (off + mj)]


def _pipelined_forward(
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
    """``torch`` backend forward, ``(Y, pre, X)`` with ``pre = (G, U)`` (``w_in = (W_g, W_u)``,
    gated) or ``(U,)`` (``w_in = (W_u,)``, plain), each ``[ws·m, F/ws]``, and ``X``
    ``[ws·m, D]`` the gathered input when ``keep_x`` (else ``None``), both chunk-major
    (:func:`_chunk_rows`), one pipeline over the row chunks: chunk j is
    gathered under chunk j-1's input-projection/activation/down matmuls, and chunk j's
    reduce-scatter runs under chunk j+1's (the link carries ``X_{j+1}`` before ``RS_j``). Only
    the first gather and the last reduce-scatter have no matmul to hide under. ``H`` exists one
    chunk at a time."""
    m, fl = x.shape[0], w_in[0].shape[0]
    single = len(parts) == 1
    big_x: torch.Tensor | None = None
    if keep_x and not single:  # the chunks are gathered straight into it
        big_x = x.new_empty(ws * m, x.shape[1])
    gather = _Gather(x, group, ws, parts, into=big_x)
    first: torch.Tensor | None = gather.next()
    # allocated once the first chunk has arrived (see _chunked); chunk-major (_chunk_rows)
    full = [x.new_empty(ws * m, fl) for _ in w_in]
    y = x.new_empty(m, wd.shape[0])
    pending = []
    for off, mj in parts:
        chunk = first if first is not None else gather.next()  # [ws, m_j, D]
        first = None
        rows = chunk.view(ws * mj, -1)
        pre = []
        for f, w, b in zip(full, w_in, b_in):
            p = torch.mm(rows, w.t(), out=_chunk_rows(f, ws, off, mj))  # [ws·m_j, F/ws]
            if b is not None:
                p.add_(b)
            pre.append(p)
        if keep_x and single:
            big_x = rows
        del chunk, rows
        partial = torch.mm(_hidden(act, tuple(pre)), wd.t())  # [ws·m_j, D], summed over ranks
        del pre
        pending.append((reduce_scatter_async(y[off : off + mj], partial, group), partial))
        del partial
    for work, _ in pending:
        work.wait()
    return y, tuple(full), big_x


def _pipelined_backward(
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
    """``torch`` backend backward, ``[dx, *dW_in, dW_d, *db_in, db_d]`` (``None`` where not
    needed; ``need`` in the same order), one pipeline over the row chunks. Chunk j: ``dY_j``
    arrives (``dY_{j+1}`` starts), ``H_j`` is recomputed, ``dH_j = dY_j W_d``,
    ``dW_d += dY_jᵀ H_j``, the pre-activation gradients (``dG_j``, ``dU_j``; plain: ``dU_j``),
    ``dx_j = dG_j W_g + dU_j W_u`` (plain: ``dU_j W_u``) is reduce-scattered once ``X_j``
    (gathered again) has arrived, under ``dW += dᵀ X_j`` and the next chunk's work. Only the
    first ``dY`` chunk has no matmul to hide under. The gated form consumes ``pre``. Given
    ``saved_x`` (``[ws·m, D]``, kept by the forward), ``X`` is not gathered again. ``pre`` and
    ``saved_x`` are chunk-major (:func:`_chunk_rows`), as :func:`_pipelined_forward` returns
    them."""
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
        prej = tuple(_chunk_rows(p, ws, off, mj) for p in pre)  # [ws·m_j, F/ws] each
        h, pre_grads = _backward_activation(act, prej, dwd is not None)
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
            xj = _chunk_rows(saved_x, ws, off, mj)
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


def _npu_backward(
    ctx: Any,
    dy: torch.Tensor,
    x: torch.Tensor,
    pre: tuple[torch.Tensor, ...],
    w_in: tuple[torch.Tensor, ...],
    wd: torch.Tensor,
    need: tuple[bool, ...],
    saved_x: torch.Tensor | None = None,
) -> list[Any]:
    """``npu`` backend backward, the fused kernels one phase at a time; the same result list
    (and ``need`` order) as :func:`_pipelined_backward` (``saved_x``: the gathered
    ``[ws·m, D]`` the forward kept, else ``X`` is gathered again)."""
    k = len(w_in)
    need_x, need_w, need_wd = need[0], need[1 : 1 + k], need[1 + k]
    need_b, need_bd = need[2 + k : 2 + 2 * k], need[2 + 2 * k]
    # H recomputed: one per-element pass instead of a saved [ws·m, F/ws]
    h, pre_grads = _backward_activation(ctx.act, pre, need_wd)
    dh, dy_full = ctx.ops.npu_all_gather_base_mm(
        dy, wd, ctx.hcom, ctx.ws, bias=None, gather_index=0, gather_output=True
    )
    dwd = dy_full.t() @ h if h is not None else None
    dbd = dy_full.sum(0) if need_bd else None
    del dy_full, h
    dpre = pre_grads(dh)
    del pre, dh, pre_grads
    db = [d.sum(0) if n else None for d, n in zip(dpre, need_b)]
    dx = None
    if need_x:
        dcat = dpre[0] if k == 1 else torch.cat(dpre, dim=1)
        w_cat = w_in[0] if k == 1 else torch.cat(w_in)
        dx = ctx.ops.npu_mm_reduce_scatter_base(
            dcat, w_cat, ctx.hcom, ctx.ws, reduce_op="sum", bias=None
        )
        del dcat
    dw: list[Any] = [None] * k
    if any(need_w):
        big_x = saved_x
        if big_x is None:
            big_x = x.new_empty(ctx.ws * x.shape[0], x.shape[1])
            all_gather_async(big_x, x, ctx.group).wait()
        dw = [d.t() @ big_x if n else None for d, n in zip(dpre, need_w)]
    return [dx, *dw, dwd, *db, dbd]


class _MLPBlock(torch.autograd.Function):
    """The gated block, or with ``wg`` (and ``bg``) ``None`` the plain one
    (``Y = ReduceScatter_m(act(X W_uᵀ + b_u) W_dᵀ) + b_d``)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        wg: torch.Tensor | None,
        wu: torch.Tensor,
        wd: torch.Tensor,
        bg: torch.Tensor | None,
        bu: torch.Tensor | None,
        bd: torch.Tensor | None,
        act: Act,
        group: Any,
        backend: str,
        chunks: int,
    ) -> torch.Tensor:
        ws = dist.get_world_size(group)
        w_in = tuple(t.contiguous() for t in ((wu,) if wg is None else (wg, wu)))
        b_in = (bu,) if wg is None else (bg, bu)
        x, wd = x.contiguous(), wd.contiguous()
        fl = wu.shape[0]
        ctx.group, ctx.ws, ctx.backend, ctx.act = group, ws, backend, act
        ctx.where = "mlp_block" if wg is None else "gated_mlp"
        # the plain block keeps the gathered X for backward, the gated one gathers it again
        # (README, "Design", "What backward keeps")
        keep_x = wg is None
        pre: tuple[torch.Tensor, ...]
        big_x: torch.Tensor | None = None
        if backend == "npu":
            ops = current_npu_ops()
            hcom = ops.comm_name(group)
            ctx.ops, ctx.hcom = ops, hcom
            w_cat = w_in[0] if len(w_in) == 1 else torch.cat(w_in)
            pre_cat, gathered = ops.npu_all_gather_base_mm(
                x, w_cat.t(), hcom, ws, bias=None, gather_index=0, gather_output=keep_x
            )
            big_x = gathered if keep_x else None
            pre = tuple(pre_cat[:, i * fl : (i + 1) * fl] for i in range(len(w_in)))
            for p, b in zip(pre, b_in):
                if b is not None:
                    p.add_(b)
            h = _hidden(act, pre)
            y = ops.npu_mm_reduce_scatter_base(h, wd.t(), hcom, ws, reduce_op="sum", bias=None)
            del h
        else:
            ctx.splits = splits(x.shape[0], chunks)
            y, pre, big_x = _pipelined_forward(
                x, w_in, wd, b_in, act, group, ws, ctx.splits, keep_x
            )
        if bd is not None:
            y.add_(bd)
        ctx.save_for_backward(x, *w_in, wd)
        # Intermediates live on ctx (not save_for_backward) so backward can free them as soon
        # as they are used; a second backward through the same graph is refused.
        ctx.pre, ctx.big_x = pre, big_x
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    @without_autocast
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        if not hasattr(ctx, "pre"):
            raise RuntimeError(
                f"{ctx.where}: backward ran twice through the same graph; retain_graph=True is "
                "not supported (the saved activations are freed as they are used)"
            )
        x, *ws_in, wd = ctx.saved_tensors
        w_in = tuple(ws_in)
        pre, big_x = ctx.pre, ctx.big_x
        del ctx.pre, ctx.big_x
        need = ctx.needs_input_grad[:7]  # x, wg, wu, wd, bg, bu, bd
        plain = len(w_in) == 1
        # in the pipeline's order: x, *w_in, wd, *b_in, bd
        order = (0, 2, 3, 5, 6) if plain else tuple(range(7))
        need_p = tuple(need[i] for i in order)
        dy = dy.contiguous()
        if ctx.backend != "npu":
            grads = _pipelined_backward(
                dy, x, pre, w_in, wd, ctx.act, ctx.group, ctx.ws, ctx.splits, need_p, big_x
            )
        else:
            grads = _npu_backward(ctx, dy, x, pre, w_in, wd, need_p, big_x)
        out: list[Any] = [None] * 7
        for i, g in zip(order, grads):
            out[i] = g
        return (*out, None, None, None, None)


def validate_block_operands(
    where: str,
    x: Any,
    w_in: tuple[Any, ...],
    b_in: tuple[Any, ...],
    wd: Any,
    bd: Any,
    act: Any,
    world_size: int,
    backend: str,
    chunks: int | None,
) -> None:
    """Local checks of a fused block, gated (``w_in = (W_g, W_u)``) or plain
    (``w_in = (W_u,)``), the same on every rank for same-shaped operands; run before any
    collective. ``where`` names the entry point in the messages."""
    if backend not in BACKENDS:
        raise ValueError(f"impl must be one of {BACKENDS}, got {backend!r}")
    for w, b in zip(w_in, b_in):
        validate_operands("all_gather_matmul", x, w, b, world_size, "auto", chunks)
    first, ref_name = w_in[0], ("gate weight" if len(w_in) == 2 else "up weight")
    if len(w_in) == 2 and tuple(w_in[1].shape) != tuple(first.shape):
        raise ValueError(
            f"{where}: gate weight {tuple(first.shape)} and up weight {tuple(w_in[1].shape)} "
            "differ (both [F/ws, D])"
        )
    for name, t in (("down weight", wd), ("down bias", bd)):
        if isinstance(t, DTensor):
            raise TypeError(
                f"{where}: {name} is a DTensor; the functional form takes this rank's local "
                "tensors (pass .to_local())"
            )
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    want = (first.shape[1], first.shape[0])
    if wd.dim() != 2 or tuple(wd.shape) != want:
        raise ValueError(f"{where}: down weight must be [D, F/ws] = {want}, got {tuple(wd.shape)}")
    if bd is not None and tuple(bd.shape) != (want[0],):
        raise ValueError(
            f"{where}: down bias must be the full, replicated [D] = ({want[0]},), "
            f"got {tuple(bd.shape)}"
        )
    same = [("up weight", w_in[1], first)] if len(w_in) == 2 else []
    for name, t, ref in (*same, ("down weight", wd, first), ("down bias", bd, wd)):
        if t is None:
            continue
        if t.device != ref.device:
            other = "down weight" if ref is wd else ref_name
            raise ValueError(f"{where}: {name} is on {t.device} but {other} is on {ref.device}")
        if t.dtype != x.dtype:
            raise TypeError(
                f"{where}: x is {dtype_name(x.dtype)} but {name} is {dtype_name(t.dtype)}; "
                "x, the weights and the biases must share one dtype"
            )
    check_elementwise_activation(act, where)


def validate_gated_operands(
    x: Any,
    wg: Any,
    wu: Any,
    wd: Any,
    bg: Any,
    bu: Any,
    bd: Any,
    act: Any,
    world_size: int,
    backend: str,
    chunks: int | None,
) -> None:
    """Local checks, the same on every rank for same-shaped operands; run before any collective."""
    validate_block_operands(
        "gated_mlp", x, (wg, wu), (bg, bu), wd, bd, act, world_size, backend, chunks
    )


def select_block_backend(
    x: torch.Tensor, in_rows: int, wd: torch.Tensor, group: Any, backend: str, where: str
) -> tuple[str, str]:
    """``(choice, reason)`` for a fused block whose input projection has ``in_rows`` output
    features on this rank (gated: gate+up concatenated, ``2F/ws``; plain: ``F/ws``): ``npu``
    needs both fused kernels' constraints to hold for it and for down."""
    if backend == "torch":
        return "torch", "impl='torch' requested"
    ws = dist.get_world_size(group)
    w_in = torch.empty((in_rows, wd.shape[0]), dtype=wd.dtype, device="meta")
    failure = npu_constraint_failure("all_gather_matmul", x, w_in, ws)
    if failure is None:
        h = _rows_like(x, ws, wd.shape[1])
        failure = npu_constraint_failure("matmul_reduce_scatter", h, wd, ws)
    if backend == "npu":
        if failure:
            raise ValueError(f"impl='npu' cannot run {where}: {failure}")
        return "npu", "impl='npu' requested and every kernel constraint holds"
    if failure:
        return "torch", failure
    return "npu", "tensors are on npu, the kernels are available and every constraint holds"


def select_gated_backend(
    x: torch.Tensor, wg: torch.Tensor, wd: torch.Tensor, group: Any, backend: str
) -> tuple[str, str]:
    """``(choice, reason)`` for the gated block: ``npu`` needs both fused kernels' constraints
    to hold for the gate+up projection (weights concatenated, ``[2F/ws, D]``) and for down."""
    return select_block_backend(x, 2 * wg.shape[0], wd, group, backend, "gated_mlp")


def _rows_like(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A tensor standing in for ``H`` in the constraint check: its device type, dtype and
    shape matter, not its data (a zero-stride expand allocates nothing)."""
    return x.new_zeros(()).expand(rows, cols)


def gated_fields(
    x: Any,
    weights: tuple[Any, Any, Any],
    biases: tuple[Any, Any, Any],
    group: Any,
    act_fn: Any,
    backend: str,
    chunks: int | None,
) -> dict[str, Any]:
    """What the ranks compare for one gated block (a ``None`` gate: the plain block)
    (consistency mode): ``x``, the weights and
    biases as the block sees them (under autocast: cast), the chosen backend, the chunk count
    and the group size. Never raises: operands the block rejects give ``"<ErrorType>"`` as the
    choice (the body then raises the same error on every rank that agreed)."""
    ws: Any = None
    (wg, wu, wd), (bg, bu, bd) = weights, biases
    try:
        ws = dist.get_world_size(group)
        x, wg, wu, wd, bg, bu, bd = cast_for_autocast(x.device.type, x, wg, wu, wd, bg, bu, bd)
        choice, chunks = _prepare_gated(
            x, (wg, wu, wd), (bg, bu, bd), group, act_fn, backend, chunks
        )
    except Exception as exc:  # rejected by the body, after the comparison
        choice = f"<{type(exc).__name__}>"
    return {
        "x": x, "gate_weight": wg, "up_weight": wu, "down_weight": wd, "biases": (bg, bu, bd),
        "impl": choice, "chunks": chunks, "world_size": ws,
    }  # fmt: skip


def _gated_mlp_fields(
    x: Any,
    gate_weight: Any,
    up_weight: Any,
    down_weight: Any,
    group: Any = None,
    *,
    act_fn: Any = None,
    gate_bias: Any = None,
    up_bias: Any = None,
    down_bias: Any = None,
    impl: str = "auto",
    chunks: int | None = None,
) -> tuple[Any, dict[str, Any]]:
    weights, biases = (gate_weight, up_weight, down_weight), (gate_bias, up_bias, down_bias)
    return group, gated_fields(x, weights, biases, group, act_fn, impl, chunks)


@impl_keyword("gated_mlp")
@checked_entry("gated_mlp", _gated_mlp_fields)
def gated_mlp(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    group: Any = None,
    *,
    act_fn: Act,
    gate_bias: torch.Tensor | None = None,
    up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    impl: str = "auto",
    chunks: int | None = None,
) -> torch.Tensor:
    """Sequence + tensor parallel gated MLP ``Y = ReduceScatter_m((act(X W_gᵀ + b_g) ⊙
    (X W_uᵀ + b_u)) W_dᵀ) + b_d`` with ``X = AllGather_m(x)`` gathered once for gate and up.

    Args:
        x: ``[m, D]``, this rank's rows (a local tensor, not a DTensor); rank ``r`` holds rows
            ``r·m … (r+1)·m - 1`` of the gathered ``[ws·m, D]``.
        gate_weight, up_weight: ``[F/ws, D]``, this rank's output-feature shards.
        down_weight: ``[D, F/ws]``, this rank's input-feature shard.
        group: the tensor-parallel process group (``None``: the default group).
        act_fn: a per-element activation (see :mod:`hyper_parallel.mc2.activation`).
        gate_bias, up_bias: ``[F/ws]`` shards or ``None``; down_bias: ``[D]``, replicated.
        impl: ``"auto"``, ``"torch"`` or ``"npu"`` (the matmul+collective implementation;
            ``npu`` runs the torch_npu MC2 kernels: gate and up as one fused gather-matmul;
            ``backend=`` is its deprecated name).
        chunks: ``torch`` backend only: pieces ``m`` is split into for overlap (``None``: from
            the shapes and device type alone, identical on every rank).

    Returns:
        ``[m, D]``: this rank's rows of the output. Gradients: ``dx`` ``[m, D]``, the weight and
        gate/up bias gradients are this rank's shards, ``db_d`` the full sum (replicated).

    Consistency mode (``HP_CHECK_CONSISTENCY=1`` or ``consistency_checks()``): before the first
    collective every rank of ``group`` compares ``x``, the three weights and the biases (shape,
    dtype, device type), the chosen ``impl``, ``chunks`` and the group size, and all raise
    ``InconsistentRanksError`` naming the differing field and ranks.
    """
    return run_gated_mlp(
        x,
        (gate_weight, up_weight, down_weight),
        (gate_bias, up_bias, down_bias),
        group,
        act_fn,
        impl,
        chunks,
    )


def _prepare_gated(
    x: torch.Tensor,
    weights: tuple[Any, torch.Tensor, torch.Tensor],
    biases: tuple[Any, Any, Any],
    group: Any,
    act_fn: Act,
    backend: str,
    chunks: int | None,
) -> tuple[str, int]:
    """Validate (local, the same on every rank for same-shaped operands), choose the backend
    and the chunk count. A ``None`` gate weight (and bias): the plain block (``mlp_block``)."""
    (wg, wu, wd), (bg, bu, bd) = weights, biases
    ws = dist.get_world_size(group)
    plain = wg is None and bg is None
    w_in, b_in = ((wu,), (bu,)) if plain else ((wg, wu), (bg, bu))
    where = "mlp_block" if plain else "gated_mlp"
    validate_block_operands(where, x, w_in, b_in, wd, bd, act_fn, ws, backend, chunks)
    in_rows = sum(w.shape[0] for w in w_in)
    choice, _ = select_block_backend(x, in_rows, wd, group, backend, where)
    if chunks is None:
        chunks = default_chunks(x.shape[0], x.shape[1], in_rows, ws, x.device.type)
    return choice, chunks


def run_gated_mlp(
    x: torch.Tensor,
    weights: tuple[Any, torch.Tensor, torch.Tensor],
    biases: tuple[Any, Any, Any],
    group: Any,
    act_fn: Act,
    backend: str,
    chunks: int | None,
) -> torch.Tensor:
    """:func:`gated_mlp` without its consistency check (callers that are checked entry points
    themselves declare their own); a ``None`` gate weight and bias run the plain block
    (:func:`~hyper_parallel.mc2.mlp_block`)."""
    # under autocast: the operands in its dtype, the function with autocast off (dtensor.amp)
    x, wg, wu, wd, bg, bu, bd = cast_for_autocast(x.device.type, x, *weights, *biases)
    choice, chunks = _prepare_gated(x, (wg, wu, wd), (bg, bu, bd), group, act_fn, backend, chunks)
    with autocast_off(x.device.type):
        return _MLPBlock.apply(x, wg, wu, wd, bg, bu, bd, act_fn, group, choice, chunks)
