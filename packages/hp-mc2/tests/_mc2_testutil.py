"""Shared helpers of the hp-mc2 tests: seeded global tensors and float64 references."""

from __future__ import annotations

import torch
import torch.distributed as dist


def seeded(seed: int, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The same tensor on every rank (a per-call generator, independent of the global seed)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def rank_and_size() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def max_err(got: torch.Tensor | None, want: torch.Tensor) -> float:
    """Largest absolute difference, scaled by the reference's magnitude (at least 1)."""
    if got is None:
        return float("inf")
    got = got.to_local() if hasattr(got, "to_local") else got
    scale = max(1.0, want.abs().max().item())
    return (got.double() - want.double()).abs().max().item() / scale


def column_reference(x, w, b, dy):
    """Float64 single-process Y = X Wᵀ + b and its gradients (full, unsharded tensors)."""
    x, w, dy = x.double(), w.double(), dy.double()
    y = x @ w.t() + (0 if b is None else b.double())
    return y, dy @ w, dy.t() @ x, dy.sum(0)


def group_still_works() -> bool:
    """True when a collective after the test's errors gives the right answer on this rank."""
    ws = dist.get_world_size()
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item() == ws * (ws + 1) / 2
