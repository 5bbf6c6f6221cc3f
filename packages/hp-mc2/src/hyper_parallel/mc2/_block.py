"""The MLP block engine shared by the gated block (:func:`~hyper_parallel.mc2.gated_mlp`) and
the plain one (:func:`~hyper_parallel.mc2.mlp_block`): one autograd function, its operand
checks, its implementation choice and its consistency fields, all parametrised by the input
projections, ``w_in = (W_g, W_u)`` (gated) or ``(W_u,)`` (plain).

Notation (README, "Design"): ``x`` ``[m, D]`` is this rank's rows, ``X = AllGather_m(x)``
``[ws·m, D]``; the input projections are ``[F/ws, D]`` shards and ``W_d`` ``[D, F/ws]``:

    gated:  G = X W_gᵀ + b_g,   U = X W_uᵀ + b_u,   H = act(G) ⊙ U
    plain:  U = X W_uᵀ + b_u,   H = act(U)
    both:   Y = ReduceScatter_m(H W_dᵀ) + b_d

Backward, with ``dY_full = AllGather_m(dY)``: ``dH = dY_full W_d``, ``dW_d = dY_fullᵀ H``,
``db_d = Σ dY_full``; the pre-activation gradients (:mod:`hyper_parallel.mc2._hidden`); then
``dx = ReduceScatter_m(Σ dP W_P)``, ``dW_P = dPᵀ X`` and ``db_P = Σ dP`` for each input
projection ``P``. The chosen implementation (:class:`~hyper_parallel.mc2.impls.MC2Impl`'s
``block_forward`` / ``block_backward``) runs the collectives and matmuls.

Saved for backward: the pre-activations (``G`` and ``U``, or ``U``), not ``act(G)`` or ``H``
(recomputed, one per-element pass). The gated block gathers ``X`` again in backward; the plain
one keeps it (README, "Design", "What backward keeps", for the measurements behind both).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hyper_parallel.dtensor.amp import autocast_off, cast_for_autocast, without_autocast
from hyper_parallel.mc2._chunked import default_chunks
from hyper_parallel.mc2._hidden import Act
from hyper_parallel.mc2._operands import dtype_name, validate_operands
from hyper_parallel.mc2.activation import check_elementwise_activation
from hyper_parallel.mc2.impls import (
    IMPLS,
    Call,
    MC2Impl,
    block_failure,
    check_impl_choice,
    select_impl,
)

__all__ = ["block_fields", "cast_block", "entry_name", "run_block", "validate_block_operands"]

#: the input projections' names, by how many there are
ROLES: dict[int, tuple[str, ...]] = {2: ("gate", "up"), 1: ("up",)}


def entry_name(w_in: tuple[Any, ...]) -> str:
    """The public entry point a block with these input projections is (named in messages)."""
    return "gated_mlp" if len(w_in) == 2 else "mlp_block"


def cast_block(
    x: Any, w_in: tuple[Any, ...], b_in: tuple[Any, ...], wd: Any, bd: Any
) -> tuple[Any, tuple[Any, ...], tuple[Any, ...], Any, Any]:
    """``(x, w_in, b_in, wd, bd)`` under autocast: the dtypes the serial MLP would compute in
    (``dtensor.amp``; outside autocast, unchanged). ``x`` must be a tensor."""
    n = len(w_in)
    x, *ops = cast_for_autocast(x.device.type, x, *w_in, wd, *b_in, bd)
    return x, tuple(ops[:n]), tuple(ops[n + 1 : 2 * n + 1]), ops[n], ops[-1]


class _Block(torch.autograd.Function):
    """The gated block, or with ``wg`` (and ``bg``) ``None`` the plain one."""

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
        impl: MC2Impl,
        call: Call,
    ) -> torch.Tensor:
        w_in = tuple(t.contiguous() for t in ((wu,) if wg is None else (wg, wu)))
        b_in = (bu,) if wg is None else (bg, bu)
        x, wd = x.contiguous(), wd.contiguous()
        ctx.impl, ctx.act, ctx.where = impl, act, entry_name(w_in)
        # the plain block keeps the gathered X for backward, the gated one gathers it again
        # (README, "Design", "What backward keeps")
        y, pre, big_x, ctx.state = impl.block_forward(
            call, x, w_in, b_in, wd, act, keep_x=wg is None
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
        # in the implementation's order: x, *w_in, wd, *b_in, bd
        order = (0, 2, 3, 5, 6) if len(w_in) == 1 else tuple(range(7))
        grads = ctx.impl.block_backward(
            ctx.state, dy.contiguous(), x, pre, w_in, wd, ctx.act,
            tuple(need[i] for i in order), big_x,
        )  # fmt: skip
        out: list[Any] = [None] * 7
        for i, g in zip(order, grads):
            out[i] = g
        return (*out, None, None, None)


def validate_block_operands(
    where: str,
    x: Any,
    w_in: tuple[Any, ...],
    b_in: tuple[Any, ...],
    wd: Any,
    bd: Any,
    act: Any,
    world_size: int,
    impl: str,
    chunks: int | None,
) -> None:
    """Local checks of a block, gated (``w_in = (W_g, W_u)``) or plain (``w_in = (W_u,)``),
    the same on every rank for same-shaped operands; run before any collective. ``where``
    names the entry point in the messages."""
    check_impl_choice(impl)
    for w, b in zip(w_in, b_in):
        validate_operands("all_gather_matmul", x, w, b, world_size, chunks)
    first, ref_name = w_in[0], f"{ROLES[len(w_in)][0]} weight"
    for role, w in zip(ROLES[len(w_in)][1:], w_in[1:]):
        if tuple(w.shape) != tuple(first.shape):
            raise ValueError(
                f"{where}: {ref_name} {tuple(first.shape)} and {role} weight "
                f"{tuple(w.shape)} differ (both [F/ws, D])"
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
    same = [(f"{role} weight", w, first) for role, w in zip(ROLES[len(w_in)][1:], w_in[1:])]
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


def _prepare(
    x: torch.Tensor,
    w_in: tuple[Any, ...],
    b_in: tuple[Any, ...],
    wd: torch.Tensor,
    bd: Any,
    group: Any,
    act_fn: Act,
    impl: str,
    chunks: int | None,
) -> tuple[str, int]:
    """Validate (local, the same on every rank for same-shaped operands), choose the
    implementation (both of its duals' constraints must hold: the input projections
    concatenated, then down) and the chunk count."""
    ws, where = dist.get_world_size(group), entry_name(w_in)
    validate_block_operands(where, x, w_in, b_in, wd, bd, act_fn, ws, impl, chunks)
    in_rows = sum(w.shape[0] for w in w_in)
    choice, _ = select_impl(impl, where, lambda i: block_failure(i, x, in_rows, wd, group))
    if chunks is None:
        chunks = default_chunks(x.shape[0], x.shape[1], in_rows, ws, x.device.type)
    return choice, chunks


def block_fields(
    x: Any,
    w_in: tuple[Any, ...],
    b_in: tuple[Any, ...],
    wd: Any,
    bd: Any,
    group: Any,
    act_fn: Any,
    impl: str,
    chunks: int | None,
) -> dict[str, Any]:
    """What the ranks compare for one block (consistency mode): ``x``, the weights
    (``gate_weight`` (gated only), ``up_weight``, ``down_weight``) and ``biases`` as the block
    sees them (under autocast: cast), the chosen ``impl``, the chunk count and the group size.
    Only reads (hp-dtensor's ``checked_entry`` guards it); the choice of operands the block
    rejects is its verdict, ``"<ErrorType>"`` (the body then raises that error on every rank
    that agreed)."""
    n = len(w_in)
    ws = dist.get_world_size(group)
    x, w_in, b_in, wd, bd = cast_block(x, w_in, b_in, wd, bd)
    try:
        choice, chunks = _prepare(x, w_in, b_in, wd, bd, group, act_fn, impl, chunks)
    except Exception as exc:  # the verdict: the body raises it, after the comparison
        choice = f"<{type(exc).__name__}>"
    fields: dict[str, Any] = {"x": x}
    fields.update({f"{role}_weight": w for role, w in zip(ROLES[n], w_in)})
    fields.update(down_weight=wd, biases=(*b_in, bd), impl=choice, chunks=chunks, world_size=ws)
    return fields


def run_block(
    x: torch.Tensor,
    w_in: tuple[torch.Tensor, ...],
    b_in: tuple[Any, ...],
    wd: torch.Tensor,
    bd: Any,
    group: Any,
    act_fn: Act,
    impl: str,
    chunks: int | None,
) -> torch.Tensor:
    """The block (gated for two input projections, plain for one) without a consistency check
    (its callers are checked entry points that declare their own fields)."""
    # under autocast: the operands in its dtype, the function with autocast off (dtensor.amp)
    x, w_in, b_in, wd, bd = cast_block(x, w_in, b_in, wd, bd)
    choice, chunks = _prepare(x, w_in, b_in, wd, bd, group, act_fn, impl, chunks)
    call = Call(group, dist.get_world_size(group), chunks)
    wg, wu = (None, w_in[0]) if len(w_in) == 1 else w_in
    bg, bu = (None, b_in[0]) if len(w_in) == 1 else b_in
    with autocast_off(x.device.type):
        return _Block.apply(x, wg, wu, wd, bg, bu, bd, act_fn, IMPLS[choice], call)
