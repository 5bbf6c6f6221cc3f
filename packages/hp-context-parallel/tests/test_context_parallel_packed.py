"""Packed documents (``cu_seqlens``) through ``parallelize_mla`` on the stock Hugging Face
``DeepseekV3Attention`` and ``KimiLinearAttention``: on 2 and 4 gloo ranks (one spawn each),
both strategies, overlap on and off, the output, the input gradient and every parameter
gradient (summed over ranks) equal the stock serial module run on each document alone, outputs
concatenated (RoPE from per-document positions), float64. Documents start at a rank boundary,
inside a block, span several ranks and have length 1. HF's ``cu_seq_lens_q``/``cu_seq_lens_k``
name the same table. Each rank's projections see only its block."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _cp_hf import HIDDEN, build, call, cp_mesh, rope_tables

from hyper_parallel.context_parallel import parallelize_mla
from hyper_parallel.dtensor.testing import run_distributed

SEQ = 16
TABLES = ([0, 8, 16], [0, 1, 3, 12, 13, 16], [0, 16])  # rank boundary (P=2), inside, spanning
VARIANTS_ = ("deepseek_interleave", "deepseek_rotate_half_yarn_qlora", "kimi_qlora")
# (variant, strategy, overlap, table, keyword)
CASES = [
    ("deepseek_interleave", "expanded", True, 0, "cu_seqlens"),
    ("deepseek_interleave", "latent", False, 1, "cu_seqlens"),
    ("deepseek_rotate_half_yarn_qlora", "latent", True, 1, "cu_seq_lens_q"),
    ("deepseek_rotate_half_yarn_qlora", "expanded", False, 2, "cu_seqlens"),
    ("kimi_qlora", "expanded", True, 1, "cu_seqlens"),
    ("kimi_qlora", "latent", True, 0, "cu_seq_lens_q"),
    ("kimi_qlora", "latent", False, 1, "cu_seqlens"),
]


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, SEQ, HIDDEN, dtype=torch.float64, generator=g)
    dy = torch.randn(1, SEQ, HIDDEN, dtype=torch.float64, generator=g)
    return x, dy


def _positions(offsets: list[int]) -> torch.Tensor:
    """Per-document positions (restarting at 0), as HF's flattening collator writes them."""
    return torch.cat([torch.arange(b - a) for a, b in zip(offsets, offsets[1:])])


def _reference(variant: str, offsets: list[int]) -> dict[str, Any]:
    m = build(variant)
    x, dy = _inputs()
    x = x.clone().requires_grad_()
    outs = []
    for a, b in zip(offsets, offsets[1:]):
        out, _ = call(m, variant, x[:, a:b], torch.arange(b - a))
        outs.append(out)
    torch.cat(outs, 1).backward(dy)
    return {
        "out": torch.cat(outs, 1).detach(),
        "dx": x.grad,
        "grads": {n: p.grad for n, p in m.named_parameters()},
    }


def _rank(cases: list[Any]) -> list[dict[str, Any]]:
    mesh = cp_mesh()
    p, r = mesh.size(), mesh.get_local_rank()
    s = SEQ // p
    results = []
    for variant, strategy, overlap, t, key in cases:
        offsets = TABLES[t]
        m = build(variant)
        parallelize_mla(m, mesh, strategy=strategy, overlap=overlap)
        seen: list[tuple[int, ...]] = []
        hook = m.kv_a_proj_with_mqa.register_forward_hook(
            lambda mod, a, o, seen=seen: seen.append(tuple(a[0].shape))
        )
        x, dy = _inputs()
        xl = x[:, r * s : (r + 1) * s].clone().requires_grad_()
        pos = _positions(offsets)[r * s : (r + 1) * s]
        kw: dict[str, Any] = {key: torch.tensor(offsets, dtype=torch.int32)}
        if key == "cu_seq_lens_q":
            kw["cu_seq_lens_k"] = kw[key]
            kw["max_length_q"] = kw["max_length_k"] = max(
                b - a for a, b in zip(offsets, offsets[1:])
            )
        if variant.startswith("deepseek"):
            kw["position_embeddings"] = rope_tables(m, pos)
        out, _ = call(m, variant, xl, pos, **kw)
        out.backward(dy[:, r * s : (r + 1) * s])
        hook.remove()
        results.append({
            "out": out.detach(), "dx": xl.grad, "seen": seen,
            "grads": {n: q.grad for n, q in m.named_parameters()},
        })  # fmt: skip
    return results


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_packed_documents_through_stock_mla_equal_each_document_alone(world: int) -> None:
    ranks = run_distributed(_rank, world, CASES, timeout=240)
    for i, (variant, strategy, overlap, t, key) in enumerate(CASES):
        ref = _reference(variant, TABLES[t])
        tag = (world, variant, strategy, overlap, TABLES[t], key)
        got = [res[i] for res in ranks]
        tol = {"rtol": 1e-10, "atol": 1e-10}
        torch.testing.assert_close(torch.cat([g["out"] for g in got], 1), ref["out"], **tol)
        torch.testing.assert_close(torch.cat([g["dx"] for g in got], 1), ref["dx"], **tol)
        for name, want in ref["grads"].items():
            summed = sum(g["grads"][name] for g in got if g["grads"][name] is not None)
            torch.testing.assert_close(
                summed, want, **tol, msg=lambda m, n=name, t=tag: f"{t} {n}: {m}"
            )
        for g in got:  # each rank's latent projection saw only its block
            assert g["seen"] == [(1, SEQ // world, HIDDEN)], (tag, g["seen"])
    # the documents change the answer: the plain causal output differs
    plain = _reference(VARIANTS_[0], [0, SEQ])["out"]
    assert not torch.allclose(plain, _reference(VARIANTS_[0], TABLES[1])["out"])
