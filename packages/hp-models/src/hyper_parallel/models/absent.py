"""A decoder layer that another pipeline stage holds.

A pipeline stage keeps the stock model's structure with the layers it does not hold replaced
by :class:`AbsentLayer`, so every layer keeps its index (``model.layers.7`` stays layer 7:
each family's per-layer choices, state-dict keys and hub names hold) and the stock forward,
which loops over every layer, passes the hidden states through the absent ones unchanged.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

__all__ = ["AbsentLayer", "is_absent"]


class AbsentLayer(nn.Module):
    """Stands for decoder layer ``index`` held by pipeline stage ``stage``: no parameters;
    its forward returns ``hidden_states`` ``[B, S, H]`` as it came."""

    def __init__(self, index: int, stage: int) -> None:
        super().__init__()
        self.index = index
        self.stage = stage

    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return hidden_states

    def extra_repr(self) -> str:
        return f"layer {self.index}, held by pipeline stage {self.stage}"


def is_absent(module: nn.Module) -> bool:
    """Whether ``module`` stands for a layer another stage holds."""
    return isinstance(module, AbsentLayer)
