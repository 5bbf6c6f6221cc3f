"""Async dim-0 all-gather / reduce-scatter on any process group, returning work handles.

The collectives themselves are hp-dtensor's one shim over torch's renamed ``*_single`` /
``*_tensor`` functions; this module only adds the empty-tensor and one-rank shortcuts (the
same on every rank of a group, so every rank runs the same collectives).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hyper_parallel.dtensor import all_gather_single, reduce_scatter_single


class _Done:
    """Work handle of a collective that had nothing to do."""

    def wait(self) -> bool:
        return True


def all_gather_async(out: torch.Tensor, inp: torch.Tensor, group: Any) -> Any:
    """Start ``out = cat([inp of rank r for r in group], dim=0)``; ``out`` must be contiguous."""
    if inp.numel() == 0:
        return _Done()
    if dist.get_world_size(group) == 1:
        out.view_as(inp).copy_(inp)
        return _Done()
    return all_gather_single(out.view(-1, *inp.shape[1:]), inp.contiguous(), group, True)


def reduce_scatter_async(out: torch.Tensor, inp: torch.Tensor, group: Any) -> Any:
    """Start ``out = (Σ_ranks inp)[rank·len(out) : (rank+1)·len(out)]`` along dim 0."""
    if out.numel() == 0:
        return _Done()
    if dist.get_world_size(group) == 1:
        out.copy_(inp.reshape(out.shape))
        return _Done()
    flat = inp.contiguous().view(-1, *out.shape[1:])
    return reduce_scatter_single(out, flat, group, True)
