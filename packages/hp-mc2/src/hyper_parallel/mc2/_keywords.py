"""The one shim for renamed keywords: ``backend=`` is the deprecated alias of ``impl=`` (the
matmul+collective implementation, ``"auto"`` / ``"torch"`` / ``"npu"``) in every public API."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["impl_keyword", "take_impl"]

_F = TypeVar("_F", bound=Callable[..., Any])


def take_impl(where: str, kwargs: dict[str, Any], stacklevel: int = 3) -> None:
    """Move a deprecated ``backend=`` in ``kwargs`` to ``impl=`` (``DeprecationWarning``);
    ``TypeError`` naming both when both are given."""
    if "backend" not in kwargs:
        return
    if "impl" in kwargs:
        raise TypeError(
            f"{where}: got both impl= and backend= (backend= is the deprecated name of impl=); "
            "pass impl= only"
        )
    warnings.warn(
        f"{where}: backend= is deprecated, use impl= (the matmul+collective implementation)",
        DeprecationWarning,
        stacklevel=stacklevel,
    )
    kwargs["impl"] = kwargs.pop("backend")


def impl_keyword(where: str) -> Callable[[_F], _F]:
    """Decorator: the function (or ``__init__``) takes ``impl=`` and still accepts the
    deprecated ``backend=`` for it."""

    def decorate(fn: _F) -> _F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            take_impl(where, kwargs)
            return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
