"""Async all-gather / reduce-scatter along dim 0 on any process group, returning work handles.

torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``*_single`` and
warns on the old names; older torch (2.7.1 on Ascend) only has the old ones. Both names run the
same ``_allgather_base`` / ``_reduce_scatter_base`` kernels (gloo, NCCL and HCCL all have them).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _Done:
    """Work handle of a collective that had nothing to do."""

    def wait(self) -> bool:
        return True


def all_gather_async(out: torch.Tensor, inp: torch.Tensor, group: Any) -> Any:
    """Start ``out = cat([inp of rank r for r in group], dim=0)``; ``out`` must be contiguous."""
    if inp.numel() == 0:
        return _Done()
    return _all_gather(out.view(-1, *inp.shape[1:]), inp.contiguous(), group=group, async_op=True)


def reduce_scatter_async(out: torch.Tensor, inp: torch.Tensor, group: Any) -> Any:
    """Start ``out = (Σ_ranks inp)[rank·len(out) : (rank+1)·len(out)]`` along dim 0."""
    if out.numel() == 0:
        return _Done()
    flat = inp.contiguous().view(-1, *out.shape[1:])
    return _reduce_scatter(out, flat, op=dist.ReduceOp.SUM, group=group, async_op=True)
