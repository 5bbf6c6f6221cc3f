"""Shared helpers for the hp-kda-kernels tests: seeded inputs and float64 reference folds."""

from __future__ import annotations

import uuid

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store


def kda_inputs(
    B: int, T: int, H: int, K: int, V: int, seed: int = 0, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, ...]:
    """``(q, k, v, g, beta, h0)`` with unit-norm keys and decaying gates (KDA's regime)."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = rnd(B, T, H, K)
    k = torch.nn.functional.normalize(rnd(B, T, H, K), dim=-1)
    v = rnd(B, T, H, V)
    g = -torch.rand(B, T, H, K, generator=gen, dtype=torch.float64) * 0.4
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    h0 = rnd(B, H, K, V)
    return tuple(x.to(dtype) for x in (q, k, v, g, beta, h0))


def random_summaries(
    P: int, B: int, H: int, K: int, V: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``states [P, B, H, K, V]`` and contractive-ish ``matrices [P, B, H, K, K]``."""
    gen = torch.Generator().manual_seed(seed)
    S = torch.randn(P, B, H, K, V, generator=gen, dtype=torch.float64)
    M = torch.randn(P, B, H, K, K, generator=gen, dtype=torch.float64) / K**0.5
    return S, M


def fold64(
    states: torch.Tensor,
    matrices: torch.Tensor,
    order: list[int],
    forward: bool,
    incoming: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """float64 fold over ``order``; returns the accumulator after 0, 1, …, len(order) steps."""
    acc = (
        torch.zeros_like(states[0], dtype=torch.float64) if incoming is None else incoming.double()
    )
    trail = [acc]
    for j in order:
        m = matrices[j].double()
        acc = (m if forward else m.transpose(-1, -2)) @ acc + states[j].double()
        trail.append(acc)
    return trail


def bounds(T: int, P: int) -> list[int]:
    """Uneven contiguous split points of ``T`` tokens over ``P`` ranks."""
    return [T * i // P for i in range(P + 1)]


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def compare_blocks(results: list, ref: tuple, tag: object, tol: float = 1e-5) -> None:
    """Ranks' ``(out block, input-gradient block, parameter gradients)`` against the serial
    ``ref = (out, input gradient, parameter gradients)``: the blocks concatenated along the
    sequence, the parameter gradients summed over the ranks; every parameter takes part."""
    out, x_grad, grads = ref
    assert max_rel_err(torch.cat([res[0] for res in results], dim=1), out) < tol, tag
    assert max_rel_err(torch.cat([res[1] for res in results], dim=1), x_grad) < tol, tag
    for name, want in grads.items():
        assert want.abs().max() > 0, (tag, name)
        assert max_rel_err(sum(res[2][name] for res in results), want) < tol, (tag, name)


def new_world() -> None:
    """Replace the default process group by a new one over the same ranks (every rank calls
    it), meeting again in the old world's store under a fresh prefix rank 0 names: a new TCP
    port found free could be taken by another process (another test lane's store) before this
    world's store binds it."""
    name = torch.zeros(32, dtype=torch.uint8)
    if dist.get_rank() == 0:
        name = torch.tensor(list(uuid.uuid4().hex.encode()), dtype=torch.uint8)
    dist.broadcast(name, src=0)
    store = _get_default_store()  # held here: it outlives the old group
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    prefix = f"new-world-{bytes(name.tolist()).decode()}/"
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(prefix, store), rank=rank, world_size=world
    )
