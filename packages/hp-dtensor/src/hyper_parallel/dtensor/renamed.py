"""Renamed keywords: one shim for every layer, so an old keyword keeps working, warns the same
way and is refused the same way when given together with its new name.

A layer that renames a keyword of its public API (hp-mc2's ``backend=`` → ``impl=``,
hp-kda-kernels' ``backend=`` → ``kernel=``) decorates each such function (or ``__init__``) with
:func:`renamed_keyword`: a call passing the old name gets a ``DeprecationWarning`` attributed to
the caller's line and runs as if it had passed the new one; a call passing both (the new one
by keyword or by position) raises ``TypeError`` naming both, before the function runs (so
alike on every rank, before any communication).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["renamed_keyword"]

_F = TypeVar("_F", bound=Callable[..., Any])


def renamed_keyword(what: str, old: str, new: str, meaning: str) -> Callable[[_F], _F]:
    """Decorate a function whose parameter ``new`` was called ``old``.

    ``what`` names the function in messages, ``meaning`` says in a few words what the option
    is (``"the merge/scan fold kernel"``)::

        @renamed_keyword("affine_merge", "backend", "kernel", "the fold kernel")
        def affine_merge(S, M, *, kernel="auto"): ...

        affine_merge(S, M, backend="torch")  # DeprecationWarning; runs with kernel="torch"
    """

    def decorate(fn: _F) -> _F:
        signature = inspect.signature(fn)
        if new not in signature.parameters:
            raise TypeError(f"renamed_keyword: {fn.__qualname__} has no parameter {new!r}")

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if old in kwargs:
                value = kwargs.pop(old)
                if new in signature.bind_partial(*args, **kwargs).arguments:
                    raise TypeError(
                        f"{what}: got both {new}= and {old}= ({old}= is the deprecated name of "
                        f"{new}=); pass {new}= only"
                    )
                warnings.warn(
                    f"{what}: {old}= is deprecated, use {new}= ({meaning})",
                    DeprecationWarning,
                    stacklevel=2,
                )
                kwargs[new] = value
            return fn(*args, **kwargs)

        return call  # type: ignore[return-value]

    return decorate
