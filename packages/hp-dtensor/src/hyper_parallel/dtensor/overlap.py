"""The overlapped-exchange node pair: launch a collective in one autograd node, wait it in
another, so that whatever autograd runs between the two hides the communication, in forward
and in backward.

An *exchange* is any object with the four methods of :class:`Exchange`: ``start(x)`` starts its
forward collective on ``x`` and ``finish()`` waits it and returns the result; ``start_grad(g)``
starts the collective of the gradient (on the result's gradient ``g``) and ``finish_grad()``
waits it and returns the gradient of ``x``. The exchange owns the collectives in flight; the
nodes here only decide *when* each method runs:

- :func:`launch` (node 1): forward ``start(x)``; backward ``finish_grad()``.
- :func:`wait` (node 2): forward ``finish()``; backward ``start_grad(grad)``.
- :func:`blocking`: the same exchange as one node (start and finish at once, both ways): the
  reference twin of a launch/wait pair.

The token :func:`launch` returns (an empty tensor) orders the two nodes in the graph. ``anchors``
(tensors that require grad, e.g. an empty slice of a weight) keep a pair in the autograd graph
when ``x`` itself does not require grad on some rank (a rank with no rows to send still has to
run the backward collective that other ranks' gradients need): their gradient is ``None``.
Layers using the pair: hp-context-parallel (MLA's all-to-alls), hp-kda-kernels (the halo and
the state exchange) and hp-moe (dispatch and combine).
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor
from torch.autograd import Function

__all__ = ["Exchange", "blocking", "launch", "wait"]


class Exchange(Protocol):
    """What the node pair drives; one owner of the collective in flight in each direction."""

    def start(self, x: Tensor) -> None:
        """Start the forward collective on ``x``."""
        ...

    def finish(self) -> Tensor:
        """Wait the forward collective; its result."""
        ...

    def start_grad(self, grad: Tensor) -> None:
        """Start the gradient's collective on the result's gradient ``grad``."""
        ...

    def finish_grad(self) -> Tensor:
        """Wait the gradient's collective; the gradient of the forward input."""
        ...


class _Launch(Function):
    @staticmethod
    def forward(ctx: Any, ex: Exchange, x: Tensor, *anchors: Tensor) -> Tensor:  # type: ignore[override]
        ex.start(x)
        ctx.ex, ctx.anchors = ex, len(anchors)
        return x.new_empty(0)

    @staticmethod
    def backward(ctx: Any, _token_grad: Tensor) -> Any:  # type: ignore[override]
        return (None, ctx.ex.finish_grad(), *([None] * ctx.anchors))


class _Wait(Function):
    @staticmethod
    def forward(ctx: Any, ex: Exchange, token: Tensor) -> Tensor:  # type: ignore[override]
        ctx.ex = ex
        return ex.finish()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:  # type: ignore[override]
        ctx.ex.start_grad(grad.contiguous())
        return None, grad.new_empty(0)


class _Blocking(Function):
    @staticmethod
    def forward(ctx: Any, ex: Exchange, x: Tensor, *anchors: Tensor) -> Tensor:  # type: ignore[override]
        ctx.ex, ctx.anchors = ex, len(anchors)
        ex.start(x)
        return ex.finish()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:  # type: ignore[override]
        ctx.ex.start_grad(grad.contiguous())
        return (None, ctx.ex.finish_grad(), *([None] * ctx.anchors))


def launch(ex: Exchange, x: Tensor, *anchors: Tensor) -> Tensor:
    """Start ``ex`` on ``x``; returns the empty token :func:`wait` consumes. ``anchors``: see
    the module docstring."""
    return _Launch.apply(ex, x, *anchors)


def wait(ex: Exchange, token: Tensor) -> Tensor:
    """Finish ``ex`` (started by :func:`launch`); the differentiable result."""
    return _Wait.apply(ex, token)


def blocking(ex: Exchange, x: Tensor, *anchors: Tensor) -> Tensor:
    """``ex`` started and finished at once, in forward and in backward (the reference twin of a
    :func:`launch` / :func:`wait` pair)."""
    return _Blocking.apply(ex, x, *anchors)
