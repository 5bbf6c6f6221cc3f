"""``impl="torch"``: :class:`TorchChunkedImpl`, the chunked async collectives overlapped with
the matmuls on any process group (gloo, NCCL, HCCL). The duals' decompositions live in
:mod:`hyper_parallel.mc2._chunked`, the block's pipeline in :mod:`hyper_parallel.mc2._pipeline`;
this class is their :class:`~hyper_parallel.mc2.impls.MC2Impl` face."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from hyper_parallel.mc2._chunked import (
    Splits,
    gather_matmuls,
    matmul_reduce_scatter_bwd,
    matmul_reduce_scatter_fwd,
    matmuls_reduce_scatter_grads,
    splits,
)
from hyper_parallel.mc2._hidden import Act
from hyper_parallel.mc2._pipeline import pipelined_backward, pipelined_forward

if TYPE_CHECKING:
    from hyper_parallel.mc2._operands import Op
    from hyper_parallel.mc2.impls import Call, Grad

__all__ = ["TorchChunkedImpl"]


@dataclass(frozen=True)
class _Chunked:
    """A forward's state for its backward: the group and the row chunks it used."""

    group: Any
    ws: int
    parts: Splits


class TorchChunkedImpl:
    """Row chunks, one chunk's async collective under another chunk's matmul, forward and
    backward; runs anything (``impl="auto"`` falls back to it)."""

    name = "torch"
    requested_reason = "impl='torch' requested"
    auto_reason = "the chunked collectives run on any process group"

    def failure(self, op: Op, x: torch.Tensor, weight: torch.Tensor, group: Any) -> str | None:
        return None

    def column_forward(
        self, call: Call, x: torch.Tensor, weight: torch.Tensor, *, keep_x: bool
    ) -> tuple[torch.Tensor, list[torch.Tensor], Any]:
        state = _Chunked(call.group, call.ws, splits(x.shape[0], call.chunks))
        (y,), kept = gather_matmuls(x, [weight], call.group, call.ws, state.parts, keep=keep_x)
        return y, kept, state

    def column_backward(
        self,
        state: _Chunked,
        dy: torch.Tensor,
        weight: torch.Tensor,
        kept: Sequence[torch.Tensor],
        *,
        need_dx: bool,
        need_dw: bool,
    ) -> tuple[Grad, Grad]:
        dx, (dw,) = matmuls_reduce_scatter_grads(
            [dy], [weight], None, kept, state.group, state.ws, state.parts,
            need_dx=need_dx, need_dw=[need_dw],
        )  # fmt: skip
        return dx, dw

    def row_forward(
        self, call: Call, x: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, Any]:
        state = _Chunked(call.group, call.ws, splits(x.shape[0] // call.ws, call.chunks))
        return matmul_reduce_scatter_fwd(x, weight, call.group, call.ws, state.parts), state

    def row_backward(
        self,
        state: _Chunked,
        dy: torch.Tensor,
        x: torch.Tensor,
        weight: torch.Tensor,
        *,
        need_dx: bool,
        need_dw: bool,
        need_db: bool,
    ) -> tuple[Grad, Grad, Grad]:
        return matmul_reduce_scatter_bwd(
            dy, x, weight, state.group, state.ws, state.parts,
            need_dx=need_dx, need_dw=need_dw, need_db=need_db,
        )  # fmt: skip

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
        state = _Chunked(call.group, call.ws, splits(x.shape[0], call.chunks))
        y, pre, big_x = pipelined_forward(
            x, w_in, wd, b_in, act, call.group, call.ws, state.parts, keep_x
        )
        return y, pre, big_x, state

    def block_backward(
        self,
        state: _Chunked,
        dy: torch.Tensor,
        x: torch.Tensor,
        pre: tuple[torch.Tensor, ...],
        w_in: tuple[torch.Tensor, ...],
        wd: torch.Tensor,
        act: Act,
        need: tuple[bool, ...],
        saved_x: torch.Tensor | None,
    ) -> list[Grad]:
        return pipelined_backward(
            dy, x, pre, w_in, wd, act, state.group, state.ws, state.parts, need, saved_x
        )
