"""The Triton fold kernel under ``TRITON_INTERPRET=1`` against the torch backend.

The interpreter is selected when the kernel is decorated, so the variable is set here before
the kernel module is imported; the first test proves the interpreter really runs it.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
import triton  # noqa: F401 - part of the test extra: a missing triton must fail, not skip
from _kda_testutil import random_summaries

from hyper_parallel.kda import _triton_fold, affine_merge, affine_scan


def test_kernel_runs_in_the_triton_interpreter() -> None:
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(_triton_fold._affine_fold_kernel, InterpretedFunction)


@pytest.mark.parametrize(("K", "V"), [(16, 16), (32, 128), (64, 32), (128, 128)])
def test_triton_merge_matches_torch_backend_every_rank_both_directions(K: int, V: int) -> None:
    P, B, H = 3, 1, 2
    S, M = (x.float() for x in random_summaries(P, B, H, K, V, seed=K + V))
    for forward in (True, False):
        for rank in range(P):
            want = affine_merge(S, M, rank, forward=forward, kernel="torch")
            got = affine_merge(S, M, rank, forward=forward, kernel="triton")
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("K", "V"), [(16, 32), (128, 64)])
def test_triton_scan_matches_torch_backend_on_packed_views(K: int, V: int) -> None:
    w, B, H = 3, 2, 1
    S, M = (x.float() for x in random_summaries(w, B, H, K, V, seed=7))
    packed = torch.cat([S, M], dim=-1)
    maps = (packed[..., :V], packed[..., V:])
    x = torch.randn(B, H, K, V)
    for forward, indices in ((True, range(0, w)), (False, range(w - 1, -1, -1))):
        for c in (0, 2, w):
            want = affine_scan(maps, x, indices, forward=forward, prefix_count=c, kernel="torch")
            got = affine_scan(maps, x, indices, forward=forward, prefix_count=c, kernel="triton")
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_triton_launch_splits_batch_heads_to_respect_grid_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    P, B, H, K, V = 2, 3, 2, 16, 128
    S, M = (x.float() for x in random_summaries(P, B, H, K, V, seed=9))
    launches: list[tuple[int, int]] = []
    kernel = _triton_fold._affine_fold_kernel

    class Recorder:
        def __getitem__(self, grid: tuple[int, int]):  # type: ignore[no-untyped-def]
            launches.append(grid)
            assert grid[0] * grid[1] <= 5
            return kernel[grid]

    monkeypatch.setattr(_triton_fold, "GRID_LIMIT", 5)
    monkeypatch.setattr(_triton_fold, "_affine_fold_kernel", Recorder())
    got = affine_merge(S, M, 1, kernel="triton")
    want = affine_merge(S, M, 1, kernel="torch")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert len(launches) == 3  # 6 batch·heads, 2 value tiles, at most 2 batch·heads per launch
