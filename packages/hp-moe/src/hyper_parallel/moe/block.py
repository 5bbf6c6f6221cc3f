"""The forward of a stock Hugging Face 5.x MoE block whose experts are split by
:func:`~hyper_parallel.moe.parallelize_experts`: :func:`moe_block_forward`, and the block's
shared-expert work, :func:`shared_work`.

The blocks are recognised by attribute names, without importing transformers:

- ``gate``: the router, ``gate(hidden [B, S, H]) -> (router_logits [N, E],
  top_k_weights [N, K], top_k_index [N, K])`` with ``N = B·S`` (``DeepseekV3TopkRouter``,
  ``KimiLinearTopkRouter``, ``Qwen3NextTopKRouter``: each flattens the tokens itself);
- ``experts``: the experts module of the stock form (:data:`~hyper_parallel.moe.form.FORM`);
- the shared work on the block input, ``[B, S, H] -> [B, S, H]``: ``shared_experts(x)``
  (``DeepseekV3MoE``, ``KimiLinearMoE``: ungated), or
  ``sigmoid(shared_expert_gate(x)) * shared_expert(x)`` (``Qwen3NextSparseMoeBlock``:
  gated, ``shared_expert_gate`` a ``Linear(H, 1)``), or none.

The block's output is ``experts(x_flat, top_k_index, top_k_weights).view(B, S, H) + shared(x)``,
as the stock forwards compute it; with split experts the shared work runs while the first
dispatch is in flight (:func:`~hyper_parallel.moe.run_experts`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor, nn

from hyper_parallel.moe.parallelize import is_experts_parallel, run_experts

__all__ = ["moe_block_forward", "shared_work"]


def shared_work(block: nn.Module) -> Callable[[Tensor], Tensor] | None:
    """The shared-expert work of a stock MoE block, as a function of the block input
    ``x [B, S, H]`` (or ``[N, H]``) returning the same shape: ``block.shared_experts(x)``
    (DeepSeek-V3, Kimi-Linear), ``sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)``
    (Qwen3-Next, Qwen2-MoE: gated), ``block.shared_expert(x)`` (a ``shared_expert`` without a
    gate); ``None`` when the block has none of these. The modules are called (their hooks run).
    ``TypeError`` for a ``shared_expert_gate`` without a ``shared_expert``, or for both
    ``shared_experts`` and ``shared_expert`` (which one is meant cannot be told)."""
    shared = getattr(block, "shared_experts", None)
    expert = getattr(block, "shared_expert", None)
    gate = getattr(block, "shared_expert_gate", None)
    name = type(block).__name__
    if shared is not None and (expert is not None or gate is not None):
        raise TypeError(
            f"shared_work: {name} has both shared_experts and shared_expert(_gate); "
            "which one is the shared work cannot be told"
        )
    if shared is not None:
        if not callable(shared):
            raise TypeError(f"shared_work: {name}.shared_experts is not callable")
        return shared  # type: ignore[no-any-return]
    if gate is not None and expert is None:
        raise TypeError(f"shared_work: {name} has a shared_expert_gate but no shared_expert")
    if expert is None:
        return None
    if not callable(expert) or (gate is not None and not callable(gate)):
        raise TypeError(f"shared_work: {name}.shared_expert(_gate) is not callable")
    if gate is None:
        return expert  # type: ignore[no-any-return]

    def gated(x: Tensor) -> Tensor:
        # the stock Qwen3-Next order: the shared expert, then its gate
        y = expert(x)
        return torch.sigmoid(gate(x)) * y  # type: ignore[no-any-return]

    return gated


def moe_block_forward(
    block: nn.Module,
    hidden_states: Tensor,
    *,
    on_routing: Callable[[Tensor], Any] | None = None,
) -> Tensor:
    """The stock MoE block's output for ``hidden_states [B, S, H]`` (any ``[..., H]``), this
    rank's own tokens, with ``block.experts`` split by
    :func:`~hyper_parallel.moe.parallelize_experts` (every rank of its ep group calls this
    together; ``B·S`` may differ between ranks, also 0).

    ``block.gate(hidden_states)`` gives ``(_, top_k_weights [N, K], top_k_index [N, K])``;
    ``on_routing(top_k_index)`` is called with it if given (e.g. to record per-expert counts);
    the experts run on ``hidden_states`` flattened to ``[N, H]`` with :func:`shared_work`'s
    work on ``hidden_states`` run while the first dispatch is in flight
    (:func:`~hyper_parallel.moe.run_experts`); returns ``experts_out.view(B, S, H) + shared``
    (``[B, S, H]``, the experts' output in the hidden dtype plus the shared work's, as the stock
    forward adds them). On experts that are not split the same is computed serially (the stock
    forward's numbers).

    ``TypeError`` naming what is missing for a block without a callable ``gate`` or
    ``experts``, for a router that does not return three values, and from :func:`shared_work`."""
    name = type(block).__name__
    missing = [a for a in ("gate", "experts") if not callable(getattr(block, a, None))]
    if missing:
        raise TypeError(
            f"moe_block_forward: {name} has no {' and no '.join(missing)} "
            "(a MoE block with a router `gate` returning (logits, top_k_weights, top_k_index) "
            "and an `experts` module is needed)"
        )
    shared = shared_work(block)
    experts = cast(nn.Module, block.experts)
    shape = hidden_states.shape
    routed = cast(Callable[[Tensor], Any], block.gate)(hidden_states)
    if not isinstance(routed, (tuple, list)) or len(routed) != 3:
        raise TypeError(
            f"moe_block_forward: {name}.gate returned {type(routed).__name__}, not "
            "(router_logits, top_k_weights, top_k_index)"
        )
    _, top_k_weights, top_k_index = routed
    if on_routing is not None:
        on_routing(top_k_index)
    flat = hidden_states.reshape(-1, shape[-1])
    if not is_experts_parallel(experts):
        out = experts(flat, top_k_index, top_k_weights).view(shape)
        return out if shared is None else out + shared(hidden_states)
    if shared is None:
        out, _ = run_experts(experts, flat, top_k_index, top_k_weights)
        return out.view(shape)
    out, side = run_experts(
        experts, flat, top_k_index, top_k_weights, alongside=lambda: shared(hidden_states)
    )
    return out.view(shape) + side
