"""``backend=`` is the deprecated alias of ``impl=`` (the matmul+collective implementation,
``"auto"`` / ``"torch"`` / ``"npu"``) in every public API: hp-dtensor's one renamed-keyword
shim, with this package's names."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from hyper_parallel.dtensor.renamed import renamed_keyword

__all__ = ["impl_keyword"]

_F = TypeVar("_F", bound=Callable[..., Any])


def impl_keyword(where: str) -> Callable[[_F], _F]:
    """Decorator: the function (or ``__init__``) takes ``impl=`` and still accepts the
    deprecated ``backend=`` for it."""
    return renamed_keyword(where, "backend", "impl", "the matmul+collective implementation")
