"""An exchange: one forward collective, its gradient's collective, and their launch/wait hand-off.

Kinds (P ranks, rank r holds sequence block r):
- ``"s2h"``: seq→head all-to-all ``[.., S/P, .., H, ..] -> [.., S, .., H/P, ..]``; its gradient
  is the head→seq all-to-all;
- ``"h2s"``: the inverse;
- ``"ag"``: all-gather along a dim; its gradient is the reduce-scatter (sum).

:class:`Exchange` is the only owner of the collective in flight between a launch and its wait,
in each direction: callers go through its typed methods (``start``/``finish`` in forward,
``start_grad``/``finish_grad`` in backward, ``run``/``run_grad`` for both at once), which
refuse a second start before a finish and a finish without a start.

An overlapped exchange is two autograd nodes, hp-dtensor's overlapped-exchange node pair
(:mod:`hyper_parallel.dtensor.overlap`, which drives an :class:`Exchange` through its four
methods): :func:`launch` starts it in forward and, in backward, finishes the gradient's
collective; :func:`wait` finishes it in forward and, in backward, starts the gradient's
collective. Whatever autograd runs between the two nodes overlaps the communication.
:func:`blocking` is the same exchange as one node. The three functions here only keep this
package's argument order (tensor first).
"""

from __future__ import annotations

from typing import Literal

from torch import Tensor

from hyper_parallel.context_parallel.transport import (
    Group,
    Work,
    start_all_gather,
    start_all_to_all,
    start_reduce_scatter,
)
from hyper_parallel.dtensor import overlap

__all__ = ["Exchange", "ExchangeKind", "blocking", "launch", "wait"]

ExchangeKind = Literal["s2h", "h2s", "ag"]


class Exchange:
    """One exchange over ``group``. ``seq_dim``: the sequence dim (the gather dim for
    ``"ag"``); ``head_dim``: the head dim (unused for ``"ag"``). ``name`` labels the recorded
    events (``a2a:q``; the gradient's is ``a2a:dq``); ``owner`` tags the pending registry."""

    __slots__ = ("_bwd", "_fwd", "group", "head_dim", "kind", "name", "owner", "seq_dim")

    def __init__(
        self, kind: ExchangeKind, group: Group, seq_dim: int, head_dim: int, name: str, owner: str
    ) -> None:
        self.kind, self.group, self.seq_dim, self.head_dim = kind, group, seq_dim, head_dim
        self.name, self.owner = name, owner
        self._fwd: Work | None = None
        self._bwd: Work | None = None

    # -- forward ------------------------------------------------------------------------
    def start(self, x: Tensor) -> None:
        """Start the forward collective on ``x`` (``RuntimeError`` if one is in flight)."""
        if self._fwd is not None:
            raise RuntimeError(f"{self.name}: forward collective already in flight")
        g, s, h = self.group, self.seq_dim, self.head_dim
        if self.kind == "s2h":
            self._fwd = start_all_to_all(x, h, s, g, self.name, "forward", self.owner)
        elif self.kind == "h2s":
            self._fwd = start_all_to_all(x, s, h, g, self.name, "forward", self.owner)
        else:
            self._fwd = start_all_gather(x, s, g, self.name, "forward", self.owner)

    def finish(self) -> Tensor:
        """Wait the forward collective; its result."""
        work, self._fwd = self._fwd, None
        if work is None:
            raise RuntimeError(f"{self.name}: no forward collective in flight")
        return work.wait()

    def run(self, x: Tensor) -> Tensor:
        self.start(x)
        return self.finish()

    # -- backward -----------------------------------------------------------------------
    def start_grad(self, grad: Tensor) -> None:
        """Start the gradient's collective on the result's gradient ``grad``."""
        if self._bwd is not None:
            raise RuntimeError(f"{self.name}: gradient collective already in flight")
        g, s, h = self.group, self.seq_dim, self.head_dim
        name, grad = _grad_name(self.name), grad.contiguous()
        if self.kind == "s2h":
            self._bwd = start_all_to_all(grad, s, h, g, name, "backward", self.owner)
        elif self.kind == "h2s":
            self._bwd = start_all_to_all(grad, h, s, g, name, "backward", self.owner)
        else:
            self._bwd = start_reduce_scatter(grad, s, g, name, "backward", self.owner)

    def finish_grad(self) -> Tensor:
        """Wait the gradient's collective; the gradient of the exchange's input."""
        work, self._bwd = self._bwd, None
        if work is None:
            raise RuntimeError(
                f"backward of {self.name}: the paired wait node never launched the gradient's "
                "collective (was the handle waited and its result used?)"
            )
        return work.wait()

    def run_grad(self, grad: Tensor) -> Tensor:
        self.start_grad(grad)
        return self.finish_grad()


def _grad_name(name: str) -> str:
    op, _, label = name.partition(":")
    inverse = {"a2a": "a2a", "all_gather": "reduce_scatter"}.get(op, op)
    return f"{inverse}:d{label}" if label else f"{inverse}:grad"


def launch(x: Tensor, ex: Exchange) -> Tensor:
    """Start ``ex`` on ``x``; returns an empty token that :func:`wait` consumes (the token
    orders the two nodes in the autograd graph). hp-dtensor's ``overlap.launch``."""
    return overlap.launch(ex, x)


def wait(token: Tensor, ex: Exchange) -> Tensor:
    """Finish ``ex`` (started by :func:`launch`); the differentiable result. hp-dtensor's
    ``overlap.wait``."""
    return overlap.wait(ex, token)


def blocking(x: Tensor, ex: Exchange) -> Tensor:
    """``ex`` started and finished at once, in forward and in backward. hp-dtensor's
    ``overlap.blocking``."""
    return overlap.blocking(ex, x)
