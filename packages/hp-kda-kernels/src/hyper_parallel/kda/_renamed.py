"""``backend=`` → ``kernel=``: the one place the old keyword of this package is still accepted.

In hp-kda-kernels the option that picks the merge/scan fold kernel (``"auto"``, ``"torch"``,
``"triton"``) is called ``kernel=``. Its earlier name ``backend=`` still works everywhere it
did (and in ``parallelize_kda``): :func:`accepts_backend` turns it into ``kernel=`` with a
``DeprecationWarning`` pointing at the caller; passing both is a ``TypeError`` naming both,
raised before anything else runs (so on every rank alike, before any communication).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["accepts_backend"]

_F = TypeVar("_F", bound=Callable[..., Any])


def accepts_backend(what: str) -> Callable[[_F], _F]:
    """Decorate a function whose ``kernel`` parameter was called ``backend``: a call with
    ``backend=`` warns and passes it as ``kernel=``; with both, ``TypeError``."""

    def decorate(fn: _F) -> _F:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if "backend" in kwargs:
                backend = kwargs.pop("backend")
                if "kernel" in signature.bind_partial(*args, **kwargs).arguments:
                    raise TypeError(
                        f"{what}: got both kernel= and backend= (the deprecated name of "
                        "kernel=); pass kernel= only"
                    )
                warnings.warn(
                    f"{what}: backend= is deprecated, pass kernel= (the merge/scan fold kernel: "
                    "'auto', 'torch' or 'triton')",
                    DeprecationWarning,
                    stacklevel=2,
                )
                kwargs["kernel"] = backend
            return fn(*args, **kwargs)

        return call  # type: ignore[return-value]

    return decorate
