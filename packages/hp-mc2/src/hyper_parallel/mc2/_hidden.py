"""The MLP block's activation step, shared by every implementation: ``H`` from the
pre-activations, ``H = act(G) ⊙ U`` (gated, ``pre = (G, U)``) or ``H = act(U)`` (plain,
``pre = (U,)``), and in backward ``H`` again with the pre-activation gradients

    gated:  dU = dH ⊙ act(G),   dG = act'(G) ⊙ dH ⊙ U          plain:  dU = act'(U) ⊙ dH

``act'`` by autograd on the module's own ``act``, which must be per-element
(:mod:`hyper_parallel.mc2.activation`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Act", "backward_activation", "hidden"]

Act = Callable[[torch.Tensor], torch.Tensor]


def _gated(act: Act, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``H = act(G) ⊙ U`` without touching ``G`` (an identity ``act`` returns ``G`` itself)."""
    a = act(g)
    if a.untyped_storage().data_ptr() == g.untyped_storage().data_ptr():
        return a * u
    return a.mul_(u)


def hidden(act: Act, pre: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``H`` from the pre-activations: ``act(G) ⊙ U`` (gated, ``pre = (G, U)``) or ``act(U)``
    (plain, ``pre = (U,)``); neither is overwritten."""
    return _gated(act, pre[0], pre[1]) if len(pre) == 2 else act(pre[0])


def backward_activation(
    act: Act, pre: tuple[torch.Tensor, ...], need_h: bool
) -> tuple[torch.Tensor | None, Callable[[torch.Tensor], tuple[Any, ...]]]:
    """``(H, grads)`` for backward, with ``act`` evaluated once for both: ``H`` as
    :func:`hidden` (the ``dW_d`` operand; ``None`` unless ``need_h``) and ``grads(dH)``, the
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
