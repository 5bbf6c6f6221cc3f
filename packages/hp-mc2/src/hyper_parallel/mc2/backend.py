"""Deprecated module: what it held now lives where its implementation does. Re-exports the
same objects and warns on import:

- ``select_backend``: :mod:`hyper_parallel.mc2.impls` (also ``hyper_parallel.mc2``), with the
  implementations' registry (``IMPLS``; ``BACKENDS`` is ``impl_choices()``);
- ``npu_constraint_failure``: :mod:`hyper_parallel.mc2._npu_impl` (also ``hyper_parallel.mc2``);
- ``default_chunks``: :mod:`hyper_parallel.mc2._chunked` (also ``hyper_parallel.mc2``);
- ``OPS``, ``dtype_name``: :mod:`hyper_parallel.mc2._operands`.
"""

from __future__ import annotations

import warnings

from hyper_parallel.mc2._chunked import default_chunks
from hyper_parallel.mc2._npu_impl import K_MAX as K_MAX
from hyper_parallel.mc2._npu_impl import K_MIN as K_MIN
from hyper_parallel.mc2._npu_impl import npu_constraint_failure
from hyper_parallel.mc2._operands import OPS
from hyper_parallel.mc2._operands import Op as Op
from hyper_parallel.mc2._operands import dtype_name as dtype_name
from hyper_parallel.mc2.impls import impl_choices, select_backend

__all__ = ["BACKENDS", "OPS", "default_chunks", "npu_constraint_failure", "select_backend"]

BACKENDS = impl_choices()

warnings.warn(
    "hyper_parallel.mc2.backend is deprecated: import select_backend, npu_constraint_failure and "
    "default_chunks from hyper_parallel.mc2 (the same objects)",
    DeprecationWarning,
    stacklevel=2,
)
