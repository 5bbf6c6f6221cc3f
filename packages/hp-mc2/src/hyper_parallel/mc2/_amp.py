"""``torch.autocast`` at the boundary of the fused linear layers.

Inside a custom autograd function autocast would cast each matmul on its own: the products
come out in the autocast dtype (bf16/fp16) while buffers allocated from the input or weight
dtype (fp32) would receive them, and the collective would join tensors of two dtypes. So each
entry point does what autocast does to ``F.linear`` before the function starts: the floating
operands (x, weights, biases) are cast to the autocast dtype, differentiably, outside the
function (their gradients flow back in their own dtypes through the cast), and the function
then runs forward and backward with autocast off, every matmul, buffer and collective in that
one dtype (the dtype of what they carry). Like autocast, float64 operands are left alone.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

__all__ = ["autocast_dtype", "cast_for_autocast", "autocast_off", "without_autocast"]

F = TypeVar("F", bound=Callable[..., Any])
_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)  # autocast never casts float64


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype for ``device_type`` when autocast is on there, else None."""
    try:
        if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except (RuntimeError, TypeError):  # a device type autocast does not know
        pass
    return None


def cast_for_autocast(device_type: str, *tensors: Any) -> tuple[Any, ...]:
    """``tensors`` as autocast would hand them to ``F.linear`` on ``device_type``: floating
    fp32/fp16/bf16 tensors in the autocast dtype; anything else (None, float64, a tensor on
    another device) unchanged. Unchanged everywhere when autocast is off."""
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
    """``fn`` (a custom function's backward) run with autocast off for the device of its first
    tensor argument, so backward computes in the dtypes forward did even when it is called
    inside an autocast region."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        dev = next((a.device.type for a in args if isinstance(a, torch.Tensor)), None)
        if dev is None:
            return fn(*args, **kwargs)
        with autocast_off(dev):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
