"""Head groups of the pipelined Ulysses schedule: how many, and how a tensor splits into them.

Notation: P ranks, H heads, ``h = H/P`` heads of rank r's share after the sequence→head
exchange (global heads ``[r·h, (r+1)·h)``), G head groups of ``hg = h/G`` heads each. Group
``g`` of rank r holds the global heads ``r·h + g·hg + i`` (``i < hg``): every rank's share is
split the same way, so the exchange of one group is an ordinary Ulysses all-to-all of a
tensor with ``P·hg`` heads — chunk j of its head dim is group g of rank j's share.

- :func:`split_heads` (``[B, S/P, H, d] -> G × [B, S/P, P·hg, d]``, one autograd node: its
  backward stacks the G gradients, no zero-filled copies) and :func:`merge_heads` (the
  inverse, for the ``[B, S/P, P·hg, dv]`` outputs coming back from the head→seq exchange);
- :func:`choose_head_groups`: the ``head_groups="auto"`` rule, a pure function of shapes, the
  CP size and the device type (the same on every rank, so every rank issues the same
  collectives), with the reason it gives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "AUTO_MAX_GROUPS",
    "AUTO_MIN_GROUP_BYTES",
    "AUTO_MIN_GROUP_BYTES_ACCELERATOR",
    "HeadGroups",
    "check_head_groups",
    "choose_head_groups",
    "merge_heads",
    "split_heads",
]

AUTO_MAX_GROUPS = 8  # G = 8 hid more than G = 4 in every modeled-link run (README)
# the smallest query exchange of one group (bytes sent per rank) worth its own collective:
# measured on CPU/gloo under the modeled link; on accelerators, whose links carry a group of
# this size in microseconds, a conservative floor that keeps the launches few (not measured)
AUTO_MIN_GROUP_BYTES = {"cpu": 256 * 1024}
AUTO_MIN_GROUP_BYTES_ACCELERATOR = 8 * 1024 * 1024


@dataclass(frozen=True)
class HeadGroups:
    """The head-group count a forward uses and why (``reason``: one sentence)."""

    count: int
    reason: str


def choose_head_groups(
    heads_per_rank: int,
    tokens_per_rank: int,
    batch: int,
    q_head_dim: int,
    element_size: int,
    cp_size: int,
    device_type: str,
    overlap: bool,
) -> HeadGroups:
    """The ``"auto"`` head-group count: the largest ``G <= AUTO_MAX_GROUPS`` dividing
    ``heads_per_rank`` whose per-group query exchange (``batch · tokens_per_rank ·
    (P·h/G) · q_head_dim · element_size`` bytes sent per rank) is at least the device type's
    floor (``AUTO_MIN_GROUP_BYTES[device_type]``, else ``AUTO_MIN_GROUP_BYTES_ACCELERATOR``);
    1 without overlap or with one rank (nothing to pipeline).

    The same arguments give the same count on every rank: it depends on shapes, the CP size and
    the device type only.
    """
    if not overlap:
        return HeadGroups(1, "overlap=False: blocking collectives, nothing to pipeline")
    if cp_size == 1:
        return HeadGroups(1, "one rank: no exchange to pipeline")
    floor = AUTO_MIN_GROUP_BYTES.get(device_type, AUTO_MIN_GROUP_BYTES_ACCELERATOR)
    best = 1
    for g in range(2, AUTO_MAX_GROUPS + 1):
        if heads_per_rank % g:
            continue
        group_bytes = batch * tokens_per_rank * cp_size * (heads_per_rank // g)
        if group_bytes * q_head_dim * element_size >= floor:
            best = g
    what = (
        f"{heads_per_rank} heads per rank with a query exchange of at least {floor} bytes "
        f"per group on {device_type}"
    )
    if best == 1:
        return HeadGroups(
            1,
            f"no G in 2..{AUTO_MAX_GROUPS} divides the {what}",
        )
    return HeadGroups(
        best,
        f"largest G <= {AUTO_MAX_GROUPS} dividing the {what}",
    )


def split_heads(x: Tensor, cp_size: int, groups: int) -> tuple[Tensor, ...]:
    """``x [B, S/P, H, d] -> G`` tensors ``[B, S/P, P·hg, d]``: group g holds, for each rank
    j in order, the heads ``j·h + g·hg + i`` (``h = H/P``, ``hg = h/G``)."""
    b, s, heads, d = x.shape
    hg = heads // (cp_size * groups)
    parts = x.view(b, s, cp_size, groups, hg, d).unbind(3)
    return tuple(p.reshape(b, s, cp_size * hg, d) for p in parts)


def merge_heads(parts: list[Tensor] | tuple[Tensor, ...], cp_size: int) -> Tensor:
    """The inverse of :func:`split_heads`: G tensors ``[B, S/P, P·hg, d] -> [B, S/P, H, d]``."""
    b, s, phg, d = parts[0].shape
    hg = phg // cp_size
    stacked = torch.stack([p.view(b, s, cp_size, hg, d) for p in parts], dim=3)
    return stacked.view(b, s, cp_size * len(parts) * hg, d)


def check_head_groups(head_groups: object, heads_per_rank: int, overlap: bool) -> None:
    """``ValueError`` unless ``head_groups`` is ``"auto"`` or a positive int dividing
    ``heads_per_rank`` (above 1 only with ``overlap``); the rewrites' argument check."""
    if head_groups == "auto" and isinstance(head_groups, str):
        return
    if not isinstance(head_groups, int) or isinstance(head_groups, bool) or head_groups < 1:
        raise ValueError(f"head_groups must be 'auto' or a positive int, got {head_groups!r}")
    if heads_per_rank % head_groups:
        raise ValueError(
            f"head_groups={head_groups} does not divide the {heads_per_rank} heads per rank "
            "(num_heads / CP size)"
        )
    if head_groups > 1 and not overlap:
        raise ValueError(
            f"head_groups={head_groups} pipelines overlapped exchanges; it needs overlap=True"
        )
