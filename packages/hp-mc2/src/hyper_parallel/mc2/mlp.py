"""``mlp_block``: the plain (non-gated) MLP block of a tensor + sequence parallel layer as one
autograd function: ``up → act → down`` with one pipeline over row chunks, forward and backward.

Notation (README, "Design"): ``x`` ``[m, D]`` is this rank's rows, ``X = AllGather_m(x)``
``[ws·m, D]``; ``W_u`` ``[F/ws, D]`` and ``W_d`` ``[D, F/ws]`` are this rank's shards.

    U = X W_uᵀ + b_u,   H = act(U),   Y = ReduceScatter_m(H W_dᵀ) + b_d

Backward, with ``dY_full = AllGather_m(dY)``:

    dH = dY_full W_d,   dW_d = dY_fullᵀ H,   db_d = Σ dY_full
    dU = act'(U) ⊙ dH,   db_u = Σ dU,   dx = ReduceScatter_m(dU W_u),   dW_u = dUᵀ X

It runs the block engine (:mod:`hyper_parallel.mc2._block`) with one input projection
instead of the gated block's two; with ``impl="torch"``, in forward chunk j of ``X`` is
gathered under chunk j-1's up/act/down matmuls and chunk j's reduce-scatter runs under chunk
j+1's; in backward the ``dY`` chunks are gathered ahead and each ``dx`` chunk is
reduce-scattered under the ``dW_u`` matmul and the next chunk's work. Saved for backward: ``U``
(``act(U)`` is recomputed, one per-element pass) and the gathered ``X``, copied chunk by chunk
as it arrives. Unlike the gated block, the plain one does not gather ``X`` again in backward:
its backward has two matmuls fewer to hide the link under, and a third gather there (beside
``dY`` and the ``dx`` reduce-scatter: 3/4 of the blocking pair's link time under 2/3 of its
compute) would cap the hidden fraction at 0.75 instead of the forward's 0.83 (README, "Under a
modeled link"); the cost is ``X`` ``[ws·m, D]`` held per layer (with ``F = 4D`` and 2 ranks,
half of ``U``).
"""

from __future__ import annotations

from typing import Any

import torch

from hyper_parallel.dtensor.consistency import checked_entry
from hyper_parallel.mc2._block import block_fields, run_block
from hyper_parallel.mc2._hidden import Act
from hyper_parallel.mc2._keywords import impl_keyword

__all__ = ["mlp_block"]


@impl_keyword("mlp_block")
@checked_entry(
    "mlp_block",
    group="group",
    extra=lambda a: block_fields(
        a.x, (a.up_weight,), (a.up_bias,), a.down_weight, a.down_bias, a.group, a.act_fn,
        a.impl, a.chunks,
    ),
)  # fmt: skip
def mlp_block(
    x: torch.Tensor,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    group: Any = None,
    *,
    act_fn: Act,
    up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    impl: str = "auto",
    chunks: int | None = None,
) -> torch.Tensor:
    """Sequence + tensor parallel plain MLP ``Y = ReduceScatter_m(act(X W_uᵀ + b_u) W_dᵀ) +
    b_d`` with ``X = AllGather_m(x)``, one pipeline over row chunks in forward and backward.

    Args:
        x: ``[m, D]``, this rank's rows (a local tensor, not a DTensor); rank ``r`` holds rows
            ``r·m … (r+1)·m - 1`` of the gathered ``[ws·m, D]``.
        up_weight: ``[F/ws, D]``, this rank's output-feature shard.
        down_weight: ``[D, F/ws]``, this rank's input-feature shard.
        group: the tensor-parallel process group (``None``: the default group).
        act_fn: a per-element activation (see :mod:`hyper_parallel.mc2.activation`).
        up_bias: ``[F/ws]`` shard or ``None``; down_bias: ``[D]``, replicated, or ``None``.
        impl: ``"auto"``, ``"torch"`` (chunked async collectives overlapped with the matmuls)
            or ``"npu"`` (the torch_npu MC2 kernels, one phase at a time; ``backend=`` is its
            deprecated name).
        chunks: ``torch`` implementation only: pieces ``m`` is split into for overlap
            (``None``: from the shapes and device type alone, identical on every rank).

    Returns:
        ``[m, D]``: this rank's rows of the output. Gradients: ``dx`` ``[m, D]``, ``dW_u``,
        ``dW_d`` and ``db_u`` this rank's shards, ``db_d`` the full sum (replicated).

    Consistency mode (hp-dtensor's README, "Ranks that disagree"): the ranks of ``group``
    compare ``x``, both weights, the biases, the chosen ``impl``, ``chunks`` and the group
    size.
    """
    return run_block(
        x, (up_weight,), (up_bias,), down_weight, down_bias, group, act_fn, impl, chunks
    )
