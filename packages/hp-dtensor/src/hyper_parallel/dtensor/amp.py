"""``torch.autocast`` at the boundary of a custom autograd function, for every layer.

Autocast casts the operands of each eligible op as it runs. Inside a custom autograd
function that is wrong in two ways: its forward runs under the caller's autocast and its
backward (usually) outside it, so backward's matmuls meet a bf16 gradient and a float32
weight; and buffers allocated from an input's dtype (float32) receive products in the autocast
dtype, so a collective would join tensors of two dtypes. A layer's fused function therefore
does what autocast would do to its ``F.linear`` calls itself, at its boundary:

- :func:`cast_for_autocast` the floating operands to the autocast dtype before the function
  starts (differentiably: gradients flow back through the cast in each operand's own dtype);
- run the function's forward and backward with autocast off (:func:`autocast_off`,
  :func:`without_autocast`), so every matmul, buffer and collective works in one dtype, that of
  what it carries;
- or, for a core that must stay float32 under autocast (KDA's state and summaries), run it with
  autocast off and let it cast its inputs to float32 itself (:func:`without_autocast`).

Like autocast, float64 operands are never cast. All functions are no-ops when autocast is off
for the device in question, and the decision depends on the calling thread's autocast state
only: the same on every rank that runs the same code under the same autocast.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

__all__ = ["autocast_dtype", "autocast_off", "cast_for_autocast", "without_autocast"]

F = TypeVar("F", bound=Callable[..., Any])
_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)  # autocast never casts float64


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype for ``device_type`` ("cpu", "cuda", "npu", ...) when autocast is on
    there in this thread, else None (also for a device type autocast does not know)."""
    try:
        if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except (RuntimeError, TypeError):
        pass
    return None


def cast_for_autocast(device_type: str, *tensors: Any) -> tuple[Any, ...]:
    """``tensors`` as autocast would hand them to ``F.linear`` on ``device_type``: floating
    fp32/fp16/bf16 tensors on that device in the autocast dtype; anything else (None, float64,
    integers, a tensor on another device) unchanged. Everything unchanged when autocast is
    off."""
    dt = autocast_dtype(device_type)
    if dt is None:
        return tensors
    return tuple(
        t.to(dt)
        if isinstance(t, torch.Tensor) and t.device.type == device_type and t.dtype in _CASTABLE
        else t
        for t in tensors
    )


@contextlib.contextmanager
def autocast_off(device_type: str) -> Iterator[None]:
    """Autocast off for ``device_type`` inside the block (nothing to do when it is off)."""
    if autocast_dtype(device_type) is None:
        yield
        return
    with torch.autocast(device_type=device_type, enabled=False):
        yield


def without_autocast(fn: F) -> F:
    """``fn`` run with autocast off for the device of its first tensor argument (positional,
    then keyword); a no-op outside autocast. For a custom function's forward and backward
    alike, so that backward computes in the dtypes forward did even when it is called inside an
    autocast region."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        dev = next(
            (a.device.type for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)),
            None,
        )
        if dev is None:
            return fn(*args, **kwargs)
        with autocast_off(dev):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
