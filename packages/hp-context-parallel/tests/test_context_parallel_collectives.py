"""Ulysses all-to-alls, async handles and the sequence all-gather, against the full tensor."""

from __future__ import annotations

import pytest
import torch
from _cp_testutil import (
    TIMEOUT,
    full_tensor,
    rank_all_gather,
    rank_pending_detection,
    rank_ulysses,
)

from hyper_parallel.dtensor.testing import run_distributed

LAYOUTS = [((2, 16, 8, 3), 1, 2), ((8, 2, 3, 16), 3, 0)]  # [B,S,H,d] and [H,B,d,S]


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("shape,seq_dim,head_dim", LAYOUTS)
def test_ulysses_layouts_round_trip_and_gradients_are_exact(world, shape, seq_dim, head_dim):
    results = run_distributed(rank_ulysses, world, shape, seq_dim, head_dim, timeout=TIMEOUT)
    x_full, w_full = full_tensor(shape), full_tensor(shape, seed=7)
    for r, res in enumerate(results):
        heads = x_full.chunk(world, head_dim)[r]  # every token, this rank's heads
        assert torch.equal(res["out"], heads)
        assert torch.equal(res["out_async"], heads)
        assert res["round_trip_exact"]
        # d/dx of sum(out * W[heads r]) is W restricted to this rank's tokens
        assert torch.equal(res["dx"], w_full.chunk(world, seq_dim)[r])
        assert torch.equal(res["dx_async"], res["dx"])
        # d/dy of sum(head_to_seq(y) * W[tokens r]) is W restricted to this rank's heads
        assert torch.equal(res["dy_h2s"], w_full.chunk(world, head_dim)[r])
        assert "already waited" in res["second_wait"]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dim", [1, -2])
def test_all_gather_gradient_is_reduce_scattered_sum_of_consumers(world, dim):
    results = run_distributed(rank_all_gather, world, dim, timeout=TIMEOUT)
    xs = [full_tensor((2, 3, 4), seed=100 + r) for r in range(world)]
    gathered = torch.cat(xs, dim=1)
    grad_full = sum(full_tensor(gathered.shape, seed=200 + r) for r in range(world))
    rs_full = sum(full_tensor((2, 3 * world, 4), seed=300 + r) for r in range(world))
    for r, res in enumerate(results):
        assert torch.equal(res["out"], gathered)
        assert torch.equal(res["dx"], grad_full.chunk(world, 1)[r])
        assert torch.equal(res["rs"], rs_full.chunk(world, 1)[r])
        assert res["pending"] == []


def test_size_one_mesh_makes_every_collective_the_identity():
    [res] = run_distributed(rank_ulysses, 1, (2, 4, 4, 3), 1, 2, timeout=TIMEOUT)
    assert torch.equal(res["out"], full_tensor((2, 4, 4, 3)))
    assert torch.equal(res["dx"], full_tensor((2, 4, 4, 3), seed=7))
    [ag] = run_distributed(rank_all_gather, 1, 1, timeout=TIMEOUT)
    assert torch.equal(ag["out"], full_tensor((2, 3, 4), seed=100))


def test_launched_never_waited_collective_is_reported_at_next_forward():
    for rep in run_distributed(rank_pending_detection, 2, timeout=TIMEOUT):
        assert rep["pending_user"] == ["a2a:mine (forward)"]
        assert rep["forward_with_user_handle"] == (2, 8, 24)
        assert rep["first_failure"] == "boom in the Q projection"
        assert rep["pending_after_failure"] == ["a2a:k (forward)", "a2a:v (forward)"]
        assert "never waited" in rep["forward_after_failure"]
        assert "a2a:k (forward)" in rep["forward_after_failure"]
        assert rep["pending_after_partial_grad"] == ["a2a:do (backward)"]
        assert "partial torch.autograd.grad" in rep["forward_after_partial_grad"]
        assert rep["works_after"]
        assert rep["pending_at_end"] == []
