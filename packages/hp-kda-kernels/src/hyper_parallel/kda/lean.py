"""The lean chunk path: backward keeps the inputs and one value and two key rows a token, not
the chunks' pairwise gate tensors.

The chunk path (:mod:`hyper_parallel.kda.chunk`) under plain autograd keeps, for every chunk,
everything its backward touches: the in-chunk decay products ``A`` and ``P`` (``C×C``), their
gate factors (``C×K``, or ``C×16×K`` pairwise ones for chunks with a wide gate range), the UT
system and every product around it: about 2.4 MB a token for one real-size KDA layer. Here
three autograd functions run the same math and keep only

- the inputs ``q, k, v, g, β`` (the caller's tensors, no copies),
- the UT solutions ``U [.., C, V]``, ``W [.., C, K]`` (one value and one key row a token),
- the effective queries ``Q_eff [.., C, K]`` (one key row a token) and the block's incoming
  state ``h_in``.

Nothing of the size of the per-chunk maps ``S_c [.., K, V]``, ``M_c [.., K, K]`` (``K(K+V)/C``
numbers a token, more than ``U`` and ``W`` together) is kept or built for every head at once:
they are rebuilt from ``k, g, U, W`` (:func:`_chunk_maps`, one matmul a chunk) a few heads at a
time (:func:`_head_slices`), where a state chain needs them. Backward recomputes each chunk's
intra-chunk terms a small block of heads and chunks at a time (:func:`_blocks`) and
backpropagates through that block alone, so its transient stays a few MiB; the chains over
the chunks run backward by hand:

==========================================  ===============================================
math                                        here
==========================================  ===============================================
``U, W`` (UT solve) of each chunk            :class:`_Summary` (``chunk._summary_chunk_terms``)
``S_c = K̃ᵀU``, ``M_c = diag(e^{Γ_C}) − K̃ᵀW``   :func:`_chunk_maps`
``(S, M)``: ``X_{i+1} = M_c[i] X_i + S_c[i]``,  :class:`_Summary`; backward:
``Y_{i+1} = M_c[i] Y_i`` from ``(0, I)``        ``dS_c[i] = λ_{i+1}``,
                                             ``dM_c[i] = λ_{i+1} X_iᵀ + Λ_{i+1} Y_iᵀ``,
                                             ``(λ_i, Λ_i) = M_c[i]ᵀ (λ_{i+1}, Λ_{i+1})``
``Q_eff``, ``O_c = P U`` of each chunk       :class:`_OutputTerms` (``chunk._output_chunk_terms``)
``o_i = Q_eff,i h_i + O_c,i``,                :class:`_Scan`; backward: ``dS_c[i] = λ_{i+1}``,
``h_{i+1} = M_c[i] h_i + S_c[i]``              ``dM_c[i] = λ_{i+1} h_iᵀ``, ``λ_i = M_c[i]ᵀ
                                             λ_{i+1} + Q_eff,iᵀ do_i``, ``dh_in = λ_0``
==========================================  ===============================================

Each chunk's intra-chunk terms are computed twice where plain autograd computes them once
(the price of the memory); the step is still faster on a CPU than the chunk path, which
spends its time allocating what it keeps. :func:`lean_summary`, :func:`lean_output_terms`
and :func:`lean_outputs` mirror the chunk path's ``summary_terms`` + ``compose_chunks``,
``output_terms`` and ``run_chunks``; tests compare the two paths (float64, every gradient).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from .chunk import (
    _SUB,
    _ChunkContext,
    _decay,
    _layout,
    _output_chunk_terms,
    _summary_chunk_terms,
    _wide,
)

__all__ = ["LeanTerms", "lean_output_terms", "lean_outputs", "lean_summary"]

# Elements of the largest pairwise gate tensor one block of (heads, chunks) builds at once
# (8 MiB in fp32), and of the per-chunk maps a head slice rebuilds at once (4 MiB): the
# transients of backward stay small beside what is kept.
_BLOCK_BUDGET = 1 << 21
_MAPS_BUDGET = 1 << 20

_Block = tuple[slice, slice]
_F = TypeVar("_F", bound=Callable[..., Any])


def _flushing() -> bool:
    """Whether this thread already treats subnormal floats as zero."""
    return torch.tensor([1e-39], dtype=torch.float32).mul(1.0).item() == 0.0


@contextlib.contextmanager
def _without_subnormals(device: torch.device) -> Iterator[None]:
    """On a CPU, subnormal fp32 numbers as zero while the block runs (this thread; the
    setting before it is restored). Strongly decaying gates make the chunk maps' and chains'
    products underflow into subnormals, whose arithmetic is tens of times slower on CPUs: a
    real-size layer's backward ran 2x slower with them. What is flushed is below 1.2e-38;
    float64 has no subnormal that fp32 sums could see. Accelerators flush in hardware."""
    if device.type != "cpu" or _flushing() or not torch.set_flush_denormal(True):
        yield
        return
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def _flushed(fn: _F) -> _F:
    """Run an autograd function's ``forward(ctx, x, ...)`` / ``backward(ctx, ...)`` under
    :func:`_without_subnormals` for the device of its first tensor argument."""

    @functools.wraps(fn)
    def run(ctx: Any, *args: Any) -> Any:
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        device = first.device if first is not None else torch.device("cpu")
        with _without_subnormals(device):
            return fn(ctx, *args)

    return run  # type: ignore[return-value]


def _chunks(x: torch.Tensor, n: int, C: int) -> torch.Tensor:
    """``[B, T, H, ...] -> [B, H, n, C, ...]``: a view when ``T = n·C``, else zero-padded."""
    T = x.shape[1]
    if n * C != T:
        x = torch.cat([x, x.new_zeros(x.shape[0], n * C - T, *x.shape[2:])], dim=1)
    return x.unflatten(1, (n, C)).movedim(3, 1)


def _unchunk(x: torch.Tensor, T: int) -> torch.Tensor:
    """``[B, H, n, C, ...] -> [B, T, H, ...]`` (the padding dropped)."""
    return x.flatten(2, 3)[:, :, :T].movedim(1, 2)


def _chunk_resets(resets: torch.Tensor | None, shape: torch.Size, n: int, C: int) -> Any:
    """``resets [B, T]`` (0/1) as ``[B, H, n, C]`` for inputs of ``shape [B, T, H, ...]``."""
    if resets is None:
        return None
    return _chunks(resets.unsqueeze(-1).expand(*shape[:3]), n, C)


def _blocks(kc: torch.Tensor) -> list[_Block]:
    """``(heads, chunks)`` slices of chunked ``[B, H, n, C, K]`` inputs, each small enough
    for :data:`_BLOCK_BUDGET`: whole chunks of a few heads, or a few chunks of every head;
    chunks in order within each head slice."""
    B, H, n, C, K = kc.shape
    per = B * C * min(C, 2 * _SUB) * K  # one head, one chunk
    units = max(1, _BLOCK_BUDGET // max(per, 1))
    heads = min(H, units)
    chunks = max(1, units // H) if heads == H else 1
    return [
        (slice(h, h + heads), slice(c, c + chunks))
        for h in range(0, H, heads)
        for c in range(0, n, chunks)
    ]


def _head_slices(B: int, H: int, n: int, K: int, V: int) -> list[slice]:
    """Head slices whose per-chunk maps (``n`` chunks of ``K×(K+V)``) fit :data:`_MAPS_BUDGET`
    (at least one head)."""
    heads = max(1, min(H, _MAPS_BUDGET // max(B * n * K * (K + V), 1)))
    return [slice(h, h + heads) for h in range(0, H, heads)]


def _at(x: Any, blk: _Block) -> Any:
    """Block ``blk`` of a ``[B, H, n, ...]`` tensor (None stays None)."""
    return None if x is None else x[:, blk[0], blk[1]]


def _heads(x: Any, hs: slice) -> Any:
    return None if x is None else x[:, hs]


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().requires_grad_()


def _chunk_maps(
    kc: torch.Tensor, gc: torch.Tensor, U: torch.Tensor, W: torch.Tensor, rc: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-chunk maps ``S_c = K̃ᵀ U [.., n, K, V]``, ``M_c = diag(e^{Γ_C}) − K̃ᵀ W [.., n,
    K, K]`` of chunked keys, gates (``[.., n, C, K]``) and UT solutions, ``K̃ = e^{Γ_C − Γ} ⊙ k``
    (with packed documents: ``K̃`` on the chunk's last segment only, ``diag(e^{Γ_C})`` only
    without a reset). Differentiable; what ``chunk._summary_chunk_terms`` computes from the
    same ``U, W``."""
    C = kc.shape[-2]
    G = torch.ones(C, C, dtype=gc.dtype, device=gc.device).tril() @ gc
    G_last = G[..., -1:, :]
    k_tail = _decay(G_last - G) * kc
    decay_last = torch.diag_embed(_decay(G_last.squeeze(-2)))
    if rc is not None:
        seg = rc.cumsum(-1)
        k_tail = k_tail * (seg == seg[..., -1:]).unsqueeze(-1)
        decay_last = decay_last * (seg[..., -1:] == 0).unsqueeze(-1)
    k_tail_t = k_tail.transpose(-1, -2)
    return k_tail_t @ U, decay_last - k_tail_t @ W


def _maps_backward(
    parts: tuple[torch.Tensor, ...], rc: Any, dS_c: torch.Tensor, dM_c: torch.Tensor
) -> tuple[Any, ...]:
    """Gradients of ``(k, g, U, W)`` (chunked slices ``parts``) from those of their maps."""
    with torch.enable_grad():
        leaves = tuple(_leaf(x) for x in parts)
        S_c, M_c = _chunk_maps(leaves[0], leaves[1], leaves[2], leaves[3], rc)
        return torch.autograd.grad((S_c, M_c), leaves, (dS_c, dM_c), allow_unused=True)


def _add_at(acc: torch.Tensor, where: Any, x: torch.Tensor | None) -> None:
    if x is not None:
        acc[where] += x


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
    return _ChunkContext(G, _decay(G), kc, U, W, same, first, _wide(G), None)


class _Summary(torch.autograd.Function):
    """``(k, v, g, β) -> (S, M, U, W)``: the block's summary and UT solutions, keeping only
    its inputs and ``U, W``."""

    @staticmethod
    @_flushed
    def forward(  # type: ignore[override]
        ctx: Any,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        resets: torch.Tensor | None,
        chunk_size: int,
    ) -> tuple[torch.Tensor, ...]:
        B, T, H, K = k.shape
        V = v.shape[-1]
        n, C = _layout(T, chunk_size)
        rc = _chunk_resets(resets, k.shape, n, C)
        kc, vc, gc, bc = (_chunks(x, n, C) for x in (k, v, g, beta))
        U = k.new_empty(B, H, n, C, V)
        W = k.new_empty(B, H, n, C, K)
        S = k.new_zeros(B, H, K, V)
        M = torch.eye(K, dtype=k.dtype, device=k.device).expand(B, H, K, K).clone()
        for blk in _blocks(kc):  # chunks in order within each head slice: fold as we go
            S_b, M_b, terms = _summary_chunk_terms(*(_at(x, blk) for x in (kc, vc, gc, bc, rc)))
            U[:, blk[0], blk[1]] = terms.U
            W[:, blk[0], blk[1]] = terms.W
            hs = blk[0]
            for j in range(S_b.shape[2]):
                S[:, hs] = M_b[:, :, j] @ S[:, hs] + S_b[:, :, j]
                M[:, hs] = M_b[:, :, j] @ M[:, hs]
        ctx.save_for_backward(k, v, g, beta, resets, U, W)
        ctx.chunk = (n, C)
        return S, M, U, W

    @staticmethod
    @_flushed
    def backward(  # type: ignore[override]
        ctx: Any, dS: Any, dM: Any, dU: Any, dW: Any
    ) -> tuple[Any, ...]:
        k, v, g, beta, resets, U, W = ctx.saved_tensors
        n, C = ctx.chunk
        B, T, H, K = k.shape
        V = v.shape[-1]
        rc = _chunk_resets(resets, k.shape, n, C)
        kc, vc, gc, bc = (_chunks(x, n, C) for x in (k, v, g, beta))
        grads = [torch.zeros_like(x) for x in (kc, vc, gc, bc)]  # chunked, written in place
        for hs in _head_slices(B, H, n, K, V):
            parts = (kc[:, hs], gc[:, hs], U[:, hs], W[:, hs])
            rch = _heads(rc, hs)
            with torch.no_grad():
                S_c, M_c = _chunk_maps(*parts, rch)
            # the states of the two chains entering each chunk, from (0, I)
            X = S_c.new_zeros(S_c.shape[0], S_c.shape[1], K, V)
            Y = torch.eye(K, dtype=X.dtype, device=X.device).expand(*X.shape[:2], K, K)
            Xs, Ys = [], []
            for i in range(n):
                Xs.append(X)
                Ys.append(Y)
                X = M_c[:, :, i] @ X + S_c[:, :, i]
                Y = M_c[:, :, i] @ Y
            lam = torch.zeros_like(X) if dS is None else dS[:, hs]
            Lam = torch.zeros_like(Y) if dM is None else dM[:, hs]
            dS_c, dM_c = torch.empty_like(S_c), torch.empty_like(M_c)
            for i in range(n - 1, -1, -1):
                dS_c[:, :, i] = lam
                dM_c[:, :, i] = lam @ Xs[i].transpose(-1, -2) + Lam @ Ys[i].transpose(-1, -2)
                Mt = M_c[:, :, i].transpose(-1, -2)
                lam, Lam = Mt @ lam, Mt @ Lam
            del S_c, M_c, Xs, Ys
            # the maps' share (through K̃, U, W) and the UT solve's, a block at a time
            got = _maps_backward(parts, rch, dS_c, dM_c)
            del dS_c, dM_c
            dUh = got[2] if dU is None else got[2] + dU[:, hs]
            dWh = got[3] if dW is None else got[3] + dW[:, hs]
            _add_at(grads[0], (slice(None), hs), got[0])
            _add_at(grads[2], (slice(None), hs), got[1])
            sub = (kc[:, hs], vc[:, hs], gc[:, hs], bc[:, hs])
            for blk in _blocks(sub[0]):
                with torch.enable_grad():
                    leaves = tuple(_leaf(_at(x, blk)) for x in sub)
                    kb, vb, gb, bb = leaves
                    _, _, terms = _summary_chunk_terms(kb, vb, gb, bb, _at(rch, blk))
                    got_b = torch.autograd.grad(
                        (terms.U, terms.W), leaves, (_at(dUh, blk), _at(dWh, blk)),
                        allow_unused=True,
                    )  # fmt: skip
                lo = hs.start + blk[0].start  # the block's heads, in the whole tensor
                where = (slice(None), slice(lo, lo + leaves[0].shape[1]), blk[1])
                for acc, x in zip(grads, got_b):
                    _add_at(acc, where, x)
        dk, dv, dg, dbeta = (_unchunk(x, T) for x in grads)
        return dk, dv, dg, dbeta, None, None


class _OutputTerms(torch.autograd.Function):
    """``(q, k, g, U, W) -> (Q_eff, O_c) [B, H, n, C, K|V]``, the block's state-independent
    output terms, keeping only its inputs: backward recomputes them a block at a time."""

    @staticmethod
    @_flushed
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
        qc, kc, gc = (_chunks(x, n, C) for x in (q, k, g))
        Q_eff, O_c = torch.empty_like(W), torch.empty_like(U)
        for blk in _blocks(kc):
            terms = _output_context(*(_at(x, blk) for x in (kc, gc, U, W, rc)))
            Q_b, O_b = _output_chunk_terms(terms, _at(qc, blk), scale)
            Q_eff[:, blk[0], blk[1]] = Q_b
            O_c[:, blk[0], blk[1]] = O_b
        ctx.save_for_backward(q, k, g, U, W, resets)
        ctx.scale = scale
        return Q_eff, O_c

    @staticmethod
    @_flushed
    def backward(ctx: Any, dQ: Any, dO: Any) -> Any:  # type: ignore[override]
        q, k, g, U, W, resets = ctx.saved_tensors
        n, C = U.shape[2], U.shape[3]
        rc = _chunk_resets(resets, q.shape, n, C)
        qc, kc, gc = (_chunks(x, n, C) for x in (q, k, g))
        grads = [torch.zeros_like(x) for x in (qc, kc, gc, U, W)]
        for blk in _blocks(kc):
            with torch.enable_grad():
                leaves = tuple(_leaf(_at(x, blk)) for x in (qc, kc, gc, U, W))
                terms = _output_context(leaves[1], leaves[2], leaves[3], leaves[4], _at(rc, blk))
                outs = _output_chunk_terms(terms, leaves[0], ctx.scale)
                pairs = [(x, _at(d, blk)) for x, d in zip(outs, (dQ, dO)) if d is not None]
                got = torch.autograd.grad(
                    [x for x, _ in pairs], leaves, [d for _, d in pairs], allow_unused=True
                )
            for acc, x in zip(grads, got):
                _add_at(acc, (slice(None), blk[0], blk[1]), x)
        T = q.shape[1]
        dq, dk, dg = (_unchunk(x, T) for x in grads[:3])
        return dq, dk, dg, grads[3], grads[4], None, None


class _Scan(torch.autograd.Function):
    """The chunked recurrence from ``h_in``: ``o_i = Q_eff,i h_i + O_c,i``, ``h_{i+1} =
    M_c[i] h_i + S_c[i]`` → ``(o [B, T, H, V], h_out)``, the maps rebuilt from ``k, g, U, W``
    a head slice at a time; keeps ``Q_eff`` and ``h_in`` (with the summary's ``k, g, U, W``)."""

    @staticmethod
    @_flushed
    def forward(  # type: ignore[override]
        ctx: Any,
        Q_eff: torch.Tensor,
        O_c: torch.Tensor,
        h_in: torch.Tensor,
        k: torch.Tensor,
        g: torch.Tensor,
        U: torch.Tensor,
        W: torch.Tensor,
        resets: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, H, K = k.shape
        n, C, V = U.shape[2], U.shape[3], U.shape[4]
        rc = _chunk_resets(resets, k.shape, n, C)
        kc, gc = _chunks(k, n, C), _chunks(g, n, C)
        o = torch.empty_like(O_c)
        h_out = torch.empty_like(h_in)
        for hs in _head_slices(B, H, n, K, V):
            S_c, M_c = _chunk_maps(kc[:, hs], gc[:, hs], U[:, hs], W[:, hs], _heads(rc, hs))
            h = h_in[:, hs]
            for i in range(n):
                o[:, hs, i] = Q_eff[:, hs, i] @ h + O_c[:, hs, i]
                h = M_c[:, :, i] @ h + S_c[:, :, i]
            h_out[:, hs] = h
        ctx.save_for_backward(Q_eff, h_in, k, g, U, W, resets)
        return _unchunk(o, T), h_out

    @staticmethod
    @_flushed
    def backward(ctx: Any, do: Any, dh_out: Any) -> Any:  # type: ignore[override]
        Q_eff, h_in, k, g, U, W, resets = ctx.saved_tensors
        B, T, H, K = k.shape
        n, C, V = U.shape[2], U.shape[3], U.shape[4]
        rc = _chunk_resets(resets, k.shape, n, C)
        kc, gc = _chunks(k, n, C), _chunks(g, n, C)
        doc = Q_eff.new_zeros(*Q_eff.shape[:-1], V) if do is None else _chunks(do, n, C)
        dQ = torch.empty_like(Q_eff)
        dh_in = torch.empty_like(h_in)
        dk, dg = torch.zeros_like(kc), torch.zeros_like(gc)
        dU, dW = torch.zeros_like(U), torch.zeros_like(W)
        for hs in _head_slices(B, H, n, K, V):
            parts = (kc[:, hs], gc[:, hs], U[:, hs], W[:, hs])
            rch = _heads(rc, hs)
            with torch.no_grad():
                S_c, M_c = _chunk_maps(*parts, rch)
            hs_states, h = [], h_in[:, hs]
            for i in range(n):
                hs_states.append(h)
                h = M_c[:, :, i] @ h + S_c[:, :, i]
            lam = torch.zeros_like(h) if dh_out is None else dh_out[:, hs]
            dS_c, dM_c = torch.empty_like(S_c), torch.empty_like(M_c)
            for i in range(n - 1, -1, -1):
                h_t = hs_states[i].transpose(-1, -2)
                do_i = doc[:, hs, i]
                dQ[:, hs, i] = do_i @ h_t
                dS_c[:, :, i] = lam
                dM_c[:, :, i] = lam @ h_t
                lam = (
                    M_c[:, :, i].transpose(-1, -2) @ lam + Q_eff[:, hs, i].transpose(-1, -2) @ do_i
                )
            dh_in[:, hs] = lam
            del S_c, M_c, hs_states
            got = _maps_backward(parts, rch, dS_c, dM_c)
            for acc, x in zip((dk, dg, dU, dW), got):
                _add_at(acc, (slice(None), hs), x)
        return dQ, doc, dh_in, _unchunk(dk, T), _unchunk(dg, T), dU, dW, None


@dataclass
class LeanTerms:
    """A block's UT solutions from :func:`lean_summary` (graph-connected) ``U [B, H, n, C,
    V]``, ``W [B, H, n, C, K]``, and the inputs its outputs need again (``k``, ``g``,
    ``resets``)."""

    k: torch.Tensor
    g: torch.Tensor
    resets: torch.Tensor | None
    U: torch.Tensor
    W: torch.Tensor


def lean_summary(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int,
    resets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, LeanTerms]:
    """The block's summary ``(S [B, H, K, V], M [B, H, K, K])`` and its UT solutions, for
    validated, non-empty inputs ``k, g [B, T, H, K]``, ``v [B, T, H, V]``, ``beta [B, T, H]``
    in one float dtype (the state's: fp32 or fp64), ``resets [B, T]`` (0/1) or None.
    Differentiable; keeps its inputs and ``U, W``."""
    rs = None if resets is None else resets.to(k.dtype)
    S, M, U, W = _Summary.apply(k, v, g, beta, rs, chunk_size)
    return S, M, LeanTerms(k, g, rs, U, W)


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
    keeps ``Q_eff`` and ``h_in`` beside the summary's tensors."""
    Q_eff, O_c = local
    return _Scan.apply(Q_eff, O_c, h_in, terms.k, terms.g, terms.U, terms.W, terms.resets)
