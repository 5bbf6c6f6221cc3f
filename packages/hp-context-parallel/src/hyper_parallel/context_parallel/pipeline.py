"""The context-parallel attention pipeline: one schedule for G ≥ 1 head groups and every
strategy — MLA's ``expanded`` and ``latent``, and grouped-query attention's K/V side
(:class:`~hyper_parallel.context_parallel.gqa.GroupedKV`, one a2a of ``[K | V]`` carrying each
rank the key/value heads its query heads use). The query projection and the output gate (if
any) are the strategy's too (``project_q``, ``gate``); the rest is written once here.

Notation as in :mod:`~hyper_parallel.context_parallel.head_groups`: P ranks, ``h = H/P`` heads
per rank after the sequence→head exchange, G groups of ``hg = h/G`` heads. With G = 1 there is
one exchange per tensor (named ``a2a:q``, ``attention`` ...); with G > 1 each exchange that
carries heads is issued per group (``a2a:q0``, ``attention.g0`` ...). The K/V side is the
strategy's (:mod:`~hyper_parallel.context_parallel.strategies`: ``project``, ``exchange``,
``expand``); the rest is written once here.

Forward (``overlap=True``): the strategy's projection; its group-0 exchanges (expanded: a2a
K0, V0; latent: the all-gather of the latent); the Q projection (those in flight); a2a Q0; for
each later group g, its K/V-side exchanges and a2a Q_g; then for each group in order: its keys
and values (expanded: wait K_g, V_g; latent, at group 0: wait the gather fused with the
expansion of all h heads, Q exchanges in flight), wait Q_g, attention, launch a2a O_g (in
flight under group g+1's attention); ``o_proj`` waits every O_g
(:class:`~hyper_parallel.context_parallel.fused.WaitLinearGroups`).

Backward (autograd runs the groups last to first): ``o_proj``'s input-gradient matmul, every
a2a dO_g started (last group first), its weight-gradient matmul with them in flight; per group
from the last: attention backward, then its dQ_g (expanded: and dK_g, dV_g) exchanges started,
in flight under the attention backward of the groups before it; latent: the expansion's
input-gradient matmul, the reduce-scatter of the latent's gradient started, the expansion's
weight-gradient matmul (dQ and the reduce-scatter in flight); the Q projection backward
(expanded: dK, dV in flight; latent: the reduce-scatter); the K/V side's projection backward.

``overlap=False`` (G = 1 only, checked by ``parallelize_mla``): the same steps in the same
order, each collective blocking where it is launched above, and ``o_proj`` the module's own.

Packed documents whose sequence context the ranks have not compared yet (a table given to this
layer alone, or a caller's unchecked context): the first exchange (expanded: a2a K; latent: the
all-gather of the latent) carries the table's fingerprint in one extra row
(hp-dtensor's ``SequenceContext.fingerprinted``: result and gradients bit for bit the same);
once every forward collective is waited, the ranks compare what it brought and all raise the
same ``SequenceMismatchError`` if the tables differ (one device-to-host read of the
fingerprints, once per context; a context that is checked costs nothing).
Each overlapped collective is a pair of autograd nodes (launch, wait); autograd's ready queue
runs the later-created independent nodes between them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from hyper_parallel.context_parallel.admission import Admission
from hyper_parallel.context_parallel.attention import attend
from hyper_parallel.context_parallel.exchange import (
    Exchange,
    ExchangeKind,
    blocking,
    launch,
    wait,
)
from hyper_parallel.context_parallel.fused import WaitLinearGroups, mark
from hyper_parallel.context_parallel.head_groups import merge_heads, split_heads
from hyper_parallel.context_parallel.mla import Rope
from hyper_parallel.context_parallel.strategies import STRATEGY_CLASSES, Strategy
from hyper_parallel.context_parallel.transport import BLOCK_OWNER, Group
from hyper_parallel.dtensor import SequenceContext
from hyper_parallel.dtensor.fingerprint import FingerprintedExchange

__all__ = ["Pipeline", "Sent", "run_pipeline"]


@dataclass(frozen=True)
class Sent:
    """An exchange the pipeline started: overlapped, ``token`` (the launch node's) is waited
    by :meth:`Pipeline.receive`; blocking, ``result`` is already there."""

    ex: Exchange
    token: Tensor | None = None
    result: Tensor | None = None


@dataclass(frozen=True)
class Pipeline:
    """One forward's setting: the module, its sizes, the CP group, G and ``overlap``; the
    helpers every strategy shares (exchange names, group splits, send / receive)."""

    module: Any
    dims: Any  # the family's sizes: MLAConfig, or gqa.GQAConfig (num_heads read here)
    group: Group
    groups: int
    overlap: bool
    check: SequenceContext | None = None  # an unchecked context: its fingerprint rides along
    what: str = "MLA"  # the family's name in error messages
    _folded: list[FingerprintedExchange] = field(default_factory=list)

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def heads(self) -> int:
        """``h``: the heads of this rank after the sequence→head exchange."""
        return self.dims.num_heads // self.group.size

    def label(self, name: str, g: int) -> str:
        """A compute span's name: ``name`` with one group, ``name.g{g}`` with several."""
        return name if self.groups == 1 else f"{name}.g{g}"

    def a2a(self, name: str, g: int, kind: ExchangeKind = "s2h") -> Exchange:
        """Group ``g``'s all-to-all of ``[B, S(/P), H(/P), d]`` (seq dim 1, head dim 2),
        named ``a2a:{name}`` with one group, ``a2a:{name}{g}`` with several."""
        label = name if self.groups == 1 else f"{name}{g}"
        return Exchange(kind, self.group, 1, 2, f"a2a:{label}", BLOCK_OWNER)

    def split_heads(self, x: Tensor) -> tuple[Tensor, ...]:
        """``[B, S/P, H, d]`` -> G tensors ``[B, S/P, P·hg, d]``, one sequence→head exchange
        each (:func:`~hyper_parallel.context_parallel.head_groups.split_heads`; G = 1: ``x``)."""
        return (x,) if self.groups == 1 else split_heads(x, self.group.size, self.groups)

    def split_local(self, x: Tensor) -> tuple[Tensor, ...]:
        """This rank's heads ``[B, S, h, d]`` -> G tensors ``[B, S, hg, d]`` (G = 1: ``x``)."""
        return (x,) if self.groups == 1 else x.chunk(self.groups, dim=2)

    def send(self, x: Tensor, ex: Exchange) -> Sent:
        """Start ``ex`` on ``x``: launched (``overlap``) or run at once (blocking). The first
        exchange of a pipeline with an unchecked context carries its fingerprint."""
        if self.check is not None and not self._folded and FingerprintedExchange.fits(x):
            self._folded.append(self.check.fingerprinted(ex, dim=1))
            ex = self._folded[0]  # type: ignore[assignment]  # the same four methods
        if self.overlap:
            return Sent(ex, token=launch(x, ex))
        return Sent(ex, result=blocking(x, ex))

    def receive(self, sent: Sent) -> Tensor:
        """The result of an exchange :meth:`send` started (overlapped: its wait node)."""
        if sent.token is not None:
            return wait(sent.token, sent.ex)
        assert sent.result is not None
        return sent.result

    def compare(self, device: Any) -> None:
        """After every forward collective: the ranks compare the context's fingerprint, from
        what the first exchange brought (or, if it could not carry it, by one all-gather);
        ``SequenceMismatchError`` on every rank if the tables differ."""
        if self.check is None:
            return
        what = f"context-parallel {self.what} forward"
        if self._folded:
            self.check.check(self._folded[0].received(), what)
        else:
            self.check.verify(device, what)


def run_pipeline(
    pl: Pipeline,
    strategy: str | type[Strategy],
    x: Tensor,
    rope: Rope | None,
    scale: float,
    adm: Admission,
) -> Tensor:
    """``x [B, S/P, D]`` (this rank's tokens) -> its rows of the serial output ``[B, S/P, D]``
    (see the module docstring for the schedule). ``strategy``: an MLA strategy's name
    (``STRATEGY_CLASSES``) or a :class:`~hyper_parallel.context_parallel.strategies.Strategy`
    subclass (grouped-query attention: ``gqa.GroupedKV``)."""
    kv = (STRATEGY_CLASSES[strategy] if isinstance(strategy, str) else strategy)(pl)
    kv.project(x, rope)
    kv.exchange(0)  # in flight under the Q projection
    (xq,) = mark("q_proj", True, x)
    q = kv.project_q(xq, rope)  # sets kv.gate when the block has an output gate
    (q,) = mark("q_proj", False, q)
    qs = pl.split_heads(q)
    sent_q = [pl.send(qs[0], pl.a2a("q", 0))]
    for g in range(1, pl.groups):  # group g's exchanges arrive while the groups before attend
        kv.exchange(g)
        sent_q.append(pl.send(qs[g], pl.a2a("q", g)))
    sent_o = []
    for g in range(pl.groups):
        k_h, v_h = kv.expand(g)
        q_h = pl.receive(sent_q[g])
        name = pl.label("attention", g)
        q_h, k_h, v_h = mark(name, True, q_h, k_h, v_h)
        # causal, or document-causal from the global table; sdpa or the NPU's fused attention
        o_h = attend(q_h, k_h, v_h, scale, adm.documents, offsets=adm.offsets)
        (o_h,) = mark(name, False, o_h)
        sent_o.append(pl.send(o_h, pl.a2a("o", g, "h2s")))
    y = _o_proj(pl, sent_o, kv.gate)
    pl.compare(x.device)  # every forward collective waited: an unchecked table compared
    return y


def _o_proj(pl: Pipeline, sent: list[Sent], gate: Tensor | None) -> Tensor:
    """``o_proj`` on every group's output, heads back in order (times ``sigmoid(gate)`` when
    the block has an output gate)."""
    o_proj = pl.module.o_proj
    if pl.overlap:  # one node waits every group's exchange, then runs o_proj once
        tokens = [s.token for s in sent]
        exs = tuple(s.ex for s in sent)
        return WaitLinearGroups.apply(o_proj.weight, o_proj.bias, gate, exs, pl.group.size, *tokens)
    parts = [pl.receive(s) for s in sent]
    o = parts[0] if len(parts) == 1 else merge_heads(parts, pl.group.size)
    (o,) = mark("o_proj", True, o)
    o = o.flatten(2)
    if gate is not None:
        o = o * torch.sigmoid(gate)
    y = o_proj(o)
    (y,) = mark("o_proj", False, y)
    return y
