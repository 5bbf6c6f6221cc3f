"""Chunk-parallel KDA in WY / UT form: affine chunk summaries and chunked outputs.

Inside a chunk of ``C`` tokens, with ``Γ_t = Σ_{s≤t} g_s`` (per key dimension) and ``h_0`` the
state entering the chunk, the delta-rule corrections
``δ_t = β_t (v_t − (diag(e^{g_t}) h_{t-1})ᵀ k_t)`` satisfy the unit lower-triangular system

    (I + diag(β) A) δ = diag(β) (V − K_Γ h_0),   A_ts = k_tᵀ diag(e^{Γ_t − Γ_s}) k_s  (s < t),

whose solution is ``δ = U − W h_0`` with ``[U | W] = (I + diag(β) A)⁻¹ diag(β) [V | e^{Γ}⊙K]`` (the
UT transform). Then ``h_C = M_c h_0 + S_c`` with ``M_c = diag(e^{Γ_C}) − K̃ᵀ W`` and
``S_c = K̃ᵀ U`` (``K̃_s = e^{Γ_C − Γ_s} ⊙ k_s``), and the outputs are
``o = (scale·e^{Γ}⊙Q − P W) h_0 + P U`` with ``P_ts = scale·q_tᵀ diag(e^{Γ_t − Γ_s}) k_s`` (s ≤ t).
Gate factors ``e^{Γ_t − Γ_s}`` are never formed as ``e^{Γ_t} · e^{−Γ_s}``: typical gates use
one reference token per chunk (both factors within ``e^{±60}``, everything a matmul); chunks
with a wider gate range use 16-token sub-chunks with factors ≤ 1 across them and, inside them,
one reference token per sub-chunk where every sub-chunk's range is at most 60 (strongly
decaying gates: still all matmuls), exact pairwise factors otherwise, so strong decay cannot
overflow. Sequences that are not a multiple of ``C`` are
padded with identity tokens (``k = v = g = β = 0``), which leave the state unchanged.

Packed documents: a reset at token ``t`` (a document starts there) zeroes the state before the
token's update. Inside a chunk with segment ids ``σ_t`` (resets counted up to ``t``) this masks
``A`` and ``P`` to same-segment pairs, keeps the ``h_0`` terms (``e^{Γ}⊙K`` in ``W``, ``e^{Γ}⊙Q``
in ``Q_eff``) only on the first segment (``σ_t = 0``) and ``K̃`` only on the last; a chunk that
contains a reset has ``M_c = −K̃ᵀ W = 0``: its summary does not depend on the incoming state.
The gate factors are the same products as without resets, multiplied by 0/1 masks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ._checks import check_chunk_size, check_cu_seqlens, check_qkv, document_resets, state_dtype

__all__ = ["chunk_kda", "state_summary"]

_PAIRWISE_BUDGET = 1 << 24  # elements of the [.., C, 16, K] gate tensors built at once


def _chunked(x: torch.Tensor, n: int, C: int) -> torch.Tensor:
    """``[B, T, H, ...] -> [B, H, n, C, ...]``, zero-padding T up to ``n * C``."""
    T = x.shape[1]
    if n * C != T:
        pad = x.new_zeros(x.shape[0], n * C - T, *x.shape[2:])
        x = torch.cat([x, pad], dim=1)
    x = x.reshape(x.shape[0], n, C, *x.shape[2:])
    return x.movedim(3, 1).contiguous()


_SUB = 16  # sub-chunk width: exact pairwise decays inside, factored matmuls across

# Exponents are clamped to at most 80, which keeps the masked-out (acausal) entries finite, so
# zeroing them leaves no inf·0 in values or gradients; factors below e^-60 ≈ 8.8e-27 are
# exactly 0: such terms are far below the resolution of any sum they enter, and a tiny factor
# times a small key or value is a subnormal fp32 number, whose arithmetic is tens of times
# slower on CPUs (a real-size KDA layer's matmuls ran 40x slower with factors down to e^-80).
_EXP_LIMIT = 80.0
_EXP_FLOOR = -60.0


# A true decay ``e^{Γ_t − Γ_s}`` (not one factor of a product through a reference token) below
# e^-36 ≈ 2.3e-16 is exactly 0 too: fp32 cannot see it beside the terms it is summed with, and
# the product of two such factors stays a normal number (the UT solve's ``e^Γ ⊙ K`` columns
# and the chunk maps multiply them).
_DECAY_FLOOR = -36.0


def _exp(x: torch.Tensor) -> torch.Tensor:
    """``e^x`` for ``x ≤ 80``, exactly 0 below ``e^-60`` (its gradient there too): one factor
    of a product through a reference token (the other factor is up to ``e^60``)."""
    return x.clamp(_EXP_FLOOR - 1.0, _EXP_LIMIT).exp() * (x >= _EXP_FLOOR)


def _decay(x: torch.Tensor) -> torch.Tensor:
    """``e^x`` of a true decay (``x = Γ_t − Γ_s``, ``t`` after ``s``), exactly 0 below
    ``e^-36``."""
    return x.clamp(_DECAY_FLOOR - 1.0, _EXP_LIMIT).exp() * (x >= _DECAY_FLOOR)


def _masked_exp(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The true decay ``e^x`` where ``keep``, exactly 0 elsewhere."""
    return _decay(x) * keep


_FACTOR_SPAN = 60.0  # largest in-chunk gate range |Γ_t − Γ_s| the one-reference form allows


def _wide(G: torch.Tensor) -> bool:
    """Whether some chunk's gate range exceeds ``_FACTOR_SPAN`` (then sub-chunked factors)."""
    span = float((G.amax(-2) - G.amin(-2)).max().detach()) if G.numel() else 0.0
    return span > _FACTOR_SPAN


_Factors = tuple[torch.Tensor | None, ...]


def _decay_factors(G: torch.Tensor, k: torch.Tensor, wide: bool) -> _Factors:
    """The gate factors :func:`_decay_products` builds ``A`` and ``P`` from (shared by both).

    Not ``wide``: ``(left, right)``, one reference token a chunk. ``wide``: ``(decayed_k, kb,
    left, right, sub_left, sub_right)`` over 16-token sub-chunks: inside each, the factored form
    through the sub-chunk's first token (``sub_left``, ``sub_right``; ``decayed_k`` None) when
    every sub-chunk's gate range is at most ``_FACTOR_SPAN`` (typical strongly decaying gates:
    everything a matmul), else the exact pairwise factors ``decayed_k [.., ns, t, s, K]``;
    ``left``, ``right`` across sub-chunks (None for one sub-chunk)."""
    if not wide:
        G_ref = G[..., :1, :]
        right = (k * (G_ref - G).exp()).transpose(-1, -2)
        left = (G - G_ref).exp()
        return left, right
    C = G.shape[-2]
    c = _SUB if C % _SUB == 0 else C
    ns = C // c
    Gb, kb = G.unflatten(-2, (ns, c)), k.unflatten(-2, (ns, c))
    sub_span = float((Gb.amax(-2) - Gb.amin(-2)).max().detach()) if Gb.numel() else 0.0
    decayed_k = sub_left = sub_right = None
    if sub_span <= _FACTOR_SPAN:
        G_sub = Gb[..., :1, :]
        sub_left = _exp(Gb - G_sub)  # [.., ns, t, K], factors <= 1 for decaying gates
        sub_right = kb * _exp(G_sub - Gb)  # [.., ns, s, K], within e^60
    else:
        causal = torch.ones(c, c, dtype=torch.bool, device=G.device).tril()
        decay = _masked_exp(Gb.unsqueeze(-2) - Gb.unsqueeze(-3), causal[..., None])
        decayed_k = decay * kb.unsqueeze(-3)  # [.., ns, t, s, K]: e^{Γ_t − Γ_s} ⊙ k_s
    if ns == 1:
        return decayed_k, kb, None, None, sub_left, sub_right
    G_end = Gb[..., -1, :]  # [.., ns, K]
    right = (kb * _decay(G_end.unsqueeze(-2) - Gb)).transpose(-1, -2)  # [.., ns, K, c]
    later = torch.arange(C, device=G.device)[:, None] // c > torch.arange(ns, device=G.device)
    left = _masked_exp(G.unsqueeze(-2) - G_end.unsqueeze(-3), later[..., None])  # [.., t, j, K]
    return decayed_k, kb, left, right, sub_left, sub_right


def _in_sub_chunks(factors: _Factors, x: torch.Tensor, ns: int, c: int) -> torch.Tensor:
    """``[.., ns, t, s]``: ``x_tᵀ diag(e^{Γ_t − Γ_s}) k_s`` inside each sub-chunk (causal
    ``s ≤ t``; the caller drops the diagonal where it must) for chunked ``x [.., C, K]``."""
    decayed_k, _, _, _, sub_left, sub_right = factors
    xb = x.unflatten(-2, (ns, c))
    if decayed_k is not None:
        return (decayed_k @ xb.unsqueeze(-1)).squeeze(-1)
    assert sub_left is not None and sub_right is not None
    return ((xb * sub_left) @ sub_right.transpose(-1, -2)).tril()


def _decay_products(
    G: torch.Tensor,
    k: torch.Tensor,
    q: torch.Tensor | None,
    wide: bool | None = None,
    want_a: bool = True,
    factors: _Factors | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``A_ts = k_tᵀ diag(e^{Γ_t − Γ_s}) k_s`` (s < t) and ``P_ts = q_tᵀ diag(e^{Γ_t − Γ_s}) k_s``
    (s ≤ t) for chunked ``[.., C, K]`` inputs (``A`` None unless ``want_a``, ``P`` None
    without ``q``; ``wide``: :func:`_wide` of ``G``, ``factors``: :func:`_decay_factors`, when
    the caller has them: ``A`` and ``P`` from separate calls are then exactly one call's).

    When every chunk's gate range is at most ``_FACTOR_SPAN`` (typical KDA gates), both are
    plain matmuls through the chunk's first token: ``e^{Γ_t − Γ_s} = e^{Γ_t − Γ_1} · e^{Γ_1 − Γ_s}``
    with both factors within ``e^{±60}``. Otherwise (``wide``) the sub-chunked form: inside a
    16-token sub-chunk, the same factored form through the sub-chunk's first token where
    every sub-chunk's range is at most ``_FACTOR_SPAN``, else the gate differences
    exponentiated pairwise (every factor ≤ 1); across sub-chunks (``s`` in sub-chunk ``j``,
    ``t`` later) ``e^{Γ_t − Γ_s} = e^{Γ_t − Γ_e} · e^{Γ_e − Γ_s}`` with ``e`` the last token of
    sub-chunk ``j``; both exponents are ≤ 0 for decaying gates, so the product is a matmul
    that can only underflow where the true value does.
    """
    if wide is None:
        wide = _wide(G)
    if factors is None:
        factors = _decay_factors(G, k, wide)
    if not wide:
        left, right = factors
        assert left is not None and right is not None
        A = ((k * left) @ right).tril(-1) if want_a else None
        P = ((q * left) @ right).tril() if q is not None else None
        return A, P
    _, kb, left, right, _, _ = factors
    assert kb is not None
    C = G.shape[-2]
    c = _SUB if C % _SUB == 0 else C
    ns = C // c
    lead = G.shape[:-2]
    eye = torch.eye(ns, dtype=G.dtype, device=G.device)[:, None, :, None]

    def assemble(diag: torch.Tensor, off: torch.Tensor | None) -> torch.Tensor:
        full = (diag.unsqueeze(-2) * eye).reshape(*lead, C, C)
        if off is not None:  # off: [.., ns(j), C(t), c(s)]
            full = full + off.movedim(-3, -2).reshape(*lead, C, C)
        return full

    A = P = None
    if want_a:
        A_diag = _in_sub_chunks(factors, k, ns, c).tril(-1)
        A_off = None
        if left is not None and right is not None:
            A_off = (left * k.unsqueeze(-2)).movedim(-2, -3) @ right
        A = assemble(A_diag, A_off)
    if q is not None:
        P_diag = _in_sub_chunks(factors, q, ns, c)
        P_off = None
        if left is not None and right is not None:
            P_off = (left * q.unsqueeze(-2)).movedim(-2, -3) @ right
        P = assemble(P_diag, P_off)
    return A, P


@dataclass
class _ChunkContext:
    """What the output terms of a batch of chunks need from its summary terms."""

    G: torch.Tensor  # in-chunk gate prefix sums Γ, [.., n, C, K]
    G_exp: torch.Tensor
    k: torch.Tensor
    U: torch.Tensor
    W: torch.Tensor
    same: torch.Tensor | None  # same-segment pairs [.., n, C, C] (packed documents)
    first: torch.Tensor | None  # first-segment tokens [.., n, C, 1]
    wide: bool
    factors: _Factors | None  # the gate factors A was built from, shared with P


def _summary_chunk_terms(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    resets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, _ChunkContext]:
    """Per-chunk maps for chunked inputs ``[B, H, n, C, ...]`` (``resets [B, H, n, C]``: 1
    where a document starts, or None): ``(S_c [.., n, K, V], M_c [.., n, K, K], context)``;
    the context gives :func:`_output_chunk_terms` the rest without recomputing it."""
    C, V = k.shape[-2], v.shape[-1]
    # The in-chunk prefix sum as a matmul: CPU cumsum along a middle dim is a slow serial loop.
    G = torch.ones(C, C, dtype=g.dtype, device=g.device).tril() @ g
    wide = _wide(G)
    factors = _decay_factors(G, k, wide)
    A, _ = _decay_products(G, k, None, wide, factors=factors)
    assert A is not None
    G_exp = _decay(G)
    G_last = G[..., -1:, :]
    k_tail = _decay(G_last - G) * k
    decay_last = torch.diag_embed(_decay(G_last.squeeze(-2)))
    k_start = G_exp * k  # the h_0 terms
    same = first = None
    if resets is not None:
        seg = resets.cumsum(-1)  # segment id of each token inside its chunk
        same = seg.unsqueeze(-1) == seg.unsqueeze(-2)
        A = A * same
        first = (seg == 0).unsqueeze(-1)
        k_start = k_start * first
        k_tail = k_tail * (seg == seg[..., -1:]).unsqueeze(-1)
        decay_last = decay_last * (seg[..., -1:] == 0).unsqueeze(-1)
    eye = torch.eye(C, dtype=k.dtype, device=k.device)
    lower = eye + beta.unsqueeze(-1) * A
    rhs = beta.unsqueeze(-1) * torch.cat([v, k_start], dim=-1)
    UW = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)
    U, W = UW[..., :V], UW[..., V:]
    k_tail_t = k_tail.transpose(-1, -2)
    M_c = decay_last - k_tail_t @ W
    S_c = k_tail_t @ U
    # Kept for P (the same factors, so the gradients accumulate as in one pass), except the
    # sub-chunked ones when no graph keeps them anyway: they are 16x the keys, recomputed.
    keep = not wide or torch.is_grad_enabled()
    return S_c, M_c, _ChunkContext(G, G_exp, k, U, W, same, first, wide, factors if keep else None)


def _output_chunk_terms(
    ctx: _ChunkContext, q: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q_eff [.., n, C, K], O_c [.., n, C, V])`` with ``o = Q_eff h_0 + O_c`` per chunk, for
    chunked ``q`` and the context of :func:`_summary_chunk_terms`: the chunks' own attention
    (``O_c = P U``), which does not depend on the incoming state."""
    _, P = _decay_products(ctx.G, ctx.k, q * scale, ctx.wide, want_a=False, factors=ctx.factors)
    assert P is not None
    q_start = (ctx.G_exp * q) * scale
    if ctx.same is not None and ctx.first is not None:
        P = P * ctx.same
        q_start = q_start * ctx.first
    Q_eff = q_start - P @ ctx.W
    return Q_eff, P @ ctx.U


def _chunk_steps(k: torch.Tensor) -> list[slice]:
    """Batches of chunks of ``[B, H, n, C, K]`` inputs small enough for the pairwise gates."""
    B, H, n, C, K = k.shape
    per_chunk = B * H * C * min(C, 2 * _SUB) * K
    step = max(1, _PAIRWISE_BUDGET // max(per_chunk, 1))
    return [slice(lo, lo + step) for lo in range(0, n, step)]


def _cat(items: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(items, dim=2) if len(items) > 1 else items[0]


def _all_summary_terms(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    resets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[slice, _ChunkContext]]]:
    """:func:`_summary_chunk_terms` over all chunks, a bounded number of chunks at a time:
    ``(S_c, M_c, [(chunk slice, context)])``."""
    S_parts, M_parts, steps = [], [], []
    for sl in _chunk_steps(k):
        S_c, M_c, ctx = _summary_chunk_terms(
            k[:, :, sl], v[:, :, sl], g[:, :, sl], beta[:, :, sl],
            None if resets is None else resets[:, :, sl],
        )  # fmt: skip
        S_parts.append(S_c)
        M_parts.append(M_c)
        steps.append((sl, ctx))
    return _cat(S_parts), _cat(M_parts), steps


def _compose_all(S_c: torch.Tensor, M_c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Compose chunk maps ``[.., n, ...]`` in order (later ∘ earlier) by pairwise reduction."""
    while S_c.shape[-3] > 1:
        n = S_c.shape[-3]
        even = n - n % 2
        S_a, S_b = S_c[..., 0:even:2, :, :], S_c[..., 1:even:2, :, :]
        M_a, M_b = M_c[..., 0:even:2, :, :], M_c[..., 1:even:2, :, :]
        S_new, M_new = M_b @ S_a + S_b, M_b @ M_a
        if n % 2:
            S_new = torch.cat([S_new, S_c[..., -1:, :, :]], dim=-3)
            M_new = torch.cat([M_new, M_c[..., -1:, :, :]], dim=-3)
        S_c, M_c = S_new, M_new
    return S_c[..., 0, :, :], M_c[..., 0, :, :]


def _layout(T: int, chunk_size: int) -> tuple[int, int]:
    """``(n, C)``: the number of chunks and their length for ``T`` tokens."""
    C = chunk_size if T >= chunk_size else max(T, 1)
    return max(1, -(-T // C)), C


def state_summary(
    k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, chunk_size: int = 64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Affine summary ``(S, M)`` of a chunk of tokens, computed chunk-parallel.

    ``k, g: [B, T, H, K]``, ``v: [B, T, H, V]``, ``beta: [B, T, H]``; any ``T >= 0``.
    Returns ``S: [B, H, K, V]`` (the final state from a zero start) and
    ``M: [B, H, K, K] = M_T ⋯ M_1`` so that ``h_out = M h_in + S``; fp32 (fp64 for fp64 inputs).
    Differentiable. Equal to :func:`naive_state_summary` up to rounding.
    """
    B, T, H, K, V = check_qkv(k, k, v, g, beta, None)
    check_chunk_size(chunk_size)
    dt = state_dtype(v)
    if T == 0:
        eye = torch.eye(K, dtype=dt, device=k.device).expand(B, H, K, K).clone()
        return k.new_zeros(B, H, K, V, dtype=dt), eye
    terms = summary_terms(k, v, g, beta, chunk_size)
    return _compose_all(terms.S_c, terms.M_c)


@dataclass
class SummaryTerms:
    """The state-independent per-chunk maps of a block (:func:`summary_terms`) and what its
    outputs need later (:func:`output_terms`): ``S_c [B, H, n, K, V]``, ``M_c [B, H, n, K,
    K]``."""

    S_c: torch.Tensor
    M_c: torch.Tensor
    steps: list[tuple[slice, _ChunkContext]]
    n: int
    C: int
    dtype: torch.dtype


def summary_terms(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int,
    resets: torch.Tensor | None = None,
) -> SummaryTerms:
    """The per-chunk maps ``(S_c, M_c)`` of validated, non-empty inputs in the state dtype
    (everything :func:`compose_chunks` needs for the block's summary), keeping what
    :func:`output_terms` needs. ``resets [B, T]`` (0/1): the tokens where a document starts
    (the state is zeroed before their update), or None."""
    T = k.shape[1]
    n, C = _layout(T, chunk_size)
    dt = state_dtype(v)
    kc, vc, gc, bc = (_chunked(x.to(dt), n, C) for x in (k, v, g, beta))
    rc = None
    if resets is not None:  # [B, T] -> [B, H, n, C]
        rc = _chunked(resets.to(dt).unsqueeze(-1).expand(*k.shape[:3]), n, C)
    S_c, M_c, steps = _all_summary_terms(kc, vc, gc, bc, rc)
    return SummaryTerms(S_c, M_c, steps, n, C, dt)


def output_terms(
    terms: SummaryTerms, q: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q_eff [B, H, n, C, K], O_c [B, H, n, C, V])`` for the queries ``q [B, T, H, K]`` of
    the block of ``terms``: each chunk's outputs are ``o = Q_eff h_0 + O_c`` from the state
    ``h_0`` entering it. Independent of any state: computable while the state is in flight."""
    qc = _chunked(q.to(terms.dtype), terms.n, terms.C)
    Q_parts, O_parts = [], []
    for sl, ctx in terms.steps:
        Q_eff, O_c = _output_chunk_terms(ctx, qc[:, :, sl], scale)
        Q_parts.append(Q_eff)
        O_parts.append(O_c)
    return _cat(Q_parts), _cat(O_parts)


def chunk_terms(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    chunk_size: int,
    resets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """State-independent per-chunk terms ``(S_c, M_c, Q_eff, O_c)`` of validated, non-empty
    inputs, in the state dtype: :func:`summary_terms` then :func:`output_terms`; see
    :func:`run_chunks` and :func:`compose_chunks`."""
    terms = summary_terms(k, v, g, beta, chunk_size, resets)
    return (terms.S_c, terms.M_c, *output_terms(terms, q, scale))


def compose_chunks(terms: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole sequence's ``(S, M)`` from :func:`chunk_terms` or :func:`summary_terms`."""
    if isinstance(terms, SummaryTerms):
        return _compose_all(terms.S_c, terms.M_c)
    return _compose_all(terms[0], terms[1])


def run_chunks(
    terms: tuple[torch.Tensor, ...], h: torch.Tensor, T: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs ``[B, T, H, V]`` (state dtype) and the final state, starting from ``h``;
    ``terms``: ``(S_c, M_c, Q_eff, O_c)``."""
    S_c, M_c, Q_eff, O_c = terms
    outs = []
    for i in range(S_c.shape[2]):
        outs.append(Q_eff[:, :, i] @ h + O_c[:, :, i])
        h = M_c[:, :, i] @ h + S_c[:, :, i]
    o = torch.stack(outs, dim=2).flatten(2, 3)[:, :, :T].transpose(1, 2)
    return o, h


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunk-parallel twin of :func:`naive_recurrent_kda` (same signature plus ``chunk_size``).

    Returns ``(o [B, T, H, V] in v's dtype, final state [B, H, K, V] or None)``.
    Differentiable; the state is fp32 (fp64 for fp64 inputs). ``cu_seqlens`` (packed
    documents, ``B == 1``): document offsets ``[0, …, T]``; the state restarts from zero at
    every document start (only the first document starts from ``initial_state``), the final
    state is the last document's.
    """
    B, T, H, K, V = check_qkv(q, k, v, g, beta, initial_state)
    check_chunk_size(chunk_size)
    resets = None
    if cu_seqlens is not None:
        starts = check_cu_seqlens(cu_seqlens, B, T, "chunk_kda")
        resets = document_resets(starts, 0, T, k.device)
    dt = state_dtype(v)
    if scale is None:
        scale = K**-0.5
    h = k.new_zeros(B, H, K, V, dtype=dt)
    if initial_state is not None:
        h = h + initial_state.to(dt)
    if T == 0:
        return v.new_zeros(B, 0, H, V), (h if output_final_state else None)
    o, h = run_chunks(chunk_terms(q, k, v, g, beta, scale, chunk_size, resets), h, T)
    return o.to(v.dtype), (h if output_final_state else None)
