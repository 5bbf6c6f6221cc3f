"""The lean chunk path (:mod:`hyper_parallel.kda.lean`) against its twin, the chunk path under
plain autograd: the same summary, outputs, final state and every gradient (float64, within
rounding) for B = 2, lengths that are not a multiple of the chunk, wide gate ranges
(sub-chunked factors), packed documents and an incoming state; and what it keeps for backward
is exactly its documented set (inputs, ``U``, ``W``, ``Q_eff``, the incoming state), a
fraction of what the chunk path keeps."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _kda_testutil import kda_inputs, max_rel_err

from hyper_parallel.kda import lean as lean_mod
from hyper_parallel.kda.chunk import compose_chunks, output_terms, run_chunks, summary_terms
from hyper_parallel.kda.lean import lean_output_terms, lean_outputs, lean_summary

# (B, T, chunk, gate scale (above 1: chunks with wide gate ranges), document starts or None)
CASES = [
    (2, 37, 16, False, None),
    (2, 37, 16, True, None),
    (2, 150, 64, 12.0, None),  # wide chunks of narrow sub-chunks: factored inside them
    (1, 150, 64, 12.0, [40, 97]),
    (1, 50, 16, False, [7, 20, 33]),
    (1, 64, 64, True, [10, 40]),
    (1, 5, 64, False, None),
]


def _run(lean: bool, xs: list[torch.Tensor], resets: Any, C: int) -> tuple[torch.Tensor, ...]:
    q, k, v, g, beta, h0 = xs
    scale = q.shape[-1] ** -0.5
    if lean:
        S, M, terms = lean_summary(k, v, g, beta, C, resets)
        o, h = lean_outputs(terms, lean_output_terms(terms, q, scale), h0)
    else:
        staged = summary_terms(k, v, g, beta, C, resets)
        S, M = compose_chunks(staged)
        o, h = run_chunks((staged.S_c, staged.M_c, *output_terms(staged, q, scale)), h0, q.shape[1])
    return o, h, S, M


def _inputs(B: int, T: int, wide: bool, starts: Any) -> tuple[list[torch.Tensor], Any]:
    q, k, v, g, beta, h0 = kda_inputs(B, T, 3, 8, 4, seed=T)
    if wide:  # in-chunk gate ranges above 60: the sub-chunked factors (pairwise inside them
        g = g * (200 if wide is True else wide)  # at 200, factored through each at 12)
    resets = None
    if starts:
        resets = torch.zeros(B, T, dtype=torch.float64)
        resets[:, starts] = 1
    return [q, k, v, g, beta, h0], resets


# (block budget, maps budget): one block and one head slice for everything; one head and one
# chunk a block, one head a slice; two of the three heads a block and a slice (uneven)
BUDGETS = {
    "whole": (1 << 21, 1 << 20),
    "single": (1, 1),
    "uneven": (2 * 16 * 16 * 8 * 2, 2 * 4 * 8 * 12 * 2),
}


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_lean_path_equals_chunk_path_outputs_state_and_every_gradient(
    case: Any, budget: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also with the work cut into one-head, one-chunk blocks and head slices, and into
    uneven ones (the block and slice loops of backward)."""
    monkeypatch.setattr(lean_mod, "_BLOCK_BUDGET", BUDGETS[budget][0])
    monkeypatch.setattr(lean_mod, "_MAPS_BUDGET", BUDGETS[budget][1])
    B, T, C, wide, starts = case
    inputs, resets = _inputs(B, T, wide, starts)
    results = []
    for lean in (True, False):
        xs = [x.clone().requires_grad_() for x in inputs]
        outs = _run(lean, xs, resets, C)
        gen = torch.Generator().manual_seed(1)
        sum((y * torch.randn(y.shape, generator=gen, dtype=y.dtype)).sum() for y in outs).backward()
        results.append([y.detach() for y in outs] + [x.grad for x in xs])
    for i, (a, b) in enumerate(zip(*results)):
        assert b.abs().max() > 0 or (i == 3 and starts), i  # M = 0 across a document start
        assert max_rel_err(a, b) < 1e-12, (case, i)


def _saved_bytes(lean: bool, B: int, T: int, H: int, K: int) -> tuple[int, dict[str, int]]:
    """Bytes of the distinct storages autograd keeps for backward across one block's summary
    and outputs, and the sizes of the named tensors of the lean path's documented set."""
    xs = [x.float().requires_grad_() for x in kda_inputs(B, T, H, K, K, seed=3)]
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        kept[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        q, k, v, g, beta, h0 = xs
        if lean:
            _, _, terms = lean_summary(k, v, g, beta, 64)
            local = lean_output_terms(terms, q, K**-0.5)
            lean_outputs(terms, local, h0)
            named = {"U": terms.U, "W": terms.W, "Q_eff": local[0]}
        else:
            _run(False, xs, None, 64)
            named = {}
    sizes = {n: t.untyped_storage().nbytes() for n, t in named.items()}
    return sum(kept.values()), sizes


def test_lean_path_keeps_inputs_ut_solutions_effective_queries_and_chunk_maps_only() -> None:
    B, T, H, K = 1, 512, 1, 128  # one head of the real size (Kimi-Linear, Qwen3-Next)
    lean, sizes = _saved_bytes(True, B, T, H, K)
    earlier, _ = _saved_bytes(False, B, T, H, K)
    f32 = 4
    inputs = f32 * B * T * H * (4 * K + 1)  # q, k, v, g (K = V) and beta
    documented = inputs + sizes["U"] + sizes["W"] + sizes["Q_eff"] + f32 * B * H * K * K  # h_in
    assert sizes["U"] == sizes["W"] == sizes["Q_eff"] == f32 * B * H * T * K
    assert lean == documented, (lean, documented, sizes)
    assert lean < 0.3 * earlier, (lean, earlier)


@pytest.mark.parametrize(("scale", "mode"), [(1.0, "one reference"), (12.0, "sub-chunk reference"),
                                            (200.0, "pairwise")])  # fmt: skip
def test_each_gate_factor_form_equals_the_token_by_token_reference(scale: float, mode: str) -> None:
    """The three forms of the in-chunk gate factors (one reference token a chunk; 16-token
    sub-chunks factored through their first token; sub-chunks with exact pairwise factors)
    give the recurrence's outputs, final state and every gradient (float64)."""
    from hyper_parallel.kda import chunk_kda, naive_recurrent_kda
    from hyper_parallel.kda.chunk import _decay_factors, _wide

    q, k, v, g, beta, h0 = kda_inputs(1, 150, 2, 8, 4, seed=5)
    g = g * scale
    G = torch.ones(64, 64, dtype=g.dtype).tril() @ g[:, :64].transpose(1, 2)  # chunk 0 [1,H,C,K]
    wide = _wide(G)
    factors = _decay_factors(G, k[:, :64].transpose(1, 2), wide)
    got = "pairwise" if wide and factors[0] is not None else "one reference"
    if wide and factors[0] is None:
        got = "sub-chunk reference"
    assert got == mode
    results = []
    for fn in (chunk_kda, naive_recurrent_kda):
        xs = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
        o, hT = fn(*xs[:5], initial_state=xs[5], output_final_state=True)
        gen = torch.Generator().manual_seed(2)
        loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() + hT.square().sum()
        loss.backward()
        results.append([o.detach(), hT.detach()] + [x.grad for x in xs])
    for i, (a, b) in enumerate(zip(*results)):
        assert max_rel_err(a, b) < 1e-10, (mode, i)


def test_subnormals_flushed_only_inside_the_lean_functions() -> None:
    """The lean functions treat subnormal fp32 as zero while they run on a CPU (their products
    underflow under strong decay) and leave the thread's setting as they found it."""
    assert not lean_mod._flushing()
    seen: list[bool] = []
    original = lean_mod._chunk_maps

    def spy(*args: Any) -> Any:
        seen.append(lean_mod._flushing())
        return original(*args)

    lean_mod._chunk_maps = spy  # type: ignore[assignment]
    try:
        B, T, H, K = 1, 128, 2, 16
        xs = [x.float().requires_grad_() for x in kda_inputs(B, T, H, K, K, seed=3)]
        q, k, v, g, beta, h0 = xs
        _, _, terms = lean_summary(k, v, g * 20, beta, 64)
        o, _ = lean_outputs(terms, lean_output_terms(terms, q, K**-0.5), h0)
        o.sum().backward()
    finally:
        lean_mod._chunk_maps = original  # type: ignore[assignment]
    assert seen and all(seen), seen
    assert not lean_mod._flushing()
