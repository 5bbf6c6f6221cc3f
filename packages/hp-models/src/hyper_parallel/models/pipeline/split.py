"""Which decoder layers each pipeline stage holds: a contiguous run per stage, balanced by
each layer's cost, or given.

A layer's cost is its **active parameters**: the parameters one token multiplies through (the
matmul FLOPs of a token are ``2·`` that, forward), with a routed MoE block's experts counted at
``top_k / E`` of their size (each token visits ``top_k`` of the ``E`` experts). Kimi-Linear's
KDA and MLA layers, DeepSeek-V3's dense and MoE layers and Qwen3-Next's Gated DeltaNet and
attention layers differ by it; attention's ``T²`` term, which depends on the sequence length,
is left out (at the stock sizes it is a few percent of a layer up to 32k tokens). The
embeddings ride with the first stage and the final norm, the LM head and the loss with the
last: the LM head counts toward the last stage's cost (``V·H`` active parameters a token);
the embedding lookup costs nothing.

The split is computed from the model (or a meta copy of it) alone: the same on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from torch import nn

__all__ = [
    "balanced_split",
    "check_layer_split",
    "decoder_layers",
    "layer_costs",
    "stage_ranges",
]


def decoder_layers(base: nn.Module) -> list[nn.Module]:
    """The decoder layers of a stock base model (its ``layers`` ModuleList), in order."""
    return list(cast(nn.ModuleList, base.get_submodule("layers")))


def _top_k_over_e(config: Any) -> float | None:
    top_k = getattr(config, "num_experts_per_tok", None) or getattr(
        config, "num_experts_per_token", None
    )
    experts = getattr(config, "n_routed_experts", None) or getattr(config, "num_experts", None)
    if not top_k or not experts:
        return None
    return float(top_k) / float(experts)


def layer_costs(model: nn.Module) -> tuple[list[float], float]:
    """``(per-layer costs, head cost)`` of a supported stock model (see the module docstring):
    active parameters of each decoder layer in order, and of the LM head (0 for a base model).
    Works on a meta model (shapes only)."""
    from hyper_parallel.models.families import family_of

    fam, base = family_of(model)
    config = getattr(base, "config", None)
    ratio = _top_k_over_e(config)
    scale = 1.0 if ratio is None else ratio
    costs: list[float] = []
    for i, layer in enumerate(decoder_layers(base)):
        routed: set[int] = set()
        for _, block in fam.layer_blocks(layer, i):
            if fam.role_of(block).routed and ratio is not None:
                experts = getattr(block, "experts", None)
                if isinstance(experts, nn.Module):
                    routed |= {id(p) for p in experts.parameters()}
        total = 0.0
        for p in layer.parameters():
            total += p.numel() * (scale if id(p) in routed else 1.0)
        costs.append(total)
    head = getattr(model, "lm_head", None) if model is not base else None
    head_cost = float(sum(p.numel() for p in head.parameters())) if head is not None else 0.0
    return costs, head_cost


def balanced_split(costs: Sequence[float], num_stages: int, last_extra: float = 0.0) -> list[int]:
    """Layers per stage (``num_stages`` contiguous runs, none empty) minimising the largest
    stage cost, the last stage also carrying ``last_extra`` (the LM head). Exact (dynamic
    programming over split points; ties go to the split with earlier stages longer, the first
    found in layer order). ``ValueError`` when there are fewer layers than stages."""
    n = len(costs)
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if n < num_stages:
        raise ValueError(
            f"{n} decoder layers cannot fill {num_stages} pipeline stages (each stage holds at "
            "least one layer): use fewer stages (pp · stages_per_rank) or a deeper model"
        )
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))

    def seg(a: int, b: int) -> float:  # layers [a, b)
        return prefix[b] - prefix[a] + (last_extra if b == n else 0.0)

    inf = float("inf")
    # best[s][j]: the smallest largest-stage cost of layers [0, j) in s stages
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for j in range(s, n - (num_stages - s) + 1):
            for i in range(j - 1, s - 2, -1):  # the last stage is [i, j); longest first
                if best[s - 1][i] == inf:
                    continue
                v = max(best[s - 1][i], seg(i, j))
                if v < best[s][j] - 1e-9 * max(1.0, abs(v)):
                    best[s][j], cut[s][j] = v, i
    sizes: list[int] = []
    j = n
    for s in range(num_stages, 0, -1):
        i = cut[s][j]
        sizes.append(j - i)
        j = i
    return sizes[::-1]


def check_layer_split(layer_split: Any, num_layers: int, num_stages: int) -> list[int]:
    """``layer_split`` as a list of ints: one positive count per stage, adding up to the
    layers; ``ValueError`` (``TypeError`` for a non-sequence) naming what is wrong otherwise."""
    if isinstance(layer_split, (str, bytes)) or not isinstance(layer_split, Sequence):
        raise TypeError(
            f"layer_split must be a sequence of layer counts (one a stage), got {layer_split!r}"
        )
    sizes = list(layer_split)
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in sizes):
        raise TypeError(f"layer_split must hold ints (layers a stage), got {sizes!r}")
    if len(sizes) != num_stages:
        raise ValueError(
            f"layer_split has {len(sizes)} entries but the pipeline has {num_stages} stages "
            "(pp · stages_per_rank): give one layer count a stage"
        )
    if any(s < 1 for s in sizes):
        raise ValueError(f"layer_split {sizes} leaves a stage empty: every stage needs a layer")
    if sum(sizes) != num_layers:
        raise ValueError(
            f"layer_split {sizes} adds up to {sum(sizes)} layers; the model has {num_layers}"
        )
    return sizes


def stage_ranges(sizes: Sequence[int]) -> list[range]:
    """The decoder-layer indices of each stage, from layers per stage."""
    out: list[range] = []
    start = 0
    for s in sizes:
        out.append(range(start, start + s))
        start += s
    return out
