"""The dim-0 tensor collectives every layer uses, under one name on every supported torch.

torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to
``all_gather_single`` / ``reduce_scatter_single`` and warns on the old names; older torch
(2.7.1, the Ascend baseline) has only the old ones. Both names run the same
``_allgather_base`` / ``_reduce_scatter_base`` kernels, which gloo, NCCL and HCCL all provide.
The layers call the functions here and nothing else, so a rank can never pick a different
collective from its peers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_gather_single", "reduce_scatter_single"]

# looked up at call time, so that a wrapper installed on ``torch.distributed`` (the benchmarks'
# simulated link) sees these calls too
_ALL_GATHER = (
    "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
)
_REDUCE_SCATTER = (
    "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
)


def all_gather_single(
    out: torch.Tensor, inp: torch.Tensor, group: Any = None, async_op: bool = False
) -> Any:
    """``out = cat([inp of rank r for r in group], dim=0)``.

    ``inp`` is ``[n, *rest]`` on every rank, ``out`` is ``[P·n, *rest]`` and contiguous.
    Returns a work handle when ``async_op`` (else ``None``, like torch).
    """
    return getattr(dist, _ALL_GATHER)(out, inp, group=group, async_op=async_op)


def reduce_scatter_single(
    out: torch.Tensor,
    inp: torch.Tensor,
    group: Any = None,
    async_op: bool = False,
    op: Any = dist.ReduceOp.SUM,
) -> Any:
    """``out = (Σ_ranks inp)[rank·n : (rank+1)·n]`` along dim 0.

    ``inp`` is ``[P·n, *rest]`` and contiguous on every rank, ``out`` is ``[n, *rest]``.
    """
    return getattr(dist, _REDUCE_SCATTER)(out, inp, op=op, group=group, async_op=async_op)
