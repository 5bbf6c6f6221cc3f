"""One pipeline stage of a stock model: the stock model with only its own decoder layers, and
the module torch's ``PipelineStage`` runs.

:func:`stage_model` keeps the stock ``*ForCausalLM`` structure (so ``parallelize_model``, the
state-dict keys and the hub names stay the stock ones) and moves the stage's own modules into
it without copying a parameter: the decoder layers of the stage, the embeddings on the first
stage, the final norm and the LM head on the last. Every other layer becomes an
:class:`~hyper_parallel.models.absent.AbsentLayer` (it passes the hidden states through), the
embeddings ``None``, and the norm and the LM head of an earlier stage identities, so the stock
forward of an earlier stage returns the last layer's hidden states as its ``logits``.

:class:`StageModule` is what a ``PipelineStage`` calls: ``forward(x, mb)`` with ``x`` the
stage's input (token ids ``[b, S]`` on the first stage, hidden states ``[b, S, H]`` elsewhere;
``b`` rows of one micro-batch, ``S = T/(cp·tp)`` tokens of this rank's block) and ``mb`` the
micro-batch's index (``[1]``); the rest of the micro-batch (positions, targets, the document
table) it reads from the step's :class:`Feed`. It returns the hidden states ``[b, S, H]``, or on
the last stage the micro-batch's share of the global loss ``[1]``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from hyper_parallel.models.absent import AbsentLayer
from hyper_parallel.models.pipeline.split import decoder_layers

__all__ = ["Feed", "StageModule", "stage_model"]


def stage_model(
    model: nn.Module, base: nn.Module, layers: range, owner: list[int], first: bool, last: bool
) -> nn.Module:
    """The stage holding decoder ``layers`` of the stock causal LM ``model`` (``base`` its
    ``.model``): its own modules moved (shared, not copied), the rest replaced (see the module
    docstring). ``owner[i]``: the stage holding layer ``i``. Small modules without parameters
    (the rotary embedding) are copied; the config object is shared."""
    memo: dict[int, Any] = {}
    for i, layer in enumerate(decoder_layers(base)):
        memo[id(layer)] = layer if i in layers else AbsentLayer(i, owner[i])
    embed = base.get_submodule("embed_tokens")
    memo[id(embed)] = embed if first else None
    memo[id(base.get_submodule("norm"))] = base.get_submodule("norm") if last else nn.Identity()
    head = model.get_submodule("lm_head")
    memo[id(head)] = head if last else nn.Identity()
    for m in (model, base):
        config = getattr(m, "config", None)
        if config is not None:
            memo[id(config)] = config
    # anything else holding parameters would be duplicated into every stage
    moved = {id(p) for layer in decoder_layers(base) for p in layer.parameters()}
    moved |= {id(p) for p in embed.parameters()} | {id(p) for p in head.parameters()}
    moved |= {id(p) for p in base.get_submodule("norm").parameters()}
    stray = [n for n, p in model.named_parameters() if id(p) not in moved]
    if stray:
        raise ValueError(
            f"pipeline_model: parameters outside the decoder layers, embeddings, final norm and "
            f"LM head ({stray[:4]}) have no stage to go to"
        )
    return copy.deepcopy(model, memo)


@dataclass
class Feed:
    """One step's micro-batches as this rank's stages read them: ``micro[k]`` is micro-batch
    ``k``'s block from ``shard_batch`` (``position_ids``, ``shift_labels``, ``cu_seqlens``) and
    ``count`` the number of targets of the whole global batch (every micro-batch, every
    rank)."""

    micro: list[dict[str, Tensor]] = field(default_factory=list)
    count: int = 0


class StageModule(nn.Module):
    """The module a ``PipelineStage`` runs for stage ``index`` (see the module docstring):
    ``part`` is the stage's parallelised causal LM."""

    def __init__(self, part: nn.Module, index: int, first: bool, last: bool, feed: Feed) -> None:
        super().__init__()
        self.part = part
        self.index = index
        self.first = first
        self.last = last
        self._feed = feed

    def forward(self, x: Tensor, mb: Tensor) -> Tensor:
        local = self._feed.micro[int(mb.reshape(-1)[0])]
        kw: dict[str, Any] = {"position_ids": local["position_ids"]}
        if "cu_seqlens" in local:
            kw["cu_seqlens"] = local["cu_seqlens"]
        kw["input_ids" if self.first else "inputs_embeds"] = x
        if not self.last:
            return self.part(**kw).logits  # the identity head: the last layer's hidden states
        kw["labels"] = kw["shift_labels"] = local["shift_labels"]
        kw["num_items_in_batch"] = self._feed.count
        return self.part(**kw).loss.reshape(1)

    def extra_repr(self) -> str:
        return (
            f"stage {self.index}"
            + (" (first)" if self.first else "")
            + (" (last)" if self.last else "")
        )
