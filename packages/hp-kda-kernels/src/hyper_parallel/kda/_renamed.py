"""``backend=`` → ``kernel=``: the one place the old keyword of this package is still accepted.

In hp-kda-kernels the option that picks the merge/scan fold kernel (``"auto"``, ``"torch"``,
``"triton"``) is called ``kernel=``. Its earlier name ``backend=`` still works everywhere it
did (and in ``parallelize_kda``), through hp-dtensor's one renamed-keyword shim: a
``DeprecationWarning`` pointing at the caller; passing both is a ``TypeError`` naming both,
raised before anything else runs (so on every rank alike, before any communication).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from hyper_parallel.dtensor.renamed import renamed_keyword

__all__ = ["accepts_backend"]

_F = TypeVar("_F", bound=Callable[..., Any])


def accepts_backend(what: str) -> Callable[[_F], _F]:
    """Decorate a function whose ``kernel`` parameter was called ``backend``."""
    return renamed_keyword(
        what, "backend", "kernel", "the merge/scan fold kernel: 'auto', 'torch' or 'triton'"
    )
