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

**In-flight points.** Right after :func:`launch` starts an exchange (forward) and right after
:func:`wait`'s backward starts the gradient's (backward), the pair calls :func:`in_flight`: a
collective of this rank is in flight and nothing of this computation needs it yet. By default
that does nothing. A micro-batch runner that interleaves two micro-batches (hp-models'
forward/backward overlap) installs a hook with :func:`in_flight_hook` that runs the *other*
micro-batch's work there, so each one's exchanges are in flight under the other's compute. The
points come in graph order, the same on every rank, so a runner that switches at them issues
every collective in the same order on every rank. A layer that starts a collective by other
means may call :func:`in_flight` itself, after the start and before the wait.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from torch import Tensor
from torch.autograd import Function

__all__ = ["Exchange", "blocking", "in_flight", "in_flight_hook", "launch", "wait"]

_hook: Callable[[], None] | None = None


def in_flight() -> None:
    """Mark a point where one of this rank's collectives is in flight (started, not yet
    waited): runs the hook of :func:`in_flight_hook`, if one is installed; else nothing."""
    if _hook is not None:
        _hook()


@contextlib.contextmanager
def in_flight_hook(hook: Callable[[], None]) -> Iterator[None]:
    """Run ``hook()`` at every :func:`in_flight` point inside the ``with`` block, on whatever
    thread reaches it (autograd may run a backward on its own device thread). Process-wide, not
    thread-local; hooks do not nest (``RuntimeError``)."""
    global _hook
    if _hook is not None:
        raise RuntimeError("in_flight_hook: a hook is already installed (they do not nest)")
    _hook = hook
    try:
        yield
    finally:
        _hook = None


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
        in_flight()
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
        in_flight()
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
