"""``impl="npu"``: :class:`NpuFusedImpl`, the two torch_npu MC2 fused kernels
(``npu_all_gather_base_mm``, ``npu_mm_reduce_scatter_base``), each dual's forward the one kernel
and its backward the other (the dual kernel), and their constraints
(:func:`npu_constraint_failure`). The kernels come from the process's torch_npu provider
(:mod:`hyper_parallel.mc2.npu_ops`, on hp-dtensor's seam), captured at forward (a test double on
CPU, torch_npu on an NPU). The bias is always added outside the kernels (they only accept a zero
bias)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hyper_parallel.dtensor.npu import NpuProvider, current_npu_ops
from hyper_parallel.mc2._collectives import all_gather_async
from hyper_parallel.mc2._hidden import Act, backward_activation, hidden
from hyper_parallel.mc2._operands import Op, dtype_name
from hyper_parallel.mc2.npu_ops import MC2_OPS, world_sizes

if TYPE_CHECKING:
    from hyper_parallel.mc2.impls import Call, Grad

__all__ = ["K_MAX", "K_MIN", "NpuFusedImpl", "npu_constraint_failure"]

K_MIN, K_MAX = 256, 65535  # contraction dim range of both MC2 kernels: [256, 65535)
_NPU_DTYPES = (torch.float16, torch.bfloat16)


def npu_constraint_failure(
    op: Op,
    x: torch.Tensor,
    weight: torch.Tensor,
    world_size: int,
    ops: NpuProvider | None = None,
) -> str | None:
    """``None`` when the torch_npu MC2 kernels can run ``op`` forward and backward, else the
    first constraint that fails, worded like the kernels' own checks."""
    if ops is None:
        ops = current_npu_ops()
    if x.device.type != ops.device_type:
        return f"tensors are on {x.device.type}, not {ops.device_type}"
    unavailable = ops.available(ops=MC2_OPS)
    if unavailable:
        return unavailable
    if x.dtype not in _NPU_DTYPES:
        return f"{dtype_name(x.dtype)} is not supported by the NPU kernels (fp16/bf16 only)"
    if weight.dtype != x.dtype:
        return (
            f"x is {dtype_name(x.dtype)} but weight is {dtype_name(weight.dtype)}; "
            "the NPU kernels need equal dtypes"
        )
    sizes = world_sizes(ops)
    if world_size not in sizes:
        return f"world size {world_size} not in {{{', '.join(map(str, sorted(sizes)))}}}"
    k = x.shape[1]
    if not K_MIN <= k < K_MAX:
        return f"k={k} outside [{K_MIN}, {K_MAX})"
    # The backward runs the dual kernel, contracting over the weight's output dim.
    n = weight.shape[0]
    which = "n_local" if op == "all_gather_matmul" else "n"
    if not K_MIN <= n < K_MAX:
        return f"k={n} outside [{K_MIN}, {K_MAX}) ({which}, the contraction dim of the backward)"
    if op == "matmul_reduce_scatter" and x.shape[0] % world_size:
        return f"m={x.shape[0]} not divisible by world size {world_size}"
    return None


@dataclass(frozen=True)
class _Kernels:
    """A forward's state for its backward: the provider and communicator it ran with."""

    ops: NpuProvider
    hcom: str
    group: Any
    ws: int

    @staticmethod
    def of(call: Call) -> _Kernels:
        ops = current_npu_ops()
        return _Kernels(ops, ops.comm_name(call.group), call.group, call.ws)

    def gather_mm(self, x: torch.Tensor, w: torch.Tensor, keep: bool) -> Any:
        """``(AllGather_m(x) @ w, AllGather_m(x) if keep)``: the fused gather-matmul."""
        return self.ops.npu_all_gather_base_mm(
            x, w, self.hcom, self.ws, bias=None, gather_index=0, gather_output=keep
        )

    def mm_scatter(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``ReduceScatter_m(x @ w)``: the fused matmul-reduce-scatter."""
        return self.ops.npu_mm_reduce_scatter_base(
            x, w, self.hcom, self.ws, reduce_op="sum", bias=None
        )


class NpuFusedImpl:
    """The Ascend MC2 kernels, one phase at a time; fp16/bf16, ``k`` and ``n`` in
    ``[256, 65535)``, the world sizes the kernels support (:func:`npu_constraint_failure`)."""

    name = "npu"
    requested_reason = "impl='npu' requested and every kernel constraint holds"
    auto_reason = "tensors are on npu, the kernels are available and every constraint holds"

    def failure(self, op: Op, x: torch.Tensor, weight: torch.Tensor, group: Any) -> str | None:
        return npu_constraint_failure(op, x, weight, dist.get_world_size(group))

    def column_forward(
        self, call: Call, x: torch.Tensor, weight: torch.Tensor, *, keep_x: bool
    ) -> tuple[torch.Tensor, list[torch.Tensor], Any]:
        k = _Kernels.of(call)
        y, gathered = k.gather_mm(x, weight.t(), True)
        return y, ([gathered.view(k.ws, x.shape[0], x.shape[1])] if keep_x else []), k

    def column_backward(
        self,
        state: _Kernels,
        dy: torch.Tensor,
        weight: torch.Tensor,
        kept: Sequence[torch.Tensor],
        *,
        need_dx: bool,
        need_dw: bool,
    ) -> tuple[Grad, Grad]:
        dx = state.mm_scatter(dy, weight) if need_dx else None
        dw = dy.t() @ kept[0].view(-1, weight.shape[1]) if need_dw else None
        return dx, dw

    def row_forward(
        self, call: Call, x: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, Any]:
        k = _Kernels.of(call)
        return k.mm_scatter(x, weight.t()), k

    def row_backward(
        self,
        state: _Kernels,
        dy: torch.Tensor,
        x: torch.Tensor,
        weight: torch.Tensor,
        *,
        need_dx: bool,
        need_dw: bool,
        need_db: bool,
    ) -> tuple[Grad, Grad, Grad]:
        dx, dy_full = state.gather_mm(dy, weight, True)
        dw = dy_full.t() @ x if need_dw else None
        db = dy_full.sum(0) if need_db else None
        return (dx if need_dx else None), dw, db

    def block_forward(
        self,
        call: Call,
        x: torch.Tensor,
        w_in: tuple[torch.Tensor, ...],
        b_in: tuple[Grad, ...],
        wd: torch.Tensor,
        act: Act,
        *,
        keep_x: bool,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor | None, Any]:
        """One gather-matmul for every input projection (``[W_g; W_u]`` concatenated), then
        the matmul-reduce-scatter of ``H``."""
        k, fl = _Kernels.of(call), w_in[0].shape[0]
        w_cat = w_in[0] if len(w_in) == 1 else torch.cat(w_in)
        pre_cat, gathered = k.gather_mm(x, w_cat.t(), keep_x)
        pre = tuple(pre_cat[:, i * fl : (i + 1) * fl] for i in range(len(w_in)))
        for p, b in zip(pre, b_in):
            if b is not None:
                p.add_(b)
        h = hidden(act, pre)
        y = k.mm_scatter(h, wd.t())
        return y, pre, (gathered if keep_x else None), k

    def block_backward(
        self,
        state: _Kernels,
        dy: torch.Tensor,
        x: torch.Tensor,
        pre: tuple[torch.Tensor, ...],
        w_in: tuple[torch.Tensor, ...],
        wd: torch.Tensor,
        act: Act,
        need: tuple[bool, ...],
        saved_x: torch.Tensor | None,
    ) -> list[Grad]:
        """The fused kernels one phase at a time: ``dH`` and ``dY_full`` from one
        gather-matmul, ``dx`` from one matmul-reduce-scatter of ``[dG | dU]``; ``X`` is
        ``saved_x`` or gathered again (for ``dW_in``)."""
        n = len(w_in)
        need_x, need_w, need_wd = need[0], need[1 : 1 + n], need[1 + n]
        need_b, need_bd = need[2 + n : 2 + 2 * n], need[2 + 2 * n]
        # H recomputed: one per-element pass instead of a saved [ws·m, F/ws]
        h, pre_grads = backward_activation(act, pre, need_wd)
        dh, dy_full = state.gather_mm(dy, wd, True)
        dwd = dy_full.t() @ h if h is not None else None
        dbd = dy_full.sum(0) if need_bd else None
        del dy_full, h
        dpre = pre_grads(dh)
        del pre, dh, pre_grads
        db = [d.sum(0) if nb else None for d, nb in zip(dpre, need_b)]
        dx = None
        if need_x:
            dcat = dpre[0] if n == 1 else torch.cat(dpre, dim=1)
            dx = state.mm_scatter(dcat, w_in[0] if n == 1 else torch.cat(w_in))
            del dcat
        dw: list[Any] = [None] * n
        if any(need_w):
            big_x = saved_x
            if big_x is None:
                big_x = x.new_empty(state.ws * x.shape[0], x.shape[1])
                all_gather_async(big_x, x, state.group).wait()
            dw = [d.t() @ big_x if nw else None for d, nw in zip(dpre, need_w)]
        return [dx, *dw, dwd, *db, dbd]
