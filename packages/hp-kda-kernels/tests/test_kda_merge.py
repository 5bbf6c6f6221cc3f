"""affine_merge / affine_scan (torch backend) against float64 folds; backend choice (including
the Triton kernel's shared-memory fit on CUDA, decided on CPU from injected device limits);
errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from _kda_testutil import fold64, max_rel_err, random_summaries

from hyper_parallel.kda import affine_merge, affine_scan, choose_backend, choose_kernel, merge


@pytest.mark.parametrize("forward", [True, False])
def test_affine_merge_folds_every_rank_position_like_float64(forward: bool) -> None:
    P, B, H, K, V = 5, 2, 3, 16, 8
    S64, M64 = random_summaries(P, B, H, K, V, seed=1)
    S, M = S64.float(), M64.float()
    for rank in range(P):
        order = list(range(rank)) if forward else list(range(P - 1, rank, -1))
        want = fold64(S64, M64, order, forward)[-1]
        got = affine_merge(S, M, rank, forward=forward, kernel="torch")
        assert got.shape == (B, H, K, V) and got.is_contiguous() and got.dtype == torch.float32
        if not order:
            assert torch.equal(got, torch.zeros_like(got))
        else:
            assert max_rel_err(got, want) < 1e-5


def test_affine_merge_reads_views_of_packed_storage() -> None:
    P, B, H, K, V = 4, 2, 2, 16, 32
    S64, M64 = random_summaries(P, B, H, K, V, seed=2)
    packed = torch.cat([S64, M64], dim=-1).float()  # [P, B, H, K, V + K]
    states, maps = packed[..., :V], packed[..., V:]
    assert not states.is_contiguous() and not maps.is_contiguous()
    for forward in (True, False):
        for rank in range(P):
            got = affine_merge(states, maps, rank, forward=forward, kernel="torch")
            order = list(range(rank)) if forward else list(range(P - 1, rank, -1))
            want = fold64(S64.float(), M64.float(), order, forward)[-1]
            assert got.is_contiguous()
            if order:
                assert max_rel_err(got, want) < 1e-5, (forward, rank)
            else:
                assert torch.equal(got, torch.zeros_like(got))


@pytest.mark.parametrize("forward", [True, False])
def test_affine_scan_returns_prefix_and_full_fold_from_incoming(forward: bool) -> None:
    w, B, H, K, V = 4, 1, 2, 16, 16
    S64, M64 = random_summaries(w, B, H, K, V, seed=3)
    x64 = torch.randn(B, H, K, V, dtype=torch.float64)
    indices = range(0, w) if forward else range(w - 1, -1, -1)
    trail = fold64(S64, M64, list(indices), forward, incoming=x64)
    for c in range(w + 1):
        prefix, full = affine_scan(
            (S64.float(), M64.float()), x64.float(), indices, forward=forward, prefix_count=c,
            kernel="torch",
        )  # fmt: skip
        assert max_rel_err(prefix, trail[c]) < 1e-5
        assert max_rel_err(full, trail[-1]) < 1e-5
    partial = affine_scan((S64.float(), M64.float()), None, indices[:2], forward=forward)
    assert isinstance(partial, torch.Tensor)
    assert max_rel_err(partial, fold64(S64, M64, list(indices[:2]), forward)[-1]) < 1e-5


def test_auto_backend_on_cpu_is_torch_and_never_imports_triton() -> None:
    name, reason = choose_kernel("cpu", 128, 128)
    assert name == "torch" and "CUDA/NPU" in reason
    assert choose_backend("cpu", 24, 128, "torch") == ("torch", "requested")
    code = (
        "import sys, torch\n"
        "from hyper_parallel.kda import affine_merge, state_summary\n"
        "S = torch.randn(3, 1, 1, 16, 16); M = torch.randn(3, 1, 1, 16, 16)\n"
        "out = affine_merge(S, M, 2)\n"
        "assert out.shape == (1, 1, 16, 16)\n"
        "assert 'triton' not in sys.modules, 'triton was imported'\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def test_without_triton_installed_the_torch_backend_serves() -> None:
    code = (
        "import sys\n"
        "sys.modules['triton'] = None  # what an environment without triton looks like\n"
        "import torch\n"
        "from hyper_parallel.kda import affine_merge, choose_kernel\n"
        "assert choose_kernel('cuda', 128, 128) == ('torch', 'triton is not installed')\n"
        "S = torch.randn(2, 1, 1, 16, 16); M = torch.randn(2, 1, 1, 16, 16)\n"
        "assert torch.allclose(affine_merge(S, M, 1), S[0])\n"
        "try:\n"
        "    affine_merge(S, M, 1, kernel='triton')\n"
        "except ValueError as exc:\n"
        "    assert 'not installed' in str(exc)\n"
        "    print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def test_explicit_triton_backend_rejects_unsupported_dims() -> None:
    S, M = (x.float() for x in random_summaries(2, 1, 1, 24, 16))
    with pytest.raises(ValueError, match="K and V in"):
        affine_merge(S, M, 1, kernel="triton")
    with pytest.raises(ValueError, match="unknown kernel"):
        affine_merge(S, M, 1, kernel="cuda")


def test_merge_and_scan_reject_bad_inputs() -> None:
    S, M = (x.float() for x in random_summaries(3, 1, 2, 16, 8))
    cases = {
        "float32": lambda: affine_merge(S.double(), M.double(), 0),
        "do not": lambda: affine_merge(S, M[:, :, :1], 0),
        "outside": lambda: affine_merge(S, M, 3),
        "must be an int": lambda: affine_merge(S, M, True),
        "unit column stride": lambda: affine_merge(S, M.transpose(-1, -2)[..., :8, :], 0),
        "must have 5 dims": lambda: affine_merge(S[0], M[0], 0),
        "step 1 or -1": lambda: affine_scan((S, M), None, range(0, 3, 2)),
        "outside the 3 group slots": lambda: affine_scan((S, M), None, range(1, 4)),
        "prefix_count": lambda: affine_scan((S, M), None, range(0, 2), prefix_count=3),
        "incoming must be": lambda: affine_scan((S, M), S[0, :, :1], range(0, 2)),
        "pair": lambda: affine_scan(S, None, range(0, 2)),  # type: ignore[arg-type]
    }
    for match, call in cases.items():
        with pytest.raises(ValueError, match=match):
            call()


KIB = 1024


@pytest.mark.parametrize(
    ("K", "V", "limit_kib", "picked"),
    [
        (128, 128, 99, "torch"),  # sm_86 / sm_89: the K=128 kernel needs 147 KiB
        (128, 128, 64, "torch"),  # sm_75
        (128, 128, 227, "triton"),  # sm_90 (H100 / H200)
        (128, 64, 147, "triton"),  # exactly enough
        (128, 64, 146, "torch"),
        (64, 128, 64, "triton"),  # K <= 64 needs 51 KiB
        (16, 16, 64, "triton"),
    ],
)
def test_auto_backend_falls_back_where_the_triton_kernel_does_not_fit(
    monkeypatch: pytest.MonkeyPatch, K: int, V: int, limit_kib: int, picked: str
) -> None:
    monkeypatch.setattr(merge, "_device_shared_memory", lambda dev: limit_kib * KIB)
    name, reason = choose_kernel("cuda:0", K, V)
    assert name == picked, reason
    if picked == "torch":
        need = merge.triton_fold_shared_memory(K, V) // KIB
        assert reason == (
            f"the Triton fold needs {need} KiB of shared memory at K={K}, V={V}; "
            f"cuda:0 allows {limit_kib} KiB per block"
        )
        with pytest.raises(ValueError, match="kernel 'triton' cannot run here: the Triton fold"):
            choose_kernel("cuda:0", K, V, "triton")
    else:
        assert choose_kernel("cuda:0", K, V, "triton") == ("triton", "requested")


def test_kernel_shared_memory_estimate_matches_the_measured_147_kib_at_k128() -> None:
    assert merge.triton_fold_shared_memory(128, 128) == 147 * KIB
    assert merge.triton_fold_shared_memory(128, 64) == 147 * KIB  # BV stays 64
    assert merge.triton_fold_shared_memory(64, 64) == 51 * KIB
    assert merge.triton_fold_shared_memory(128, 32) < merge.triton_fold_shared_memory(128, 64)


def test_unknown_device_limit_falls_back_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(merge, "_device_shared_memory", lambda dev: None)
    name, reason = choose_kernel("cuda", 128, 128)
    assert name == "torch"
    assert reason == "the shared memory of cuda is unknown; the Triton fold needs 150528 B"
