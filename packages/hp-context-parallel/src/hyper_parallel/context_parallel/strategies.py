"""The MLA exchange strategies: how the keys and values reach the heads after the exchange.

A strategy is a :class:`Strategy` subclass registered in :data:`STRATEGY_CLASSES`, the one
registry (``parallelize_mla(strategy=...)`` takes its keys, ``parallel_mla.STRATEGIES`` lists
them). The pipeline (:func:`~hyper_parallel.context_parallel.pipeline.run_pipeline`) makes one
instance per forward, for G ≥ 1 head groups, and calls in this order:

1. :meth:`~Strategy.project` on this rank's tokens ``x [B, S/P, D]``;
2. :meth:`~Strategy.exchange` for group 0 before the Q projection (so it is in flight under
   it), then for each later group g right before group g's Q exchange;
3. :meth:`~Strategy.expand` for each group in order, right before its Q is waited: group g's
   keys ``[B, S, hg, dq]`` and values ``[B, S, hg, dv]`` (every token, its ``hg = h/G`` heads).

Everything else — the Q projection and exchange, attention, the O exchange and ``o_proj`` —
is the pipeline's, the same for every strategy: a third strategy is one more subclass here and
one more registry entry.

- ``expanded`` (:class:`Expanded`): K and V expanded on this rank's tokens (``kv_b_proj``, all
  H heads), exchanged per group like Q (a2a K_g, V_g); backward: their gradients' a2a.
- ``latent`` (:class:`Latent`): one all-gather of ``[latent, k_rope]`` (dc + dr values per
  token, shared by every head, so one collective for all groups), then this rank's h heads
  expanded at once with its rows of ``kv_b_proj``; overlapped, the expansion is fused with the
  gather's wait (:class:`~hyper_parallel.context_parallel.fused.WaitExpand`): in backward its
  input-gradient matmul, then the reduce-scatter of the latent's gradient, then its
  weight-gradient matmul with the reduce-scatter in flight.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from torch import Tensor

from hyper_parallel.context_parallel.exchange import Exchange
from hyper_parallel.context_parallel.fused import WaitExpand, mark
from hyper_parallel.context_parallel.mla import (
    Rope,
    expand_kv,
    kv_heads,
    project_latent,
    project_q,
    split_kv,
)
from hyper_parallel.context_parallel.transport import BLOCK_OWNER

if TYPE_CHECKING:
    from hyper_parallel.context_parallel.pipeline import Pipeline, Sent

__all__ = ["STRATEGY_CLASSES", "Expanded", "Latent", "MLAStrategy", "Strategy"]


class Strategy(ABC):
    """One strategy for one forward of the pipeline ``pl`` (see the module docstring for the
    order of the calls). Subclasses keep what a forward needs between the calls on ``self``.

    Besides the K/V side, a strategy owns the block's query projection (:meth:`project_q`,
    called between ``exchange(0)`` and the Q exchanges) and its output gate: ``gate``, set by
    :meth:`project_q` when the block has one (``[B, S/P, H·dv]`` on this rank's tokens,
    ``o_proj`` then takes ``o · sigmoid(gate)``), else None."""

    gate: Tensor | None = None

    def __init__(self, pl: Pipeline) -> None:
        self.pl = pl

    @abstractmethod
    def project_q(self, x: Tensor, rope: Rope | None) -> Tensor:
        """The queries of this rank's tokens ``x [B, S/P, D]``: ``[B, S/P, H, dq]``, RoPE'd."""

    @abstractmethod
    def project(self, x: Tensor, rope: Rope | None) -> None:
        """The K/V side's projections of this rank's tokens ``x [B, S/P, D]``."""

    @abstractmethod
    def exchange(self, g: int) -> None:
        """Start group ``g``'s exchanges (``pl.send``): overlapped, they are waited in
        :meth:`expand`."""

    @abstractmethod
    def expand(self, g: int) -> tuple[Tensor, Tensor]:
        """Group ``g``'s keys ``[B, S, hg, dq]`` and values ``[B, S, hg, dv]``."""


class MLAStrategy(Strategy):
    """The MLA query: ``q_proj`` (or the q LoRA), RoPE on its last ``dr`` values; no gate."""

    def project_q(self, x: Tensor, rope: Rope | None) -> Tensor:
        return project_q(self.pl.module, self.pl.dims, x, rope)


class Expanded(MLAStrategy):
    """K and V on this rank's tokens, all heads, exchanged per group like Q."""

    def project(self, x: Tensor, rope: Rope | None) -> None:
        pl, c = self.pl, self.pl.dims
        (xk,) = mark("kv_proj", True, x)
        k, v = expand_kv(c, project_latent(pl.module, c, xk, rope), pl.module.kv_b_proj.weight)
        k, v = mark("kv_proj", False, k, v)
        self.k, self.v = pl.split_heads(k), pl.split_heads(v)
        self.sent: list[tuple[Sent, Sent]] = []

    def exchange(self, g: int) -> None:
        pl = self.pl
        k = pl.send(self.k[g], pl.a2a("k", g))
        v = pl.send(self.v[g], pl.a2a("v", g))
        self.sent.append((k, v))

    def expand(self, g: int) -> tuple[Tensor, Tensor]:
        k, v = self.sent[g]
        return self.pl.receive(k), self.pl.receive(v)


class Latent(MLAStrategy):
    """One all-gather of ``[latent, k_rope]``; this rank's heads expanded from it."""

    def project(self, x: Tensor, rope: Rope | None) -> None:
        pl = self.pl
        (xk,) = mark("kv_a_proj", True, x)
        latent = project_latent(pl.module, pl.dims, xk, rope)
        (self.latent,) = mark("kv_a_proj", False, latent)

    def exchange(self, g: int) -> None:
        if g == 0:  # shared by every head: one gather, started with the first group
            ex = Exchange("ag", self.pl.group, 1, -1, "all_gather:latent", BLOCK_OWNER)
            self.gather = self.pl.send(self.latent, ex)

    def expand(self, g: int) -> tuple[Tensor, Tensor]:
        if g == 0:  # every group's heads at once, when the gather is waited
            kv, self.k_rope = self._expand_rank_heads()
            self.kv = self.pl.split_local(kv)
        return split_kv(self.pl.dims, self.kv[g], self.k_rope)

    def _expand_rank_heads(self) -> tuple[Tensor, Tensor]:
        """Wait the gather; ``kv [B, S, h, dn + dv]`` of this rank's h heads (its rows of
        ``kv_b_proj``) and ``k_rope [B, S, dr]``."""
        pl, c, s = self.pl, self.pl.dims, self.gather
        width = c.qk_nope_head_dim + c.v_head_dim  # kv_b_proj rows per head
        rows = slice(pl.rank * pl.heads * width, (pl.rank + 1) * pl.heads * width)
        w = pl.module.kv_b_proj.weight
        if s.token is not None:  # overlapped: the wait fused with the expansion
            kv, k_rope = WaitExpand.apply(s.token, w, s.ex, rows, c.kv_lora_rank, width)
            return kv, k_rope
        (full,) = mark("kv_b_proj", True, pl.receive(s))
        latent, k_rope = full.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        kv, k_rope = mark("kv_b_proj", False, kv_heads(latent, w[rows], width), k_rope)
        return kv, k_rope


# the one registry: name -> strategy (parallelize_mla's ``strategy`` values, in this order)
STRATEGY_CLASSES: dict[str, type[Strategy]] = {"expanded": Expanded, "latent": Latent}
