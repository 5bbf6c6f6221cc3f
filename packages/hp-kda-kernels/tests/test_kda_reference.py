"""The token-by-token reference against flash-linear-attention, the chunk-parallel paths
(summary and outputs) against token-by-token folds in float64, and the stock Kimi-Linear layer
on its PyTorch path where fla is installed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from _kda_testutil import kda_inputs, max_rel_err

# fla-core is part of the test extra: if it is missing the test must fail, not skip
from fla.ops.kda.naive import naive_recurrent_kda as fla_naive

from hyper_parallel.kda import (
    chunk,
    chunk_kda,
    naive_recurrent_kda,
    naive_state_summary,
    state_summary,
)


@pytest.fixture(params=["one_reference", "subchunked"])
def decay_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test through both forms of the in-chunk decay products."""
    if request.param == "subchunked":
        monkeypatch.setattr(chunk, "_FACTOR_SPAN", -1.0)
    return str(request.param)


@pytest.mark.parametrize("with_state", [False, True])
def test_naive_recurrent_kda_matches_flash_linear_attention(with_state: bool) -> None:
    q, k, v, g, beta, h0 = kda_inputs(2, 23, 3, 16, 32, seed=1, dtype=torch.float32)
    init = h0 if with_state else None
    o, hT = naive_recurrent_kda(q, k, v, g, beta, initial_state=init, output_final_state=True)
    o_ref, hT_ref = fla_naive(q, k, v, g, beta, initial_state=init, output_final_state=True)
    assert o.dtype == o_ref.dtype and hT is not None and hT.dtype == torch.float32
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hT, hT_ref, rtol=1e-5, atol=1e-5)
    o2, none = naive_recurrent_kda(q, k, v, g, beta, scale=0.3, initial_state=init)
    o2_ref, _ = fla_naive(q, k, v, g, beta, scale=0.3, initial_state=init)
    assert none is None
    torch.testing.assert_close(o2, o2_ref, rtol=1e-5, atol=1e-5)


def test_naive_recurrent_kda_keeps_fp32_state_for_bf16_inputs() -> None:
    q, k, v, g, beta, _ = kda_inputs(1, 9, 2, 16, 16, seed=2, dtype=torch.bfloat16)
    o, hT = naive_recurrent_kda(q, k, v, g, beta, output_final_state=True)
    assert o.dtype == torch.bfloat16 and hT is not None and hT.dtype == torch.float32
    _, hT_ref = fla_naive(q, k, v, g, beta, output_final_state=True)
    torch.testing.assert_close(hT, hT_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("T", "chunk_size"), [(1, 4), (7, 8), (8, 8), (9, 8), (45, 8), (64, 16), (100, 64)]
)
def test_state_summary_equals_token_fold(T: int, chunk_size: int, decay_path: str) -> None:
    _, k, v, g, beta, _ = kda_inputs(2, T, 2, 16, 32, seed=T)
    S, M = state_summary(k, v, g, beta, chunk_size=chunk_size)
    S_ref, M_ref = naive_state_summary(k, v, g, beta)
    assert S.shape == (2, 2, 16, 32) and M.shape == (2, 2, 16, 16)
    assert max_rel_err(S, S_ref) < 1e-12 and max_rel_err(M, M_ref) < 1e-12


def test_state_summary_is_fp32_for_fp32_inputs_and_composes_the_final_state() -> None:
    _, k, v, g, beta, h0 = kda_inputs(1, 50, 2, 32, 16, seed=3, dtype=torch.float32)
    q = torch.randn_like(k)
    S, M = state_summary(k, v, g, beta, chunk_size=16)
    assert S.dtype == M.dtype == torch.float32
    _, hT = naive_recurrent_kda(q.double(), k.double(), v.double(), g.double(), beta.double(),
                                initial_state=h0.double(), output_final_state=True)  # fmt: skip
    assert hT is not None
    assert max_rel_err(M @ h0 + S, hT) < 1e-5


def test_state_summary_of_an_empty_chunk_is_the_identity_map() -> None:
    _, k, v, g, beta, _ = kda_inputs(1, 0, 2, 16, 16)
    S, M = state_summary(k, v, g, beta)
    assert torch.equal(S, torch.zeros_like(S))
    assert torch.equal(M, torch.eye(16, dtype=M.dtype).expand_as(M))


def test_state_summary_survives_strong_decay_without_overflow() -> None:
    _, k, v, _, beta, _ = kda_inputs(1, 64, 1, 16, 16, seed=4)
    g = torch.full_like(k, -30.0)  # e^{Γ} spans e^{-1920}: only pairwise differences are safe
    S, M = state_summary(k, v, g, beta, chunk_size=64)
    S_ref, M_ref = naive_state_summary(k, v, g, beta)
    assert torch.isfinite(S).all() and torch.isfinite(M).all()
    torch.testing.assert_close(S, S_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(M, M_ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(("T", "chunk_size"), [(13, 4), (50, 32)])
def test_chunk_kda_matches_naive_forward_and_gradients(
    T: int, chunk_size: int, decay_path: str
) -> None:
    inputs = [x.requires_grad_() for x in kda_inputs(2, T, 2, 16, 32, seed=5)]
    *qkvgb, h0 = inputs
    o, hT = chunk_kda(*qkvgb, initial_state=h0, output_final_state=True, chunk_size=chunk_size)
    assert hT is not None
    w = torch.randn_like(o)
    grads = torch.autograd.grad((o * w).sum() + (hT**2).sum(), inputs)
    o_ref, hT_ref = naive_recurrent_kda(*qkvgb, initial_state=h0, output_final_state=True)
    assert hT_ref is not None
    grads_ref = torch.autograd.grad((o_ref * w).sum() + (hT_ref**2).sum(), inputs)
    assert max_rel_err(o, o_ref) < 1e-12 and max_rel_err(hT, hT_ref) < 1e-12
    for got, want in zip(grads, grads_ref):
        assert max_rel_err(got, want) < 1e-10


def test_reference_rejects_mismatched_shapes() -> None:
    q, k, v, g, beta, h0 = kda_inputs(1, 5, 2, 16, 16)
    with pytest.raises(ValueError, match="beta must be"):
        naive_recurrent_kda(q, k, v, g, beta[:, :, :1])
    with pytest.raises(ValueError, match="initial_state must be"):
        naive_recurrent_kda(q, k, v, g, beta, initial_state=h0[:, :1])
    with pytest.raises(ValueError, match="chunk_size"):
        state_summary(k, v, g, beta, chunk_size=0)


def test_stock_kimi_layer_runs_on_its_pytorch_path_although_fla_is_installed() -> None:
    """transformers binds Kimi-Linear's chunk_kda to fla's Triton kernels when fla is importable
    (here it is: fla-core is in the test extra), and those fail on CPU tensors;
    ``import_torch_path`` re-imports the modeling module with every function on the PyTorch
    path, leaving fla importable for everything else. Run in a fresh interpreter."""
    code = (
        "import importlib, sys, torch\n"
        "import fla\n"
        "name = 'transformers.models.kimi_linear.modeling_kimi_linear'\n"
        "from hyper_parallel.kda.testing import import_torch_path, routed_functions\n"
        "routed = importlib.import_module(name)\n"
        "print(sorted(routed_functions(routed)))\n"
        "m = import_torch_path(name)\n"
        "print(m is not routed, routed_functions(m), sys.modules[name] is m)\n"
        "print(importlib.import_module('fla.ops.kda').chunk_kda.__module__)\n"
        "from _kda_hf import init_kda_weights, tiny_config\n"
        "layer = m.KimiLinearDeltaAttention(tiny_config(), 0).double()\n"
        "init_kda_weights(layer, 0)\n"
        "print(layer(torch.randn(1, 5, 32, dtype=torch.float64)).shape)\n"
    )
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": here + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [
        "['chunk_kimi_delta_attention', 'recurrent_kimi_delta_attention']",
        "True [] True",
        "fla.ops.kda.chunk",
        "torch.Size([1, 5, 32])",
    ], res.stdout
