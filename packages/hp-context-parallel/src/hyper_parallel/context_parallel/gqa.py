"""Grouped-query attention (GQA) for the context-parallel pipeline: sizes, math, the K/V side.

Notation: B batch, S tokens, P ranks, D hidden, H query heads, ``Hkv`` key/value heads
(``H % Hkv == 0``; query head ``i`` uses key/value head ``i // n``, ``n = H / Hkv``), d
``head_dim``, ``dr`` the rotary width (``d · partial_rotary_factor``), ``h = H/P`` query
heads per rank after the sequence→head exchange, G head groups of ``hg = h/G``.

The block, as the stock Hugging Face modules compute it (``LlamaAttention``,
``Qwen3Attention``, ``Qwen3NextAttention``; recognised by class name, ``transformers`` is
never imported):

1. ``q = q_proj(x)``, ``[B, S, H, d]``; gated (Qwen3-Next) ``q_proj`` gives ``[B, S, H, 2d]``
   per head ``[q^h | gate^h]``, the gate kept on the token as ``[B, S, H·d]``;
   ``q ← q_norm(q)`` (Qwen3, Qwen3-Next: RMSNorm over d); RoPE on the first ``dr`` values of
   each head (partial rotary; ``dr = d`` for Llama and Qwen3).
2. ``k = k_norm(k_proj(x))``, ``v = v_proj(x)``, ``[B, S, Hkv, d]``; RoPE on k likewise.
3. ``o^i = causal softmax(scale · q^i · k^{i//n}) · v^{i//n}``; ``y = o_proj(o ⊙ σ(gate))``
   (``o_proj(o)`` ungated).

Context parallel (:func:`~hyper_parallel.context_parallel.parallelize_attention`): 1–2 on the
rank's tokens; the a2a of q per head group (the pipeline's, as for MLA); **one a2a of
``[k | v]`` carrying each rank the key/value heads its query heads use** (:func:`kv_plan`,
:class:`GroupedKV`); 3 per head; the a2a of o back; the gate multiplies o on the rank's own
tokens (fused with ``o_proj`` in
:class:`~hyper_parallel.context_parallel.fused.WaitLinearGroups`), never exchanged.

The key/value exchange. Rank r's query heads ``[r·h, (r+1)·h)`` use the key/value heads
``need_r = {i // n}``. The send buffer is ``[B, S/P, P·m, 2d]``: chunk j is ``need_j``
(padded to ``m = max_j |need_j|`` by repeating its last head), taken from the rank's
``[B, S/P, Hkv, 2d]`` by one index; an ordinary Ulysses all-to-all then hands every rank its
``m`` heads of every token, ``[B, S, m, 2d]``, and each query head reads its slot. So each
key/value head's sequence block goes once to every rank whose query heads use it — replicated
within the all-to-all, never all-gathered, never repeated per query head:

- ``Hkv % P == 0``: ``m = Hkv/P``, ``need_r`` the rank's own heads: plain Ulysses of k, v;
- ``P % Hkv == 0`` (Qwen3-Next, 2 kv heads, at cp 4): ``m = 1``, kv head j goes to the
  ``P/Hkv`` ranks ``[j·P/Hkv, (j+1)·P/Hkv)``;
- otherwise (``h`` and ``n`` not aligned): ``m`` covers the largest span, padding repeats.

Bytes each rank sends per forward (the backward mirrors them), with element size e:
``a2a Q`` and ``a2a O`` ``B·(S/P)·H·d·e·(P-1)/P`` each; ``a2a KV`` ``B·(S/P)·(P-1)·m·2d·e``
(the rank's block of the m heads each peer needs). An all-gather of k and v would send
``B·(S/P)·(P-1)·Hkv·2d·e`` (``Hkv/m`` times as much); Ulysses after repeating k, v to H heads
``B·(S/P)·(P-1)·(H/P)·2d·e`` (``h/m`` times). The gate moves nothing.

Head groups (G > 1): the key/value exchange is split per group when every group's query heads
use their own key/value heads (``hg % n == 0``: group g's buffer is the g-th slice of each
rank's share, the same bytes as one exchange); otherwise it is one exchange with group 0, in
flight under the Q projection, whose result every group reads (so no head is sent twice).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hyper_parallel.context_parallel.exchange import Exchange
from hyper_parallel.context_parallel.families import (
    AttentionFamily,
    MLACall,
    Run,
    caller_rope_forward,
)
from hyper_parallel.context_parallel.fused import mark
from hyper_parallel.context_parallel.mla import Rope
from hyper_parallel.context_parallel.strategies import Strategy
from hyper_parallel.context_parallel.transport import BLOCK_OWNER

__all__ = [
    "ATTENTION_FAMILIES",
    "SUPPORTED_ATTENTION_CLASSES",
    "GQAConfig",
    "GQAFamily",
    "GroupedKV",
    "KVPlan",
    "find_attention_family",
    "kv_plan",
    "project_kv",
    "project_q",
    "rotate",
]


@dataclass(frozen=True)
class GQAConfig:
    """The sizes of one grouped-query attention block (read from the module)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    gated: bool = False  # q_proj also gives the output gate (Qwen3-Next)
    qk_norm: bool = False  # q_norm / k_norm over the head dim (Qwen3, Qwen3-Next)

    @property
    def qk_head_dim(self) -> int:
        """The query head width (what the ``"auto"`` head-group rule sizes exchanges by)."""
        return self.head_dim

    @property
    def kv_repeat(self) -> int:
        """``n = H / Hkv``: query heads per key/value head."""
        return self.num_heads // self.num_kv_heads


# ---- the math, on any block of tokens ------------------------------------------------------
def rotate(x: Tensor, rope: Rope | None) -> Tensor:
    """RoPE (rotate-half) on the first ``dr`` values of each head of ``x [B, S, heads, d]``
    (``dr``: the tables' width; the rest passes unrotated, Hugging Face's partial rotary)."""
    if rope is None:
        return x
    dr = rope.cos.shape[-1]
    if dr == x.shape[-1]:
        return rope(x)
    return torch.cat([rope(x[..., :dr]), x[..., dr:]], dim=-1)


def project_q(m: Any, c: GQAConfig, x: Tensor, rope: Rope | None) -> tuple[Tensor, Tensor | None]:
    """``x [B, S, D]`` -> ``q [B, S, H, d]`` (normed, RoPE'd) and the output gate
    ``[B, S, H·d]`` (None ungated)."""
    b, s = x.shape[:2]
    q = m.q_proj(x)
    gate = None
    if c.gated:
        q, gate = q.view(b, s, c.num_heads, 2 * c.head_dim).chunk(2, dim=-1)
        gate = gate.reshape(b, s, c.num_heads * c.head_dim)
    else:
        q = q.view(b, s, c.num_heads, c.head_dim)
    if c.qk_norm:
        q = m.q_norm(q)
    return rotate(q, rope), gate


def project_kv(m: Any, c: GQAConfig, x: Tensor, rope: Rope | None) -> tuple[Tensor, Tensor]:
    """``x [B, S, D]`` -> ``k`` (normed, RoPE'd), ``v``, each ``[B, S, Hkv, d]``."""
    b, s = x.shape[:2]
    k = m.k_proj(x).view(b, s, c.num_kv_heads, c.head_dim)
    if c.qk_norm:
        k = m.k_norm(k)
    v = m.v_proj(x).view(b, s, c.num_kv_heads, c.head_dim)
    return rotate(k, rope), v


# ---- which key/value heads go where ---------------------------------------------------------
@dataclass(frozen=True)
class KVPlan:
    """The key/value exchanges of one forward on one rank (see the module docstring).

    ``send[e]``: exchange e's send buffer as key/value head indices, ``P·m_e`` of them (chunk
    j: what rank j receives); ``local[g]``: for each of query group g's ``hg`` heads, its
    slot in the received ``[B, S, m_e, 2d]`` of the exchange that carries group g (exchange
    g when ``exchanges == G``, else exchange 0)."""

    exchanges: int
    send: tuple[tuple[int, ...], ...]
    local: tuple[tuple[int, ...], ...]

    def slots(self, e: int, cp_size: int) -> int:
        """``m_e``: the key/value heads each rank receives from exchange e."""
        return len(self.send[e]) // cp_size

    def exchange_of(self, g: int) -> int:
        return g if self.exchanges > 1 else 0


def kv_plan(num_heads: int, num_kv_heads: int, cp_size: int, groups: int, rank: int) -> KVPlan:
    """The :class:`KVPlan` of rank ``rank`` for H query heads, ``Hkv`` key/value heads, P
    ranks and G head groups (a pure function of these: every rank builds the same ``send``)."""
    rep = num_heads // num_kv_heads
    h = num_heads // cp_size
    hg = h // groups
    per_group = groups > 1 and hg % rep == 0  # each group its own kv heads: no head twice
    members = [[g] for g in range(groups)] if per_group else [list(range(groups))]
    send: list[tuple[int, ...]] = []
    local: list[tuple[int, ...]] = [()] * groups
    for gs in members:
        needs = [
            sorted({(r * h + g * hg + i) // rep for g in gs for i in range(hg)})
            for r in range(cp_size)
        ]
        m = max(len(n) for n in needs)
        padded = [n + [n[-1]] * (m - len(n)) for n in needs]
        send.append(tuple(j for n in padded for j in n))
        mine = padded[rank]
        for g in gs:
            local[g] = tuple(mine.index((rank * h + g * hg + i) // rep) for i in range(hg))
    return KVPlan(len(members), tuple(send), tuple(local))


def _select(x: Tensor, heads: tuple[int, ...]) -> Tensor:
    """``x[:, :, heads]`` along the head dim (``x`` itself when ``heads`` is all of them in
    order: no copy). Its gradient sums the copies of a head (autograd's ``index_select``)."""
    if heads == tuple(range(x.shape[2])):
        return x
    return x.index_select(2, torch.tensor(heads, device=x.device))


class GroupedKV(Strategy):
    """The K/V side of grouped-query attention: ``k``, ``v`` of the rank's tokens, sent as one
    ``[k | v]`` all-to-all per :func:`kv_plan` exchange; the query projection and the gate."""

    def project_q(self, x: Tensor, rope: Rope | None) -> Tensor:
        q, self.gate = project_q(self.pl.module, self.pl.dims, x, rope)
        return q

    def project(self, x: Tensor, rope: Rope | None) -> None:
        pl, c = self.pl, self.pl.dims
        self.plan = kv_plan(c.num_heads, c.num_kv_heads, pl.group.size, pl.groups, pl.rank)
        (xk,) = mark("kv_proj", True, x)
        k, v = project_kv(pl.module, c, xk, rope)
        kv = torch.cat([k, v], dim=-1)  # [B, S/P, Hkv, 2d]: one exchange carries both
        (kv,) = mark("kv_proj", False, kv)
        self.buffers = [_select(kv, heads) for heads in self.plan.send]
        self.sent: list[Any] = []
        self.received: dict[int, Tensor] = {}

    def exchange(self, g: int) -> None:
        if g >= self.plan.exchanges:
            return  # one exchange for every group: started with group 0
        pl = self.pl
        name = "a2a:kv" if self.plan.exchanges == 1 else f"a2a:kv{g}"
        ex = Exchange("s2h", pl.group, 1, 2, name, BLOCK_OWNER)
        self.sent.append(pl.send(self.buffers[g], ex))

    def expand(self, g: int) -> tuple[Tensor, Tensor]:
        e = self.plan.exchange_of(g)
        if e not in self.received:
            self.received[e] = self.pl.receive(self.sent[e])  # [B, S, m_e, 2d]
        kv = _select(self.received[e], self.plan.local[g])  # [B, S, hg, 2d]
        k, v = kv.chunk(2, dim=-1)
        return k, v


# ---- the module families ------------------------------------------------------------------
class GQAFamily(AttentionFamily):
    """A Hugging Face grouped-query attention class: ``forward(hidden_states,
    position_embeddings, attention_mask, past_key_values=None, **kwargs) -> (output, None)``,
    RoPE from the caller's ``(cos, sin)`` (rotate-half), scale ``module.scaling``."""

    rope_source = "caller"
    what = "attention"

    def __init__(self, class_name: str, *, gated: bool, qk_norm: bool, partial: bool) -> None:
        self.class_name, self.gated = class_name, gated
        self.qk_norm, self.partial = qk_norm, partial

    def matches(self, module: Any) -> bool:
        names: tuple[str, ...] = (
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "config",
            "head_dim",
            "scaling",
        )
        names += ("q_norm", "k_norm") if self.qk_norm else ()
        return self.has_class(module) and all(hasattr(module, a) for a in names)

    def dims(self, module: Any) -> GQAConfig:
        cfg, d = module.config, int(module.head_dim)
        rotary = d
        if self.partial:  # Hugging Face: int(head_dim · partial_rotary_factor)
            params = getattr(cfg, "rope_parameters", None) or {}
            factor = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
            rotary = int(d * float(factor if factor is not None else 1.0))
        return GQAConfig(
            hidden_size=int(cfg.hidden_size),
            num_heads=int(cfg.num_attention_heads),
            num_kv_heads=int(cfg.num_key_value_heads),
            head_dim=d,
            rotary_dim=rotary,
            gated=self.gated,
            qk_norm=self.qk_norm,
        )

    def rope_width(self, dims: Any) -> int:
        return int(dims.rotary_dim)

    def rope(self, module: Any, call: MLACall, offset: int, dims: Any) -> Rope | None:
        cos, sin = call.position_embeddings
        return Rope(cos, sin, False)

    def forward(self, run: Run) -> Callable[..., Any]:
        return caller_rope_forward(run)


ATTENTION_FAMILIES: tuple[GQAFamily, ...] = (
    GQAFamily("Qwen3NextAttention", gated=True, qk_norm=True, partial=True),
    GQAFamily("Qwen3Attention", gated=False, qk_norm=True, partial=False),
    GQAFamily("LlamaAttention", gated=False, qk_norm=False, partial=False),
)
# the class names parallelize_attention recognises (the one table)
SUPPORTED_ATTENTION_CLASSES: tuple[str, ...] = tuple(f.class_name for f in ATTENTION_FAMILIES)


def find_attention_family(module: Any) -> GQAFamily:
    """The adapter of ``module``; ``TypeError`` listing the supported classes otherwise."""
    for family in ATTENTION_FAMILIES:
        if family.matches(module):
            return family
    raise TypeError(
        f"parallelize_attention supports {', '.join(SUPPORTED_ATTENTION_CLASSES)} (or "
        f"subclasses with the same attributes); got {type(module).__name__}"
    )
