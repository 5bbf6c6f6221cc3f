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


def _act_grads(act: Act, g: torch.Tensor, u: torch.Tensor, dh: torch.Tensor) -> tuple[Any, Any]:
    """``(dG, dU)`` from ``dH``; consumes ``u`` and ``dh`` (overwritten in place)."""
    with torch.enable_grad():
        g_ = g.detach().requires_grad_()
        a = act(g_)
    # dH ⊙ U, in U's storage unless U shares G's (the npu path's [G | U]): autograd saved G
    shared = u.untyped_storage().data_ptr() == g.untyped_storage().data_ptr()
    gu = u * dh if shared else u.mul_(dh)
    du = dh.mul_(a.detach())  # dH ⊙ act(G), in dH's storage
    (dg,) = torch.autograd.grad(a, g_, gu)
    return dg, du


def _pipelined_forward(
    x: torch.Tensor,
    ws_: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    bs: tuple[Any, Any],
    act: Act,
    group: Any,
    ws: int,
    parts: Splits,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch`` backend forward, ``(Y, G, U)``, one pipeline over the row chunks: chunk j is
    gathered under chunk j-1's gate/up/down matmuls, and chunk j's reduce-scatter runs under
    chunk j+1's (the link carries ``X_{j+1}`` before ``RS_j``). Only the first gather and the
    last reduce-scatter have no matmul to hide under. ``H`` exists one chunk at a time."""
    wg, wu, wd = ws_
    bg, bu = bs
    m, fl = x.shape[0], wg.shape[0]
    gather = _Gather(x, group, ws, parts)
    first: torch.Tensor | None = gather.next()
    single = len(parts) == 1
    g = u = None
    if not single:  # allocated once the first chunk has arrived (see _chunked)
        g, u = (x.new_empty(ws, m, fl) for _ in range(2))
    y = x.new_empty(m, wd.shape[0])
    pending = []
    for off, mj in parts:
        chunk = first if first is not None else gather.next()
        first = None
        gj, uj = torch.matmul(chunk, wg.t()), torch.matmul(chunk, wu.t())  # [ws, m_j, F/ws]
        del chunk
        if bg is not None:
            gj.add_(bg)
        if bu is not None:
            uj.add_(bu)
        if single:
            g, u = gj, uj
        else:
            assert g is not None and u is not None
            g[:, off : off + mj], u[:, off : off + mj] = gj, uj
        partial = torch.matmul(_gated(act, gj, uj), wd.t())  # [ws, m_j, D], summed over ranks
        del gj, uj
        pending.append((reduce_scatter_async(y[off : off + mj], partial, group), partial))
        del partial
    for work, _ in pending:
        work.wait()
    assert g is not None and u is not None
    return y, g.view(ws * m, fl), u.view(ws * m, fl)


def _pipelined_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    g: torch.Tensor,
    u: torch.Tensor,
    ws_: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    act: Act,
    group: Any,
    ws: int,
    parts: Splits,
    need: tuple[bool, ...],
) -> list[Any]:
    """``torch`` backend backward, ``[dx, dW_g, dW_u, dW_d, db_g, db_u, db_d]`` (``None`` where
    not needed), one pipeline over the row chunks. Chunk j: ``dY_j`` arrives (``dY_{j+1}``
    starts), ``H_j`` is recomputed, ``dH_j = dY_j W_d``, ``dW_d += dY_jᵀ H_j``, ``dG_j``,
    ``dU_j``, ``dx_j = dG_j W_g + dU_j W_u`` is reduce-scattered once ``X_j`` (gathered again)
    has arrived, under ``dW_g += dG_jᵀ X_j``, ``dW_u += dU_jᵀ X_j`` and the next chunk's work.
    Only the first ``dY`` chunk has no matmul to hide under. ``g`` and ``u`` are consumed."""
    wg, wu, wd = ws_
    need_x, need_wg, need_wu = need[:3]
    need_bg, need_bu, need_bd = need[4:7]
    m, dm = dy.shape
    fl = wg.shape[0]
    need_act = need_x or need_wg or need_wu or need_bg or need_bu
    gdy = _Gather(dy, group, ws, parts)
    first: torch.Tensor | None = gdy.next()
    gx = _Gather(x, group, ws, parts) if need_wg or need_wu else None
    g3, u3 = g.view(ws, m, fl), u.view(ws, m, fl)
    dx = dy.new_empty(m, x.shape[1]) if need_x else None
    dwg, dwu, dwd = (dy.new_zeros(w.shape) if n else None for w, n in zip(ws_, need[1:4]))
    dbg = dy.new_zeros(fl) if need_bg else None
    dbu = dy.new_zeros(fl) if need_bu else None
    dbd = dy.new_zeros(dm) if need_bd else None
    pending = []
    for off, mj in parts:
        dyj = first if first is not None else gdy.next()  # [ws, m_j, D]
        first = None
        gj, uj = g3[:, off : off + mj], u3[:, off : off + mj]
        if dwd is not None:
            dwd.addmm_(dyj.view(ws * mj, dm).t(), _gated(act, gj, uj).reshape(ws * mj, fl))
        if dbd is not None:
            dbd.add_(dyj.sum(dim=(0, 1)))
        if not need_act:
            continue
        dgj, duj = _act_grads(act, gj, uj, torch.matmul(dyj, wd))
        del dyj
        if dbg is not None:
            dbg.add_(dgj.sum(dim=(0, 1)))
        if dbu is not None:
            dbu.add_(duj.sum(dim=(0, 1)))
        partial = None
        if dx is not None:
            partial = torch.matmul(dgj, wg)  # [ws, m_j, D], summed over ranks below
            partial.baddbmm_(duj, wu.expand(ws, *wu.shape))
        xj = gx.next().view(ws * mj, -1) if gx is not None else None
        if dx is not None and partial is not None:
            pending.append((reduce_scatter_async(dx[off : off + mj], partial, group), partial))
            del partial
        if xj is not None:
            for dw, d in ((dwg, dgj), (dwu, duj)):
                if dw is not None:
                    dw.addmm_(d.reshape(ws * mj, fl).t(), xj)
            del xj
        del dgj, duj
    for work, _ in pending:
        work.wait()
    return [dx, dwg, dwu, dwd, dbg, dbu, dbd]


class _GatedMLP(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        wg: torch.Tensor,
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
        x, wg, wu, wd = (t.contiguous() for t in (x, wg, wu, wd))
        fl = wg.shape[0]
        ctx.group, ctx.ws, ctx.backend, ctx.act = group, ws, backend, act
        ctx.has_bias = (bg is not None, bu is not None, bd is not None)
        if backend == "npu":
            ops = current_npu_ops()
            hcom = ops.comm_name(group)
            ctx.ops, ctx.hcom = ops, hcom
            gu, _ = ops.npu_all_gather_base_mm(
                x,
                torch.cat([wg, wu]).t(),
                hcom,
                ws,
                bias=None,
                gather_index=0,
                gather_output=False,
            )
            g, u = gu[:, :fl], gu[:, fl:]
            if bg is not None:
                g.add_(bg)
            if bu is not None:
                u.add_(bu)
            h = _gated(act, g, u)
            y = ops.npu_mm_reduce_scatter_base(h, wd.t(), hcom, ws, reduce_op="sum", bias=None)
            del h
        else:
            ctx.splits = splits(x.shape[0], chunks)
            y, g, u = _pipelined_forward(x, (wg, wu, wd), (bg, bu), act, group, ws, ctx.splits)
        if bd is not None:
            y.add_(bd)
        ctx.save_for_backward(x, wg, wu, wd)
        # Intermediates live on ctx (not save_for_backward) so backward can free them as soon
        # as they are used; a second backward through the same graph is refused.
        ctx.g, ctx.u = g, u
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    @without_autocast
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        if not hasattr(ctx, "g"):
            raise RuntimeError(
                "gated_mlp: backward ran twice through the same graph; retain_graph=True is "
                "not supported (the saved activations are freed as they are used)"
            )
        x, wg, wu, wd = ctx.saved_tensors
        g, u = ctx.g, ctx.u
        del ctx.g, ctx.u
        need = ctx.needs_input_grad
        need_x, need_wg, need_wu, need_wd = need[:4]
        need_bg, need_bu, need_bd = need[4:7]
        group, ws, act = ctx.group, ctx.ws, ctx.act
        dy = dy.contiguous()
        if ctx.backend != "npu":
            grads = _pipelined_backward(
                dy, x, g, u, (wg, wu, wd), act, group, ws, ctx.splits, need[:7]
            )
            return (*grads, None, None, None, None)
        # npu: the fused kernels, one phase at a time
        h = _gated(act, g, u)  # recomputed: one per-element pass instead of a saved [ws·m, F/ws]
        dh, dy_full = ctx.ops.npu_all_gather_base_mm(
            dy, wd, ctx.hcom, ws, bias=None, gather_index=0, gather_output=True
        )
        dwd = dy_full.t() @ h if need_wd else None
        dbd = dy_full.sum(0) if need_bd else None
        del dy_full, h
        dg, du = _act_grads(act, g, u, dh)
        del g, u, dh
        dbg = dg.sum(0) if need_bg else None
        dbu = du.sum(0) if need_bu else None
        dx = dwg = dwu = None
        if need_x:
            dgu = torch.cat([dg, du], dim=1)
            dx = ctx.ops.npu_mm_reduce_scatter_base(
                dgu, torch.cat([wg, wu]), ctx.hcom, ws, reduce_op="sum", bias=None
            )
            del dgu
        if need_wg or need_wu:
            big_x = x.new_empty(ws * x.shape[0], x.shape[1])
            all_gather_async(big_x, x, group).wait()
            dwg = dg.t() @ big_x if need_wg else None
            dwu = du.t() @ big_x if need_wu else None
        return dx, dwg, dwu, dwd, dbg, dbu, dbd, None, None, None, None


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
    where = "gated_mlp"
    if backend not in BACKENDS:
        raise ValueError(f"impl must be one of {BACKENDS}, got {backend!r}")
    validate_operands("all_gather_matmul", x, wg, bg, world_size, "auto", chunks)
    validate_operands("all_gather_matmul", x, wu, bu, world_size, "auto", chunks)
    if tuple(wu.shape) != tuple(wg.shape):
        raise ValueError(
            f"{where}: gate weight {tuple(wg.shape)} and up weight {tuple(wu.shape)} differ "
            "(both [F/ws, D])"
        )
    for name, t in (("down weight", wd), ("down bias", bd)):
        if isinstance(t, DTensor):
            raise TypeError(
                f"{where}: {name} is a DTensor; the functional form takes this rank's local "
                "tensors (pass .to_local())"
            )
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    want = (wg.shape[1], wg.shape[0])
    if wd.dim() != 2 or tuple(wd.shape) != want:
        raise ValueError(f"{where}: down weight must be [D, F/ws] = {want}, got {tuple(wd.shape)}")
    if bd is not None and tuple(bd.shape) != (want[0],):
        raise ValueError(
            f"{where}: down bias must be the full, replicated [D] = ({want[0]},), "
            f"got {tuple(bd.shape)}"
        )
    for name, t, ref in (("up weight", wu, wg), ("down weight", wd, wg), ("down bias", bd, wd)):
        if t is None:
            continue
        if t.device != ref.device:
            other = "down weight" if ref is wd else "gate weight"
            raise ValueError(f"{where}: {name} is on {t.device} but {other} is on {ref.device}")
        if t.dtype != x.dtype:
            raise TypeError(
                f"{where}: x is {dtype_name(x.dtype)} but {name} is {dtype_name(t.dtype)}; "
                "x, the weights and the biases must share one dtype"
            )
    check_elementwise_activation(act, where)


def select_gated_backend(
    x: torch.Tensor, wg: torch.Tensor, wd: torch.Tensor, group: Any, backend: str
) -> tuple[str, str]:
    """``(choice, reason)`` for the gated block: ``npu`` needs both fused kernels' constraints
    to hold for the gate+up projection (weights concatenated, ``[2F/ws, D]``) and for down."""
    if backend == "torch":
        return "torch", "impl='torch' requested"
    ws = dist.get_world_size(group)
    gu = torch.empty((2 * wg.shape[0], wg.shape[1]), dtype=wg.dtype, device="meta")
    failure = npu_constraint_failure("all_gather_matmul", x, gu, ws)
    if failure is None:
        h = _rows_like(x, ws, wd.shape[1])
        failure = npu_constraint_failure("matmul_reduce_scatter", h, wd, ws)
    if backend == "npu":
        if failure:
            raise ValueError(f"impl='npu' cannot run gated_mlp: {failure}")
        return "npu", "impl='npu' requested and every kernel constraint holds"
    if failure:
        return "torch", failure
    return "npu", "tensors are on npu, the kernels are available and every constraint holds"


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
    """What the ranks compare for one gated block (consistency mode): ``x``, the weights and
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
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    biases: tuple[Any, Any, Any],
    group: Any,
    act_fn: Act,
    backend: str,
    chunks: int | None,
) -> tuple[str, int]:
    """Validate (local, the same on every rank for same-shaped operands), choose the backend
    and the chunk count."""
    (wg, wu, wd), (bg, bu, bd) = weights, biases
    ws = dist.get_world_size(group)
    validate_gated_operands(x, wg, wu, wd, bg, bu, bd, act_fn, ws, backend, chunks)
    choice, _ = select_gated_backend(x, wg, wd, group, backend)
    if chunks is None:
        chunks = default_chunks(x.shape[0], x.shape[1], 2 * wg.shape[0], ws, x.device.type)
    return choice, chunks


def run_gated_mlp(
    x: torch.Tensor,
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    biases: tuple[Any, Any, Any],
    group: Any,
    act_fn: Act,
    backend: str,
    chunks: int | None,
) -> torch.Tensor:
    """:func:`gated_mlp` without its consistency check (callers that are checked entry points
    themselves declare their own)."""
    # under autocast: the operands in its dtype, the function with autocast off (dtensor.amp)
    x, wg, wu, wd, bg, bu, bd = cast_for_autocast(x.device.type, x, *weights, *biases)
    choice, chunks = _prepare_gated(x, (wg, wu, wd), (bg, bu, bd), group, act_fn, backend, chunks)
    with autocast_off(x.device.type):
        return _GatedMLP.apply(x, wg, wu, wd, bg, bu, bd, act_fn, group, choice, chunks)
