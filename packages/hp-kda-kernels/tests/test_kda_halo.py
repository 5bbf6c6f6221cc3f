"""causal_conv_halo on 4 gloo ranks: a depthwise causal convolution over ``[halo ; block]``
equals the serial zero-padded convolution on the whole sequence, values and input gradients
(the halo's gradient returns to the ranks that sent the rows), for blocks longer and shorter
than the window, empty blocks (first, middle, last), two exchanges in flight, a ProcessGroup
instead of a mesh, and the sequence on another dim."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hyper_parallel.dtensor import init_device_mesh
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.kda import causal_conv_halo, start_causal_conv_halo

P, B, C = 4, 2, 3
# (kernel width W, block cuts of the global sequence)
CASES = [
    (4, [0, 4, 8, 11, 16]),  # every block >= W-1: one hop
    (4, [0, 1, 2, 4, 9]),  # short blocks: the halo spans several ranks
    (4, [0, 5, 5, 9, 12]),  # an empty middle block
    (4, [0, 4, 8, 12, 12]),  # an empty last block
    (4, [0, 0, 0, 1, 6]),  # two empty blocks first
    (6, [0, 1, 3, 4, 8]),  # W-1 = 5 rows from up to three ranks
    (1, [0, 3, 5, 8, 9]),  # W = 1: nothing to exchange
]


def _data(T: int, W: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=gen, dtype=torch.float64)
    w = torch.randn(C, 1, W, generator=gen, dtype=torch.float64)
    return x, w


def _loss_weights(shape: torch.Size, r: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 + r), dtype=torch.float64)


def _conv(rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Depthwise convolution without padding along dim 1 of ``[B, L, C]``."""
    if rows.shape[1] < w.shape[-1]:
        return rows[:, :0]
    return F.conv1d(rows.transpose(1, 2), w, groups=C).transpose(1, 2)


def _halo_rank() -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (P,), mesh_dim_names=("cp",))
    r = dist.get_rank()
    out: dict[str, Any] = {"cases": []}
    for i, (W, cuts) in enumerate(CASES):
        x_full, w = _data(cuts[-1], W, seed=i)
        x = x_full[:, cuts[r] : cuts[r + 1]].clone().requires_grad_()
        halo = causal_conv_halo(x, W, mesh)
        y = _conv(torch.cat([halo, x], dim=1), w)
        (y * _loss_weights(y.shape, r)).sum().backward()
        out["cases"].append((halo.detach(), y.detach(), x.grad))
    # two exchanges in flight (over a ProcessGroup), sequence on the last dim
    (W, cuts) = CASES[1]
    x_full, w = _data(cuts[-1], W, seed=1)
    xa = x_full[:, cuts[r] : cuts[r + 1]].clone().requires_grad_()
    xb = (2 * x_full[:, cuts[r] : cuts[r + 1]]).transpose(1, 2).clone().requires_grad_()
    pa = start_causal_conv_halo(xa, W, dist.group.WORLD)
    pb = start_causal_conv_halo(xb, W, mesh, seq_dim=-1)
    ha, hb = pa.wait(), pb.wait().transpose(1, 2)
    ya = _conv(torch.cat([ha, xa], dim=1), w)
    yb = _conv(torch.cat([hb, xb.transpose(1, 2)], dim=1), w)
    ((ya + yb) * _loss_weights(ya.shape, r)).sum().backward()
    out["in_flight"] = (ya.detach(), yb.detach(), xa.grad, xb.grad.transpose(1, 2))
    return out


def _serial(x: torch.Tensor, w: torch.Tensor, cuts: list[int]) -> tuple[Any, ...]:
    x = x.clone().requires_grad_()
    W = w.shape[-1]
    padded = F.pad(x, (0, 0, W - 1, 0))
    y = _conv(padded, w)
    loss = sum(
        (y[:, cuts[r] : cuts[r + 1]] * _loss_weights(y[:, cuts[r] : cuts[r + 1]].shape, r)).sum()
        for r in range(P)
    )
    loss.backward()  # type: ignore[union-attr]
    halos = [padded[:, cuts[r] : cuts[r] + W - 1].detach() for r in range(P)]
    return halos, y.detach(), x.grad


def test_halo_convolution_equals_serial_convolution_values_and_gradients() -> None:
    ranks = run_distributed(_halo_rank, P, timeout=120)
    for i, (W, cuts) in enumerate(CASES):
        x, w = _data(cuts[-1], W, seed=i)
        halos, y, grad = _serial(x, w, cuts)
        for r in range(P):
            halo, y_r, g_r = ranks[r]["cases"][i]
            assert halo.shape == (B, W - 1, C), (W, cuts, r)
            torch.testing.assert_close(halo, halos[r], rtol=0, atol=0)
            torch.testing.assert_close(y_r, y[:, cuts[r] : cuts[r + 1]], rtol=1e-12, atol=1e-12)
            want = grad[:, cuts[r] : cuts[r + 1]]
            torch.testing.assert_close(g_r, want, rtol=1e-12, atol=1e-12, msg=str((W, cuts, r)))
    W, cuts = CASES[1]
    x, w = _data(cuts[-1], W, seed=1)
    xa, xb = x.clone().requires_grad_(), (2 * x).clone().requires_grad_()
    ya, yb = (_conv(F.pad(t, (0, 0, W - 1, 0)), w) for t in (xa, xb))
    sum(
        (
            (ya + yb)[:, cuts[r] : cuts[r + 1]] * _loss_weights((B, cuts[r + 1] - cuts[r], C), r)
        ).sum()
        for r in range(P)
    ).backward()  # type: ignore[union-attr]
    for r in range(P):
        got = ranks[r]["in_flight"]
        for j, want in enumerate((ya.detach(), yb.detach(), xa.grad, xb.grad)):
            assert want is not None
            torch.testing.assert_close(
                got[j], want[:, cuts[r] : cuts[r + 1]], rtol=1e-12, atol=1e-12
            )
