"""Serial DeepSeek-V2/V3 multi-head latent attention (MLA). No communication in here.

Shapes: B batch, S tokens, D hidden, H heads, dn = qk_nope_head_dim, dr = qk_rope_head_dim,
dv = v_head_dim, dc = kv_lora_rank, dq = dn + dr.

- query: ``q_proj`` (``q_lora_rank=None``) or ``q_a_proj -> RMSNorm -> q_b_proj``: [B,S,H,dq];
  RoPE on its last dr values.
- ``kv_a_proj_with_mqa``: [B,S,dc+dr] = the latent c (RMSNorm'd) and one rotary key shared
  by all heads (RoPE'd).
- ``kv_b_proj`` (rows laid out head by head, ``dn + dv`` rows per head): c -> per-head
  ``k_nope`` [B,S,H,dn] and ``v`` [B,S,H,dv]; ``k = [k_nope, k_rope]``.
- causal softmax attention with scale ``dq ** -0.5``, then ``o_proj`` [B,S,H·dv] -> [B,S,D].

The block's steps are module-level functions of any module with the DeepSeek attribute names
(``q_proj`` or ``q_a_proj``/``q_a_layernorm``/``q_b_proj``, ``kv_a_proj_with_mqa``,
``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``) and an :class:`MLAConfig` of its sizes:
:func:`project_q`, :func:`project_latent`, :func:`kv_heads` (the ``kv_b_proj`` expansion),
:func:`split_kv`, :func:`causal_attention`. The serial block below and the context-parallel
rewrite (``parallelize_mla``, for this block and the Hugging Face ones) call these same
functions on sequence or head shards, so the math is written once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "MLAConfig",
    "MultiHeadLatentAttention",
    "RMSNorm",
    "Rope",
    "apply_rope",
    "causal_attention",
    "document_causal_attention",
    "document_mask",
    "expand_kv",
    "kv_heads",
    "project_latent",
    "project_q",
    "rope_cos_sin",
    "split_kv",
]


@dataclass(frozen=True)
class MLAConfig:
    """Hyper-parameters of one MLA block (names follow the DeepSeek-V2/V3 configs)."""

    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "num_heads",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"MLAConfig.{name} must be a positive int, got {v!r}")
        if self.q_lora_rank is not None and (
            not isinstance(self.q_lora_rank, int)
            or isinstance(self.q_lora_rank, bool)
            or self.q_lora_rank < 1
        ):
            raise ValueError(
                f"MLAConfig.q_lora_rank must be None or a positive int, got {self.q_lora_rank!r}"
            )
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta!r}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return float(self.qk_head_dim) ** -0.5


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_cos_sin(
    positions: Tensor, dim: int, theta: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """cos/sin tables [len(positions), dim] for the rotate-half RoPE convention."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim)
    )
    freqs = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> Tensor:
    """RoPE on ``x [B, S, ..., dr]`` with tables ``[S, dr]`` or ``[B or 1, S, dr]`` (broadcast
    over the middle dims). Tables hold ``cat(θ, θ)`` (the angle of pair i at i and i + dr/2).

    ``interleaved=False`` (rotate-half): pair i is ``(x[i], x[i + dr/2])``.
    ``interleaved=True`` (DeepSeek checkpoints, ``config.rope_interleave``): pair i is
    ``(x[2i], x[2i+1])``, and the result lists the rotated first members, then the second
    members. Queries and keys get the same layout, so their dot products are unchanged.
    """
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    shape = (cos.shape[0], cos.shape[1]) + (1,) * (x.dim() - 3) + (cos.shape[-1],)
    cos, sin = cos.view(shape), sin.view(shape)
    half = x.shape[-1] // 2
    if interleaved:
        c, s = cos[..., :half], sin[..., :half]
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.cat([a * c - b * s, b * c + a * s], dim=-1)
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


@dataclass(frozen=True)
class Rope:
    """The rotary tables of one sequence block: ``cos``, ``sin`` ``[S, dr]`` or
    ``[B or 1, S, dr]`` and the pair layout (see :func:`apply_rope`)."""

    cos: Tensor
    sin: Tensor
    interleaved: bool = False

    def __call__(self, x: Tensor) -> Tensor:
        return apply_rope(x, self.cos, self.sin, self.interleaved)


def _rotate(x: Tensor, rope: Rope | None) -> Tensor:
    return x if rope is None else rope(x)  # None: NoPE (Kimi-Linear's MLA)


def project_q(m: Any, c: MLAConfig, x: Tensor, rope: Rope | None) -> Tensor:
    """``x [B, S, D] -> q [B, S, H, dq]`` with RoPE on the last dr values."""
    if c.q_lora_rank is None:
        q = m.q_proj(x)
    else:
        q = m.q_b_proj(m.q_a_layernorm(m.q_a_proj(x)))
    q = q.view(*x.shape[:2], c.num_heads, c.qk_head_dim)
    q_nope, q_rope = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
    return torch.cat([q_nope, _rotate(q_rope, rope)], dim=-1)


def project_latent(m: Any, c: MLAConfig, x: Tensor, rope: Rope | None) -> Tensor:
    """``x [B, S, D] -> [B, S, dc + dr]``: the normalised latent and the RoPE'd shared key."""
    latent, k_rope = m.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], -1)
    return torch.cat([m.kv_a_layernorm(latent), _rotate(k_rope, rope)], dim=-1)


def kv_heads(latent: Tensor, weight: Tensor, width: int) -> Tensor:
    """The ``kv_b_proj`` expansion: ``latent [B, S, dc]`` and ``weight [h·width, dc]`` (the
    rows of h consecutive heads, ``width = dn + dv`` rows each) -> ``kv [B, S, h, width]``."""
    return F.linear(latent, weight).view(*latent.shape[:2], -1, width)


def split_kv(c: MLAConfig, kv: Tensor, k_rope: Tensor) -> tuple[Tensor, Tensor]:
    """``kv [B,S,h,dn+dv]``, ``k_rope [B,S,dr]`` -> ``k [B,S,h,dq]``, ``v [B,S,h,dv]``."""
    k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
    k_rope = k_rope[:, :, None, :].expand(*k_nope.shape[:3], c.qk_rope_head_dim)
    return torch.cat([k_nope, k_rope], dim=-1), v


def expand_kv(c: MLAConfig, latent: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """``[B, S, dc + dr]`` and ``kv_b_proj`` rows ``[h·(dn+dv), dc]`` -> ``k [B, S, h, dq]``,
    ``v [B, S, h, dv]``."""
    lat, k_rope = latent.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
    return split_kv(c, kv_heads(lat, weight, c.qk_nope_head_dim + c.v_head_dim), k_rope)


def causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Causal softmax attention on ``[B, S, h, d]`` tensors holding every token of the
    sequence (query i sees keys 0..i); ``scale`` multiplies ``q·k``. -> ``[B, S, h, dv]``."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale
    )
    return out.transpose(1, 2)


def document_mask(cu_seqlens: Tensor, seq_len: int, device: Any = None) -> Tensor:
    """``[S, S]`` bool (True = attend): query ``i`` sees key ``j`` iff ``j <= i`` and both lie
    in the same document of ``cu_seqlens`` (the global offsets ``[0, …, S]``)."""
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    pos = torch.arange(seq_len, device=device)
    doc = torch.searchsorted(cu, pos, right=True)
    return (pos[None, :] <= pos[:, None]) & (doc[None, :] == doc[:, None])


def document_causal_attention(
    q: Tensor, k: Tensor, v: Tensor, scale: float, cu_seqlens: Tensor
) -> Tensor:
    """:func:`causal_attention` over packed documents: ``[B, S, h, d]`` tensors holding every
    token of the sequence; query ``i`` sees the keys ``j <= i`` of its own document
    (``cu_seqlens``: the documents' offsets ``[0, …, S]``, validated by the caller). The same
    result as running :func:`causal_attention` on each document alone."""
    mask = document_mask(cu_seqlens, q.shape[1], q.device)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale
    )
    return out.transpose(1, 2)


class MultiHeadLatentAttention(nn.Module):
    """DeepSeek-V2/V3 MLA block: ``forward(hidden_states [B, S, D]) -> [B, S, D]`` (causal)."""

    def __init__(self, config: MLAConfig, *, bias: bool = False) -> None:
        super().__init__()
        c = config
        self.config = c
        h, dq = c.num_heads, c.qk_head_dim
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(c.hidden_size, h * dq, bias=bias)
        else:
            self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank)
            self.q_b_proj = nn.Linear(c.q_lora_rank, h * dq, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(
            c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, bias=bias
        )
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank)
        self.kv_b_proj = nn.Linear(
            c.kv_lora_rank, h * (c.qk_nope_head_dim + c.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(h * c.v_head_dim, c.hidden_size, bias=bias)

    def rope(self, positions: Tensor, dtype: torch.dtype) -> Rope:
        """Rotate-half tables for the given (global) token positions."""
        c = self.config
        return Rope(*rope_cos_sin(positions, c.qk_rope_head_dim, c.rope_theta, dtype))

    def forward(self, hidden_states: Tensor) -> Tensor:
        c = self.config
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != c.hidden_size:
            raise ValueError(
                f"hidden_states must be [B, S, {c.hidden_size}], got {tuple(hidden_states.shape)}"
            )
        x = hidden_states
        rope = self.rope(torch.arange(x.shape[1], device=x.device), x.dtype)
        q = project_q(self, c, x, rope)
        k, v = expand_kv(c, project_latent(self, c, x, rope), self.kv_b_proj.weight)
        out = causal_attention(q, k, v, c.softmax_scale)
        return self.o_proj(out.flatten(2))
