"""``gated_mlp``: the gated MLP block of a tensor + sequence parallel layer, one autograd
function over the block engine (:mod:`hyper_parallel.mc2._block`, with two input projections).

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

from typing import Any

import torch

from hyper_parallel.dtensor.consistency import checked_entry
from hyper_parallel.mc2._block import block_fields, run_block
from hyper_parallel.mc2._hidden import Act
from hyper_parallel.mc2._keywords import impl_keyword

__all__ = ["gated_mlp"]


@impl_keyword("gated_mlp")
@checked_entry(
    "gated_mlp",
    group="group",
    extra=lambda a: block_fields(
        a.x, (a.gate_weight, a.up_weight), (a.gate_bias, a.up_bias), a.down_weight,
        a.down_bias, a.group, a.act_fn, a.impl, a.chunks,
    ),
)  # fmt: skip
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
        chunks: ``torch`` implementation only: pieces ``m`` is split into for overlap
            (``None``: from the shapes and device type alone, identical on every rank).

    Returns:
        ``[m, D]``: this rank's rows of the output. Gradients: ``dx`` ``[m, D]``, the weight and
        gate/up bias gradients are this rank's shards, ``db_d`` the full sum (replicated).

    Consistency mode (hp-dtensor's README, "Ranks that disagree"): the ranks of ``group``
    compare ``x``, the three weights, the biases, the chosen ``impl``, ``chunks`` and the
    group size.
    """
    return run_block(
        x, (gate_weight, up_weight), (gate_bias, up_bias), down_weight, down_bias, group,
        act_fn, impl, chunks,
    )  # fmt: skip
