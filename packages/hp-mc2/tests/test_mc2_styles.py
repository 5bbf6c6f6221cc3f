"""MC2ColwiseParallel + MC2RowwiseParallel as a drop-in for torch's own sequence-parallel
ColwiseParallel(input_layouts=Shard(seq)) + RowwiseParallel(output_layouts=Shard(seq)) pair,
and MC2Linear's conversion contract."""

from __future__ import annotations

import copy

import pytest
import torch
from _mc2_testutil import max_err, rank_and_size, seeded
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from hyper_parallel.dtensor import init_device_mesh
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.mc2 import MC2ColwiseParallel, MC2Linear, MC2RowwiseParallel

TIMEOUT = 90.0


class _MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int, bias: bool) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, ffn, bias=bias)
        self.down = nn.Linear(ffn, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


def _ours_vs_torch_pair(
    sequence_first: bool, dtype: torch.dtype, chunks: int | None, bias: bool
) -> dict[str, float]:
    r, ws = rank_and_size()
    mesh = init_device_mesh("cpu", (ws,))
    seq_dim = 0 if sequence_first else 1
    B, S, H, F = 3, 4 * ws, 16, 8 * ws
    torch.manual_seed(0)
    base = _MLP(H, F, bias).to(dtype)
    theirs, ours = copy.deepcopy(base), copy.deepcopy(base)
    parallelize_module(
        theirs,
        mesh,
        {
            "up": ColwiseParallel(input_layouts=Shard(seq_dim)),
            "down": RowwiseParallel(output_layouts=Shard(seq_dim)),
        },
    )
    parallelize_module(
        ours,
        mesh,
        {
            "up": MC2ColwiseParallel(seq_dim, chunks=chunks),
            "down": MC2RowwiseParallel(seq_dim, chunks=chunks),
        },
    )
    shape = (S, B, H) if sequence_first else (B, S, H)
    X, dY = seeded(1, *shape, dtype=dtype), seeded(2, *shape, dtype=dtype)
    local = X.chunk(ws, dim=seq_dim)[r]
    d_local = dY.chunk(ws, dim=seq_dim)[r]
    x1, x2 = local.clone().requires_grad_(), local.clone().requires_grad_()
    y1, y2 = theirs(x1), ours(x2)
    y1.backward(d_local)
    y2.backward(d_local)
    errs = {
        "y": max_err(y2, y1),
        "dx": max_err(x2.grad, x1.grad),
        "shape": float(y1.shape != y2.shape),
    }
    for (name, p1), (_, p2) in zip(theirs.named_parameters(), ours.named_parameters()):
        assert isinstance(p2, DTensor) and p2.placements == p1.placements, name
        errs[f"d{name}"] = max_err(p2.grad.to_local(), p1.grad.to_local())
    errs["is_mc2"] = float(isinstance(ours.up, MC2Linear) and isinstance(ours.down, MC2Linear))
    return errs


@pytest.mark.parametrize(
    "world_size,sequence_first,dtype,chunks,bias",
    [
        (2, False, torch.float32, None, True),
        (2, True, torch.float32, 3, True),
        (4, False, torch.float32, 2, False),
        (4, True, torch.float32, 1, True),
        (2, False, torch.bfloat16, 2, True),
        (4, True, torch.bfloat16, None, True),
    ],
    ids=[
        "bsh-fp32-ws2",
        "sbh-fp32-ws2",
        "bsh-fp32-ws4-nobias",
        "sbh-fp32-ws4",
        "bsh-bf16-ws2",
        "sbh-bf16-ws4",
    ],
)
def test_styles_equal_torch_sequence_parallel_pair(world_size, sequence_first, dtype, chunks, bias):
    results = run_distributed(
        _ours_vs_torch_pair, world_size, sequence_first, dtype, chunks, bias, timeout=TIMEOUT
    )
    # bf16: one bf16 rounding of differently ordered sums (ulp 2^-8 relative), a few ulps.
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for rank, errs in enumerate(results):
        assert errs.pop("is_mc2") == 1.0 and errs.pop("shape") == 0.0
        assert "dup.weight" in errs and "ddown.weight" in errs
        bad = {k: v for k, v in errs.items() if not v <= tol}
        assert not bad, f"rank {rank}: {bad}"


def test_from_linear_converts_in_place_keeping_parameters_and_plain_behaviour():
    torch.manual_seed(0)
    lin = nn.Linear(6, 4)
    reference = copy.deepcopy(lin)
    seen = []
    lin.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    weight, bias = lin.weight, lin.bias
    out = MC2Linear.from_linear(lin)
    assert out is lin and isinstance(lin, MC2Linear) and isinstance(lin, nn.Linear)
    assert lin.weight is weight and lin.bias is bias
    x = torch.randn(2, 3, 6, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = lin(x), reference(x_ref)
    assert torch.equal(y, y_ref)
    y.sum().backward()
    y_ref.sum().backward()
    assert torch.equal(x.grad, x_ref.grad) and torch.equal(lin.weight.grad, reference.weight.grad)
    assert seen == [torch.Size([2, 3, 4])]


def test_mc2linear_constructor_without_parallel_is_nn_linear():
    torch.manual_seed(0)
    ours = MC2Linear(5, 3, bias=False)
    torch.manual_seed(0)
    theirs = nn.Linear(5, 3, bias=False)
    x = torch.randn(4, 5)
    assert torch.equal(ours.weight, theirs.weight) and torch.equal(ours(x), theirs(x))


def _dtensor_io(sequence_first: bool) -> list[bool]:
    """DTensor in (sequence-sharded, or replicated) and use_local_output=False out."""
    r, ws = rank_and_size()
    mesh = init_device_mesh("cpu", (ws,))
    seq = 0 if sequence_first else 1
    torch.manual_seed(0)
    m = _MLP(8, 4 * ws, True)
    parallelize_module(
        m,
        mesh,
        {
            "up": MC2ColwiseParallel(seq, use_local_output=False),
            "down": MC2RowwiseParallel(seq, use_local_output=False),
        },
    )
    X = seeded(1, *((4 * ws, 2, 8) if sequence_first else (2, 4 * ws, 8)))
    x = DTensor.from_local(X.chunk(ws, dim=seq)[r], mesh, [Shard(seq)], run_check=False)
    h = m.up(x)
    y = m.down(torch.nn.functional.gelu(h))
    full = y.full_tensor()
    ref = torch.nn.functional.linear(
        torch.nn.functional.gelu(
            torch.nn.functional.linear(X, m.up.weight.full_tensor(), m.up.bias.full_tensor())
        ),
        m.down.weight.full_tensor(),
        m.down.bias.full_tensor(),
    )
    # a DTensor in another layout (replicated) is redistributed to the sequence shard first
    h_rep = m.up(DTensor.from_local(X, mesh, [Replicate()], run_check=False))
    return [
        max_err(h_rep.full_tensor(), h.full_tensor()) == 0.0,
        h.placements == (Shard(2),),
        y.placements == (Shard(seq),),
        max_err(full, ref) < 1e-5,
    ]


@pytest.mark.parametrize("sequence_first", [False, True], ids=["bsh", "sbh"])
def test_styles_accept_dtensor_input_and_return_dtensor_output(sequence_first):
    assert run_distributed(_dtensor_io, 2, sequence_first, timeout=TIMEOUT) == [[True] * 4] * 2
