"""Autocast at the boundary of the KDA core: state and summaries stay float32.

Under ``torch.autocast`` every matmul of the chunked recurrence would run in the autocast
dtype (bf16/fp16) and the summaries ``(S, M)`` with it, while the exchange and the fold need
float32 summaries. :func:`fp32_core` runs a function with autocast switched off for the device
of its first tensor argument: the function casts its inputs to float32 itself and returns its
output in the caller's dtype, so autocast only decides what enters and leaves it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["autocast_active", "fp32_core"]

F = TypeVar("F", bound=Callable[..., Any])


def autocast_active(device_type: str) -> bool:
    """True when ``torch.autocast`` is on for ``device_type`` in this thread."""
    try:
        return bool(
            torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)
        )
    except (RuntimeError, TypeError):  # a device type autocast does not know
        return False


def _device_type(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device.type
    return None


def fp32_core(fn: F) -> F:
    """``fn`` run with autocast off for the device of its first tensor argument (a no-op
    outside autocast). Use on forwards and custom-autograd backwards alike, so that backward
    computes in the dtypes forward did even when it is called inside an autocast region."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        dev = _device_type(args, kwargs)
        if dev is None or not autocast_active(dev):
            return fn(*args, **kwargs)
        with torch.autocast(device_type=dev, enabled=False):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
