"""Deprecated alias of :mod:`hyper_parallel.mc2.blocking` (the blocking twins: distributed,
not a serial reference). Re-exports the same objects and warns on import."""

from __future__ import annotations

import warnings

from hyper_parallel.mc2.blocking import (
    all_gather_matmul_reference,
    gated_mlp_reference,
    matmul_reduce_scatter_reference,
    mlp_block_reference,
)

__all__ = [
    "all_gather_matmul_reference",
    "gated_mlp_reference",
    "matmul_reduce_scatter_reference",
    "mlp_block_reference",
]

warnings.warn(
    "hyper_parallel.mc2.reference is deprecated: import hyper_parallel.mc2.blocking (the same "
    "objects) or hyper_parallel.mc2",
    DeprecationWarning,
    stacklevel=2,
)
