"""Fused autograd nodes of the context-parallel MLA schedule, and its recorder markers.

``WaitLinearGroups`` (wait the head→seq exchanges of the attention output of G ≥ 1 head
groups, then ``o_proj``; the pipeline's for every G), ``WaitLinear`` (the same for one
exchange) and ``WaitExpand`` (wait the all-gather of ``[latent, k_rope]``, then expand this
rank's heads with its rows of ``kv_b_proj``) split their backward into the input-gradient
matmul, the start of the gradient's collective(s), and the weight-gradient matmul, so that the
collectives are in flight during the weight-gradient matmul. ``mark`` inserts begin/end events
around compute (only while a recorder is active: no graph nodes otherwise); ``span``
(hp-dtensor's recorder) records inside a node.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd import Function

from hyper_parallel.context_parallel.exchange import Exchange
from hyper_parallel.context_parallel.head_groups import merge_heads
from hyper_parallel.context_parallel.mla import kv_heads
from hyper_parallel.dtensor import recorder as _rec
from hyper_parallel.dtensor.amp import autocast_off, cast_for_autocast, without_autocast
from hyper_parallel.dtensor.recorder import span

__all__ = ["WaitExpand", "WaitLinear", "WaitLinearGroups", "mark", "span"]


# ---- recorder markers (inserted only while recording) -----------------------------------
class _Mark(Function):
    @staticmethod
    def forward(ctx: Any, name: str, begin: bool, *xs: Tensor) -> Any:  # type: ignore[override]
        ctx.name, ctx.begin = name, begin
        rec = _rec._ACTIVE
        if rec is not None:
            rec.add("begin" if begin else "end", name, "forward")
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Any:  # type: ignore[override]
        rec = _rec._ACTIVE
        if rec is not None:
            rec.add("end" if ctx.begin else "begin", ctx.name, "backward")
        return (None, None, *grads)


def mark(name: str, begin: bool, *xs: Tensor) -> tuple[Tensor, ...]:
    if _rec._ACTIVE is None:
        return xs
    return _Mark.apply(name, begin, *xs)


# ---- fused wait + matmul nodes with split input/weight gradients ------------------------
class WaitLinear(Function):
    """Wait the head→seq exchange of the attention output, then ``o_proj`` (one exchange;
    the pipeline uses :class:`WaitLinearGroups`, whose one-group case computes the same).

    Backward: input-grad matmul, launch the gradient's seq→head exchange (waited by the
    paired launch node), then the weight-grad matmul while it is in flight.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, token: Tensor, weight: Tensor, bias: Tensor | None, ex: Exchange, head_width: int
    ) -> Tensor:
        a = ex.finish()
        ctx.a_dtype = a.dtype  # the gradient's exchange carries a's own dtype
        with span("o_proj", "forward"):
            a, weight, bias = cast_for_autocast(a.device.type, a.flatten(2), weight, bias)
            with autocast_off(a.device.type):  # what autocast's F.linear computes (dtensor.amp)
                y = F.linear(a, weight, bias)
        ctx.ex, ctx.has_bias, ctx.a_shape, ctx.head_width = (
            ex,
            bias is not None,
            a.shape,
            head_width,
        )
        ctx.save_for_backward(a, weight)
        return y

    @staticmethod
    @without_autocast
    def backward(ctx: Any, dy: Tensor) -> Any:  # type: ignore[override]
        a, weight = ctx.saved_tensors
        ex = ctx.ex
        dy = dy.to(a.dtype)
        with span("o_proj.input_grad", "backward"):
            da = (dy @ weight).view(*ctx.a_shape[:2], -1, ctx.head_width).to(ctx.a_dtype)
        ex.start_grad(da)
        dw = db = None
        with span("o_proj.weight_grad", "backward"):
            if ctx.needs_input_grad[1]:
                dw = dy.flatten(0, 1).t() @ a.flatten(0, 1)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                db = dy.flatten(0, 1).sum(0)
        return dy.new_empty(0), dw, db, None, None


class WaitExpand(Function):
    """Wait the all-gather of ``[latent, k_rope]``; expand this rank's heads with its rows of
    ``kv_b_proj``. Returns ``kv [B, S, h, dn + dv]`` and ``k_rope [B, S, dr]``.

    Backward: input-grad matmul, launch the reduce-scatter (sum) of the gathered tensor's
    gradient (waited by the paired launch node), then the weight-grad matmul.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, token: Tensor, weight: Tensor, ex: Exchange, rows: slice, dc: int, width: int
    ) -> Any:
        full = ex.finish()
        with span("kv_b_proj", "forward"):
            lat = full[..., :dc].contiguous()
            k_rope = full[..., dc:].contiguous()
            ctx.lat_dtype = lat.dtype  # the gradient's reduce-scatter carries full's dtype
            lat, weight = cast_for_autocast(lat.device.type, lat, weight)
            with autocast_off(lat.device.type):  # what autocast's F.linear computes (dtensor.amp)
                kv = kv_heads(lat, weight[rows], width)
        ctx.ex, ctx.rows = ex, rows
        ctx.save_for_backward(lat, weight)
        return kv, k_rope

    @staticmethod
    @without_autocast
    def backward(ctx: Any, dkv: Tensor, dk_rope: Tensor) -> Any:  # type: ignore[override]
        lat, weight = ctx.saved_tensors
        rows = ctx.rows
        d2 = dkv.reshape(*dkv.shape[:2], -1).to(lat.dtype)
        with span("kv_b_proj.input_grad", "backward"):
            dlat = (d2 @ weight[rows]).to(ctx.lat_dtype)
        ctx.ex.start_grad(torch.cat([dlat, dk_rope.to(ctx.lat_dtype)], dim=-1))
        dw = None
        with span("kv_b_proj.weight_grad", "backward"):
            if ctx.needs_input_grad[1]:
                dw = torch.zeros_like(weight)
                dw[rows] = d2.flatten(0, 1).t() @ lat.flatten(0, 1)
        return dkv.new_empty(0), dw, None, None, None, None


class WaitLinearGroups(Function):
    """:class:`WaitLinear` over G ≥ 1 head groups: wait the G head→seq exchanges of the
    attention output (``exs[g]`` carries group g, ``[B, S/P, P·hg, dv]``), put the heads back in
    order (:func:`~hyper_parallel.context_parallel.head_groups.merge_heads`; G = 1: as it
    came), then ``o_proj``; with an output ``gate`` (``[B, S/P, H·dv]``, this rank's tokens;
    Qwen3-Next's gated attention) ``o_proj`` takes ``o · sigmoid(gate)``.

    Backward: the input-grad matmul (and, gated, the product with ``sigmoid(gate)``), then the
    G gradient exchanges started last group first (the order in which autograd's backward of
    the groups needs them), then the gate's gradient and the weight-grad matmul while they
    are in flight.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        weight: Tensor,
        bias: Tensor | None,
        gate: Tensor | None,
        exs: tuple[Exchange, ...],
        cp_size: int,
        *tokens: Tensor,
    ) -> Tensor:
        parts = [ex.finish() for ex in exs]
        a = parts[0] if len(parts) == 1 else merge_heads(parts, cp_size)  # one group: no copy
        ctx.a_dtype = a.dtype
        ctx.gate_dtype = None if gate is None else gate.dtype
        with span("o_proj", "forward"):
            a, weight, bias, gate = cast_for_autocast(
                a.device.type, a.flatten(2), weight, bias, gate
            )
            with autocast_off(a.device.type):
                sg = None if gate is None else torch.sigmoid(gate)
                y = F.linear(a if sg is None else a * sg, weight, bias)
        ctx.exs, ctx.has_bias, ctx.part_shape = exs, bias is not None, parts[0].shape
        ctx.cp_size = cp_size
        ctx.save_for_backward(a, weight, sg)
        return y

    @staticmethod
    @without_autocast
    def backward(ctx: Any, dy: Tensor) -> Any:  # type: ignore[override]
        a, weight, sg = ctx.saved_tensors
        exs, (b, s, phg, dv), p = ctx.exs, ctx.part_shape, ctx.cp_size
        groups = len(exs)
        dy = dy.to(a.dtype)
        with span("o_proj.input_grad", "backward"):
            dz = dy @ weight  # the gradient of o_proj's input
            da = dz if sg is None else dz * sg
            da = da.to(ctx.a_dtype).view(b, s, p, groups, phg // p, dv)
        for g in reversed(range(groups)):
            exs[g].start_grad(da[:, :, :, g].reshape(b, s, phg, dv))
        dw = db = dgate = None
        with span("o_proj.weight_grad", "backward"):
            z = a if sg is None else a * sg
            if sg is not None and ctx.needs_input_grad[2]:
                dgate = (dz * a * sg * (1 - sg)).to(ctx.gate_dtype)
            if ctx.needs_input_grad[0]:
                dw = dy.flatten(0, 1).t() @ z.flatten(0, 1)
            if ctx.has_bias and ctx.needs_input_grad[1]:
                db = dy.flatten(0, 1).sum(0)
        return (dw, db, dgate, None, None, *(dy.new_empty(0) for _ in exs))
