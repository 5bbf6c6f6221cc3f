"""hyper_parallel.dtensor.amp: what autocast would cast, autocast off inside fused functions, and
a custom function whose backward runs in its forward's dtypes under autocast."""

from __future__ import annotations

import pytest
import torch

from hyper_parallel.dtensor.amp import (
    autocast_dtype,
    autocast_off,
    cast_for_autocast,
    without_autocast,
)

pytestmark = pytest.mark.timeout(60)


def test_autocast_dtype_follows_the_threads_autocast_state() -> None:
    assert autocast_dtype("cpu") is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_dtype("cpu") is torch.bfloat16
        assert autocast_dtype("no-such-device") is None
        with autocast_off("cpu"):
            assert autocast_dtype("cpu") is None
        assert autocast_dtype("cpu") is torch.bfloat16
    with torch.autocast("cpu", dtype=torch.float16):
        assert autocast_dtype("cpu") is torch.float16


def test_cast_for_autocast_casts_what_autocast_casts_and_nothing_else() -> None:
    x32 = torch.randn(2, 3, requires_grad=True)
    x64 = torch.randn(2, 3, dtype=torch.float64)
    idx = torch.arange(3)
    assert cast_for_autocast("cpu", x32, x64, idx, None) == (x32, x64, idx, None)  # off
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b, c, d = cast_for_autocast("cpu", x32, x64, idx, None)
    assert a.dtype is torch.bfloat16 and b is x64 and c is idx and d is None
    a.float().sum().backward()  # differentiable: the gradient reaches x32 in float32
    assert x32.grad is not None and x32.grad.dtype is torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):  # another device's autocast: unchanged
        assert cast_for_autocast("cuda", x32)[0] is x32


class _Scale(torch.autograd.Function):
    """y = x @ w, cast at the boundary; forward and backward with autocast off."""

    @staticmethod
    @without_autocast
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, w: torch.Tensor):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    @without_autocast
    def backward(ctx: torch.autograd.function.FunctionCtx, dy: torch.Tensor):
        x, w = ctx.saved_tensors  # type: ignore[attr-defined]
        assert dy.dtype == x.dtype == w.dtype, (dy.dtype, x.dtype, w.dtype)
        return dy @ w.T, x.T @ dy


def test_a_fused_function_computes_forward_and_backward_in_the_autocast_dtype() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 5, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = _Scale.apply(*cast_for_autocast("cpu", x, w))
        ref = x @ w  # what autocast gives the plain op
    assert y.dtype is ref.dtype is torch.bfloat16
    torch.testing.assert_close(y, ref)
    # backward called inside an autocast region: still one dtype (asserted in backward)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y.float().sum().backward()
    assert x.grad is not None and w.grad is not None
    assert x.grad.dtype is torch.float32 and w.grad.dtype is torch.float32


def test_without_autocast_finds_the_device_in_keyword_arguments_too() -> None:
    seen = []

    @without_autocast
    def core(*, q: torch.Tensor) -> torch.Tensor:
        seen.append(autocast_dtype(q.device.type))
        return q @ q.T

    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = core(q=torch.randn(3, 3))
    assert seen == [None] and out.dtype is torch.float32
