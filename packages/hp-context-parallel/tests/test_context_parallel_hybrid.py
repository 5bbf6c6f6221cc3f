"""hybrid_meshes groups and hybrid Ulysses × all-gather attention against serial attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _cp_testutil import TIMEOUT, full_tensor, rank_hybrid_attention, rank_hybrid_groups

from hyper_parallel.dtensor.testing import run_distributed


@pytest.mark.parametrize(
    "world,degree,ulysses,gather",
    [
        (4, 2, [{0, 1}, {2, 3}], [{0, 2}, {1, 3}]),
        (8, 2, [{0, 1}, {2, 3}, {4, 5}, {6, 7}], [{0, 2, 4, 6}, {1, 3, 5, 7}]),
        (8, 4, [{0, 1, 2, 3}, {4, 5, 6, 7}], [{0, 4}, {1, 5}, {2, 6}, {3, 7}]),
    ],
)
def test_hybrid_meshes_put_ulysses_on_contiguous_ranks_and_gather_across(
    world, degree, ulysses, gather
):
    results = run_distributed(rank_hybrid_groups, world, degree, timeout=TIMEOUT)
    for r, (u, g) in enumerate(results):
        assert set(u) in ulysses and r in u
        assert set(g) in gather and r in g
        assert list(u) == sorted(u) and list(g) == sorted(g)  # group order = mesh order


@pytest.mark.parametrize("world,degree", [(4, 2), (8, 2)])
def test_hybrid_attention_equals_serial_causal_attention_with_gradients(world, degree):
    shape = (2, 16, 4, 3)  # [B, S, H, d]
    results = run_distributed(rank_hybrid_attention, world, degree, shape, timeout=TIMEOUT)
    q, k, v, dy = (full_tensor(shape, seed=s) / 50 for s in (1, 2, 3, 4))
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    ref = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
    ).transpose(1, 2)
    ref.backward(dy)
    tol = dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(torch.cat([r["out"] for r in results], 1), ref.detach(), **tol)
    for name, t in (("dq", q), ("dk", k), ("dv", v)):
        torch.testing.assert_close(torch.cat([r[name] for r in results], 1), t.grad, **tol)
