"""Token-by-token references: the obviously-correct twins of the chunk-parallel paths.

Per batch row and head the state ``h`` is ``[K, V]`` and each token applies
``h ← diag(exp g_t) h`` then ``h ← h + β_t k_t (v_t − hᵀk_t)ᵀ`` and reads ``o_t = hᵀ(scale·q_t)``,
so ``h_t = M_t h_{t-1} + β_t k_t v_tᵀ`` with ``M_t = (I − β_t k_t k_tᵀ) diag(exp g_t)``.
"""

from __future__ import annotations

import torch

from ._checks import check_cu_seqlens, check_qkv, state_dtype

__all__ = ["naive_recurrent_kda", "naive_state_summary"]


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run KDA one token at a time.

    ``q, k, g: [B, T, H, K]``, ``v: [B, T, H, V]``, ``beta: [B, T, H]``, ``initial_state:
    [B, H, K, V]`` (zero when None). The state is kept in fp32 (fp64 when the inputs are fp64).
    Returns ``(o [B, T, H, V] in v's dtype, final state [B, H, K, V] or None)``. Differentiable.
    ``cu_seqlens`` (``B == 1``, offsets ``[0, …, T]``): packed documents, the state zeroed at
    each document start after the first.
    """
    B, T, H, K, V = check_qkv(q, k, v, g, beta, initial_state)
    starts = set()
    if cu_seqlens is not None:
        starts = set(check_cu_seqlens(cu_seqlens, B, T, "naive_recurrent_kda")[1:-1])
    dt, out_dtype = state_dtype(v), v.dtype
    if scale is None:
        scale = K**-0.5
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    h = q.new_zeros(B, H, K, V)
    if initial_state is not None:
        h = h + initial_state.to(dt)
    outs = []
    for t in range(T):
        k_t, v_t, b_t = k[:, t], v[:, t], beta[:, t]
        if t in starts:
            h = torch.zeros_like(h)
        h = h * g[:, t].exp().unsqueeze(-1)
        err = v_t - torch.einsum("bhkv,bhk->bhv", h, k_t)
        h = h + (b_t.unsqueeze(-1) * k_t).unsqueeze(-1) * err.unsqueeze(-2)
        outs.append(torch.einsum("bhkv,bhk->bhv", h, q[:, t] * scale))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, H, V)
    return o.to(out_dtype), (h if output_final_state else None)


def naive_state_summary(
    k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, chunk_size: int = 64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold ``M_t`` token by token: the reference twin of :func:`state_summary`.

    Returns ``(S [B, H, K, V], M [B, H, K, K])`` with ``h_out = M h_in + S`` over the whole
    chunk (``chunk_size`` is accepted for signature parity and ignored). fp32, or fp64 for fp64
    inputs.
    """
    B, T, H, K, V = check_qkv(k, k, v, g, beta, None)
    dt = state_dtype(v)
    k, v, g, beta = (x.to(dt) for x in (k, v, g, beta))
    S = k.new_zeros(B, H, K, V)
    M = torch.eye(K, dtype=dt, device=k.device).expand(B, H, K, K).clone()
    for t in range(T):
        k_t, b_t = k[:, t], beta[:, t]
        m_t = torch.diag_embed(g[:, t].exp())
        m_t = m_t - (b_t[..., None, None] * k_t.unsqueeze(-1)) * (k_t * g[:, t].exp()).unsqueeze(-2)
        S = m_t @ S + (b_t.unsqueeze(-1) * k_t).unsqueeze(-1) * v[:, t].unsqueeze(-2)
        M = m_t @ M
    return S, M
