"""The lean chunk path: what backward keeps is the inputs and the per-chunk maps, not the
chunks' pairwise gate tensors.

The chunk path (:mod:`hyper_parallel.kda.chunk`) under plain autograd keeps, for every chunk,
everything its backward touches: the in-chunk decay products ``A`` and ``P`` (``C×C``), their
gate factors (``C×K``, or ``C×16×K`` pairwise ones for chunks with a wide gate range), the UT
system and every product around it: about 2.8 MB a token for one real-size KDA layer. Here two
autograd functions run the same math and keep only

- the inputs ``q, k, v, g, β`` (the caller's tensors, no copies),
- the UT solutions ``U [.., C, V]``, ``W [.., C, K]`` (one value and one key row a token),
- the effective queries ``Q_eff [.., C, K]`` (one key row a token) and the block's incoming
  state ``h_in`` (the states entering the chunks are rerun from it);

and backward recomputes each chunk's intra-chunk terms, a bounded batch of chunks at a time
(``chunk._chunk_steps``), then backpropagates through that batch alone; the per-chunk maps
``S_c [.., K, V]``, ``M_c [.., K, K]`` (``K(K+V)/C`` numbers a token: more than ``U`` and
``W``) are rebuilt from ``k, g, U, W`` where backward needs their values. Each chunk's terms are
computed twice in backward's place of once (the price of the memory), the state chain over the
chunks is run backward by hand:

========================================  =================================================
math                                      here
========================================  =================================================
``S_c, M_c, U, W`` of each chunk           :class:`_Summary` (forward: ``chunk._summary_chunk_terms``)
``(S, M) = compose(S_c, M_c)``             :class:`_Summary` (backward: autograd of the compose)
``Q_eff``, ``O_c = P U`` of each chunk     :class:`_OutputTerms` (``chunk._output_chunk_terms``)
``h_{i+1} = M_c[i] h_i + S_c[i]``          :class:`_Scan`
``o_i = Q_eff,i h_i + O_c,i``              :class:`_Scan`
``λ_i = M_c[i]ᵀ λ_{i+1} + Q_eff,iᵀ do_i``   :meth:`_Scan.backward` (``dS_c[i] = λ_{i+1}``,
                                          ``dM_c[i] = λ_{i+1} h_iᵀ``, ``dh_in = λ_0``)
========================================  =================================================

:func:`lean_summary`, :func:`lean_output_terms` and :func:`lean_outputs` mirror the chunk path's
``summary_terms`` + ``compose_chunks``, ``output_terms`` and ``run_chunks``; tests compare
the two paths (and both with the token-by-token reference).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .chunk import (
    _cat,
    _chunk_steps,
    _chunked,
    _ChunkContext,
    _compose_all,
    _exp,
    _layout,
    _output_chunk_terms,
    _summary_chunk_terms,
    _wide,
)

__all__ = ["LeanTerms", "lean_output_terms", "lean_outputs", "lean_summary"]


def _chunk_resets(resets: torch.Tensor | None, shape: torch.Size, n: int, C: int) -> Any:
    """``resets [B, T]`` (0/1) as ``[B, H, n, C]`` for inputs of ``shape [B, T, H, ...]``."""
    if resets is None:
        return None
    return _chunked(resets.unsqueeze(-1).expand(*shape[:3]), n, C)


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().requires_grad_()


def _add(total: torch.Tensor | None, part: torch.Tensor | None) -> Any:
    if part is None:
        return total
    return part if total is None else total + part


class _Summary(torch.autograd.Function):
    """``(k, v, g, β) -> (S, M, S_c, M_c, U, W)`` keeping only its inputs and ``S_c, M_c``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        resets: torch.Tensor | None,
        chunk_size: int,
    ) -> tuple[torch.Tensor, ...]:
        n, C = _layout(k.shape[1], chunk_size)
        dt = k.dtype
        rc = _chunk_resets(resets, k.shape, n, C)
        kc, vc, gc, bc = (_chunked(x, n, C) for x in (k, v, g, beta))
        parts: list[list[torch.Tensor]] = [[], [], [], []]
        for sl in _chunk_steps(kc):
            S_c, M_c, terms = _summary_chunk_terms(
                kc[:, :, sl], vc[:, :, sl], gc[:, :, sl], bc[:, :, sl],
                None if rc is None else rc[:, :, sl],
            )  # fmt: skip
            for acc, x in zip(parts, (S_c, M_c, terms.U, terms.W)):
                acc.append(x)
        S_c, M_c, U, W = (_cat(p) for p in parts)
        S, M = _compose_all(S_c, M_c)
        ctx.save_for_backward(k, v, g, beta, resets, U, W)
        ctx.layout = (n, C, dt)
        return S, M, S_c, M_c, U, W

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        dS, dM, dS_c, dM_c, dU, dW = grads
        k, v, g, beta, resets, U, W = ctx.saved_tensors
        n, C, _ = ctx.layout
        # the compose's share of dS_c, dM_c: autograd over the (small) chunk maps alone
        if dS is not None or dM is not None:
            S_c, M_c = _chunk_maps(k, g, U, W, resets)
            with torch.enable_grad():
                leaves = (_leaf(S_c), _leaf(M_c))
                S, M = _compose_all(*leaves)
                outs = [(x, d) for x, d in zip((S, M), (dS, dM)) if d is not None]
                dSc, dMc = torch.autograd.grad(
                    [x for x, _ in outs], leaves, [d for _, d in outs], allow_unused=True
                )
            dS_c, dM_c = _add(dS_c, dSc), _add(dM_c, dMc)
        rc = _chunk_resets(resets, k.shape, n, C)
        kc, vc, gc, bc = (_chunked(x, n, C) for x in (k, v, g, beta))
        grads_c: list[list[torch.Tensor]] = [[], [], [], []]
        for sl in _chunk_steps(kc):
            with torch.enable_grad():
                leaves = tuple(_leaf(x[:, :, sl]) for x in (kc, vc, gc, bc))
                S_b, M_b, terms = _summary_chunk_terms(
                    *leaves, None if rc is None else rc[:, :, sl]
                )
                pairs = [
                    (x, d[:, :, sl])
                    for x, d in zip((S_b, M_b, terms.U, terms.W), (dS_c, dM_c, dU, dW))
                    if d is not None
                ]
                got = torch.autograd.grad(
                    [x for x, _ in pairs], leaves, [d for _, d in pairs], allow_unused=True
                )
            for acc, x, leaf in zip(grads_c, got, leaves):
                acc.append(torch.zeros_like(leaf) if x is None else x)
        T = k.shape[1]
        dk, dv, dg, dbeta = (_unchunk(_cat(p), T) for p in grads_c)
        return dk, dv, dg, dbeta, None, None


def _unchunk(x: torch.Tensor, T: int) -> torch.Tensor:
    """``[B, H, n, C, ...] -> [B, T, H, ...]`` (the padding dropped)."""
    x = x.flatten(2, 3)[:, :, :T]
    return x.movedim(1, 2)


def _chunk_maps(
    k: torch.Tensor,
    g: torch.Tensor,
    U: torch.Tensor,
    W: torch.Tensor,
    resets: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-chunk maps ``S_c = K̃ᵀ U``, ``M_c = diag(e^{Γ_C}) − K̃ᵀ W`` (values, no graph)
    rebuilt from the keys, gates and UT solutions, so that backward need not keep them
    (one ``K×(K+V)`` pair a chunk, more than ``U`` and ``W`` themselves)."""
    n, C = U.shape[2], U.shape[3]
    rc = _chunk_resets(resets, k.shape, n, C)
    with torch.no_grad():
        kc, gc = _chunked(k, n, C), _chunked(g, n, C)
        G = torch.ones(C, C, dtype=gc.dtype, device=gc.device).tril() @ gc
        G_last = G[..., -1:, :]
        k_tail = _exp(G_last - G) * kc
        decay_last = torch.diag_embed(_exp(G_last.squeeze(-2)))
        if rc is not None:
            seg = rc.cumsum(-1)
            k_tail = k_tail * (seg == seg[..., -1:]).unsqueeze(-1)
            decay_last = decay_last * (seg[..., -1:] == 0).unsqueeze(-1)
        k_tail_t = k_tail.transpose(-1, -2)
        return k_tail_t @ U, decay_last - k_tail_t @ W


def _output_context(
    kc: torch.Tensor, gc: torch.Tensor, U: torch.Tensor, W: torch.Tensor, rc: Any
) -> _ChunkContext:
    """What :func:`~hyper_parallel.kda.chunk._output_chunk_terms` needs for chunked inputs,
    rebuilt from ``k, g`` and the UT solutions (the gate factors recomputed inside)."""
    C = kc.shape[-2]
    G = torch.ones(C, C, dtype=gc.dtype, device=gc.device).tril() @ gc
    same = first = None
    if rc is not None:
        seg = rc.cumsum(-1)
        same = seg.unsqueeze(-1) == seg.unsqueeze(-2)
        first = (seg == 0).unsqueeze(-1)
    return _ChunkContext(G, _exp(G), kc, U, W, same, first, _wide(G), None)


class _OutputTerms(torch.autograd.Function):
    """``(q, k, g, U, W) -> (Q_eff, O_c) [B, H, n, C, K|V]``, the block's state-independent
    output terms, keeping only its inputs: backward recomputes them a batch of chunks at a
    time."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        g: torch.Tensor,
        U: torch.Tensor,
        W: torch.Tensor,
        resets: torch.Tensor | None,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, C = U.shape[2], U.shape[3]
        rc = _chunk_resets(resets, q.shape, n, C)
        qc, kc, gc = (_chunked(x, n, C) for x in (q, k, g))
        Q_parts, O_parts = [], []
        for sl in _chunk_steps(kc):
            terms = _output_context(
                kc[:, :, sl], gc[:, :, sl], U[:, :, sl], W[:, :, sl],
                None if rc is None else rc[:, :, sl],
            )  # fmt: skip
            Q_eff, O_c = _output_chunk_terms(terms, qc[:, :, sl], scale)
            Q_parts.append(Q_eff)
            O_parts.append(O_c)
        ctx.save_for_backward(q, k, g, U, W, resets)
        ctx.scale = scale
        return _cat(Q_parts), _cat(O_parts)

    @staticmethod
    def backward(ctx: Any, dQ: torch.Tensor | None, dO: torch.Tensor | None) -> Any:  # type: ignore[override]
        q, k, g, U, W, resets = ctx.saved_tensors
        n, C = U.shape[2], U.shape[3]
        rc = _chunk_resets(resets, q.shape, n, C)
        qc, kc, gc = (_chunked(x, n, C) for x in (q, k, g))
        grads_c: list[list[torch.Tensor]] = [[], [], [], [], []]
        for sl in _chunk_steps(kc):
            with torch.enable_grad():
                leaves = tuple(_leaf(x[:, :, sl]) for x in (qc, kc, gc, U, W))
                terms = _output_context(
                    leaves[1], leaves[2], leaves[3], leaves[4], None if rc is None else rc[:, :, sl]
                )
                outs = _output_chunk_terms(terms, leaves[0], ctx.scale)
                pairs = [(x, d[:, :, sl]) for x, d in zip(outs, (dQ, dO)) if d is not None]
                got = torch.autograd.grad(
                    [x for x, _ in pairs], leaves, [d for _, d in pairs], allow_unused=True
                )
            for acc, x, leaf in zip(grads_c, got, leaves):
                acc.append(torch.zeros_like(leaf) if x is None else x)
        T = q.shape[1]
        dq, dk, dg = (_unchunk(_cat(p), T) for p in grads_c[:3])
        return dq, dk, dg, _cat(grads_c[3]), _cat(grads_c[4]), None, None


class _Scan(torch.autograd.Function):
    """The chunked recurrence from ``h_in``: ``o_i = Q_eff,i h_i + O_c,i``, ``h_{i+1} =
    M_c[i] h_i + S_c[i]`` → ``(o [B, T, H, V], h_out)``; keeps ``Q_eff`` and ``h_in`` (and
    the summary's own ``k, g, U, W``, to rebuild the maps: not the maps, not the ``n``
    intermediate states; backward reruns the cheap chain)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        Q_eff: torch.Tensor,
        O_c: torch.Tensor,
        S_c: torch.Tensor,
        M_c: torch.Tensor,
        h_in: torch.Tensor,
        T: int,
        k: torch.Tensor,
        g: torch.Tensor,
        U: torch.Tensor,
        W: torch.Tensor,
        resets: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        outs, h = [], h_in
        for i in range(S_c.shape[2]):
            outs.append(Q_eff[:, :, i] @ h + O_c[:, :, i])
            h = M_c[:, :, i] @ h + S_c[:, :, i]
        o = torch.stack(outs, dim=2).flatten(2, 3)[:, :, :T].transpose(1, 2)
        ctx.save_for_backward(Q_eff, h_in, k, g, U, W, resets)
        ctx.T = T
        return o, h

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor | None, dh_out: torch.Tensor | None) -> Any:  # type: ignore[override]
        Q_eff, h_in, k, g, U, W, resets = ctx.saved_tensors
        S_c, M_c = _chunk_maps(k, g, U, W, resets)
        n, C = Q_eff.shape[2], Q_eff.shape[3]
        hs, h = [], h_in
        for i in range(n):
            hs.append(h)
            h = M_c[:, :, i] @ h + S_c[:, :, i]
        if do is None:
            doc = Q_eff.new_zeros(*Q_eff.shape[:-1], S_c.shape[-1])
        else:
            doc = _chunked(do, n, C)  # [B, H, n, C, V]
        lam = torch.zeros_like(h_in) if dh_out is None else dh_out
        dQ = torch.empty_like(Q_eff)
        dS_c = torch.empty_like(S_c)
        dM_c = torch.empty_like(M_c)
        for i in range(n - 1, -1, -1):
            h_t = hs[i].transpose(-1, -2)
            dQ[:, :, i] = doc[:, :, i] @ h_t
            dS_c[:, :, i] = lam
            dM_c[:, :, i] = lam @ h_t
            lam = M_c[:, :, i].transpose(-1, -2) @ lam + Q_eff[:, :, i].transpose(-1, -2) @ doc[
                :, :, i
            ]
        return dQ, doc, dS_c, dM_c, lam, None, None, None, None, None, None


@dataclass
class LeanTerms:
    """A block's state-independent maps from :func:`lean_summary` (graph-connected):
    ``S_c [B, H, n, K, V]``, ``M_c [B, H, n, K, K]``, the UT solutions ``U``, ``W``, the
    inputs the outputs need again (``k``, ``g``, ``resets``) and the block length ``T``."""

    k: torch.Tensor
    g: torch.Tensor
    resets: torch.Tensor | None
    S_c: torch.Tensor
    M_c: torch.Tensor
    U: torch.Tensor
    W: torch.Tensor
    T: int


def lean_summary(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int,
    resets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, LeanTerms]:
    """The block's summary ``(S [B, H, K, V], M [B, H, K, K])`` and its per-chunk terms, for
    validated, non-empty inputs in one float dtype (the state's: fp32 or fp64), ``resets
    [B, T]`` (0/1) or None. Differentiable; keeps its inputs and one ``(S_c, M_c)`` a chunk."""
    rs = None if resets is None else resets.to(k.dtype)
    S, M, S_c, M_c, U, W = _Summary.apply(k, v, g, beta, rs, chunk_size)
    return S, M, LeanTerms(k, g, rs, S_c, M_c, U, W, k.shape[1])


def lean_output_terms(
    terms: LeanTerms, q: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q_eff [B, H, n, C, K], O_c [B, H, n, C, V])``: each chunk's outputs are ``o = Q_eff
    h_0 + O_c`` from the state ``h_0`` entering it. Independent of any state (computable while
    it is in flight); differentiable, keeping only its inputs (``q`` and the summary's)."""
    return _OutputTerms.apply(q, terms.k, terms.g, terms.U, terms.W, terms.resets, scale)


def lean_outputs(
    terms: LeanTerms, local: tuple[torch.Tensor, torch.Tensor], h_in: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs ``o [B, T, H, V]`` and the final state from the incoming state ``h_in [B, H,
    K, V]`` (state dtype) and ``local = lean_output_terms(...)``. Differentiable w.r.t. all;
    keeps ``Q_eff`` and ``h_in`` beside the summary's maps."""
    return _Scan.apply(
        *local, terms.S_c, terms.M_c, h_in, terms.T, terms.k, terms.g, terms.U, terms.W,
        terms.resets,
    )  # fmt: skip
