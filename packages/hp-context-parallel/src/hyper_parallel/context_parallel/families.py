"""Attention module families: one small adapter per family feeding the one context-parallel
schedule. :class:`AttentionFamily` is the interface admission and the pipeline read; the MLA
families are below, the grouped-query ones (``LlamaAttention``, ``Qwen3Attention``,
``Qwen3NextAttention``) in :mod:`~hyper_parallel.context_parallel.gqa`.

An adapter says, for one family of attention modules, how to recognise it (class name in its
MRO plus the DeepSeek attribute names, so ``transformers`` is never imported), its sizes (an
:class:`~hyper_parallel.context_parallel.mla.MLAConfig`), its softmax scale, where its RoPE
comes from and in which layout, and its forward signature. The projections themselves are the
shared functions of :mod:`hyper_parallel.context_parallel.mla` (every family uses the same
attribute names).

- ``MultiHeadLatentAttention`` (this package): ``forward(hidden_states) -> Tensor``; RoPE
  rotate-half at global positions (computed here); scale ``config.softmax_scale``.
- ``DeepseekV3Attention``: ``forward(hidden_states, position_embeddings, attention_mask,
  past_key_values=None, **kwargs) -> (output, None)``; RoPE from the caller's ``(cos, sin)``,
  layout ``config.rope_interleave``; scale ``module.scaling`` (yarn mscale included).
- ``KimiLinearAttention``: ``forward(hidden_states, attention_mask, past_key_values=None,
  **kwargs) -> (output, None)``; no RoPE (NoPE); scale ``module.scaling``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from hyper_parallel.context_parallel.mla import MLAConfig, MultiHeadLatentAttention, Rope

__all__ = [
    "FAMILIES",
    "AttentionFamily",
    "SUPPORTED_MLA_CLASSES",
    "MLACall",
    "caller_rope_forward",
    "MLAFamily",
    "find_family",
    "supported_classes",
]

_PROJECTIONS = ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")
_HF_SIZES = (
    "hidden_size",
    "num_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "scaling",
    "config",
)


@dataclass
class MLACall:
    """One call of a rewritten forward, in the family's own argument names."""

    hidden_states: Any
    attention_mask: Any = None
    past_key_values: Any = None
    position_embeddings: Any = None
    kwargs: dict[str, Any] = field(default_factory=dict)


Run = Callable[[nn.Module, MLACall], Tensor]  # the schedule: (module, call) -> [B, S/P, D]


class AttentionFamily:
    """Base adapter of every attention family the rewrites take (MLA here; grouped-query
    attention in :mod:`~hyper_parallel.context_parallel.gqa`). Subclasses set ``class_name``
    and implement the hooks; admission and the pipeline read only these."""

    class_name: str = ""
    rope_source: str = ""  # "positions" | "caller" | "none" (documentation and errors)
    what: str = "MLA"  # how errors name the forward ("context-parallel MLA forward")

    def has_class(self, module: Any) -> bool:
        return self.class_name in {c.__name__ for c in type(module).__mro__}

    def matches(self, module: Any) -> bool:
        raise NotImplementedError

    def dims(self, module: Any) -> Any:
        """The family's sizes (``num_heads`` and ``hidden_size`` at least)."""
        raise NotImplementedError

    def rope_width(self, dims: Any) -> int:
        """The last dim of the caller's ``(cos, sin)`` tables (``rope_source == "caller"``)."""
        raise NotImplementedError

    def scale(self, module: Any) -> float:
        return float(module.scaling)

    def rope(self, module: Any, call: MLACall, offset: int, dims: Any) -> Rope | None:
        """The RoPE of this rank's tokens (``offset``: the global position of its first)."""
        raise NotImplementedError

    def dropout(self, module: Any) -> float:
        """The attention dropout probability in effect (0 in eval mode)."""
        p = float(getattr(module, "attention_dropout", 0.0) or 0.0)
        return p if module.training else 0.0

    def forward(self, run: Run) -> Callable[..., Any]:
        """The rewritten class's ``forward``, with the family's signature."""
        raise NotImplementedError


def caller_rope_forward(run: Run) -> Callable[..., Any]:
    """The forward of the Hugging Face attention modules that take the caller's RoPE tables
    (``DeepseekV3Attention``, ``LlamaAttention``, ``Qwen3Attention``, ``Qwen3NextAttention``):
    ``forward(hidden_states, position_embeddings, attention_mask, past_key_values=None,
    **kwargs) -> (output, None)``."""

    def forward(
        self: nn.Module,
        hidden_states: Tensor,
        position_embeddings: tuple[Tensor, Tensor],
        attention_mask: Tensor | None,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> tuple[Tensor, None]:
        call = MLACall(hidden_states, attention_mask, past_key_values, position_embeddings, kwargs)
        return run(self, call), None

    return forward


class MLAFamily(AttentionFamily):
    """Base adapter of the MLA families."""

    def matches(self, module: Any) -> bool:
        return self.has_class(module) and all(hasattr(module, a) for a in _PROJECTIONS)

    def rope_width(self, dims: Any) -> int:
        return int(dims.qk_rope_head_dim)

    def dims(self, module: Any) -> MLAConfig:
        q_lora = module.q_lora_rank
        return MLAConfig(
            hidden_size=module.hidden_size,
            num_heads=module.num_heads,
            q_lora_rank=q_lora,
            kv_lora_rank=module.kv_lora_rank,
            qk_nope_head_dim=module.qk_nope_head_dim,
            qk_rope_head_dim=module.qk_rope_head_dim,
            v_head_dim=module.v_head_dim,
        )


class _OwnMLA(MLAFamily):
    class_name = "MultiHeadLatentAttention"
    rope_source = "positions"

    def matches(self, module: Any) -> bool:
        return isinstance(module, MultiHeadLatentAttention)

    def dims(self, module: Any) -> MLAConfig:
        return module.config

    def scale(self, module: Any) -> float:
        return module.config.softmax_scale

    def rope(self, module: Any, call: MLACall, offset: int, dims: MLAConfig) -> Rope | None:
        x = call.hidden_states
        return module.rope(torch.arange(offset, offset + x.shape[1], device=x.device), x.dtype)

    def forward(self, run: Run) -> Callable[..., Any]:
        def forward(self: nn.Module, hidden_states: Tensor) -> Tensor:
            return run(self, MLACall(hidden_states))

        return forward


class _DeepseekV3(MLAFamily):
    class_name = "DeepseekV3Attention"
    rope_source = "caller"

    def matches(self, module: Any) -> bool:
        return super().matches(module) and all(hasattr(module, a) for a in _HF_SIZES)

    def rope(self, module: Any, call: MLACall, offset: int, dims: MLAConfig) -> Rope | None:
        cos, sin = call.position_embeddings
        return Rope(cos, sin, bool(getattr(module.config, "rope_interleave", False)))

    def forward(self, run: Run) -> Callable[..., Any]:
        return caller_rope_forward(run)


class _KimiLinear(MLAFamily):
    class_name = "KimiLinearAttention"
    rope_source = "none"

    def matches(self, module: Any) -> bool:
        return super().matches(module) and all(hasattr(module, a) for a in _HF_SIZES)

    def rope(self, module: Any, call: MLACall, offset: int, dims: MLAConfig) -> Rope | None:
        return None  # NoPE: the "rope" part of q and of the shared key is used unrotated

    def forward(self, run: Run) -> Callable[..., Any]:
        def forward(
            self: nn.Module,
            hidden_states: Tensor,
            attention_mask: Tensor | None,
            past_key_values: Any = None,
            **kwargs: Any,
        ) -> tuple[Tensor, None]:
            return run(
                self, MLACall(hidden_states, attention_mask, past_key_values, None, kwargs)
            ), None

        return forward


FAMILIES: tuple[MLAFamily, ...] = (_OwnMLA(), _DeepseekV3(), _KimiLinear())
# the class names parallelize_mla recognises (the one table; hp-models reads it)
SUPPORTED_MLA_CLASSES: tuple[str, ...] = tuple(f.class_name for f in FAMILIES)


def supported_classes() -> list[str]:
    return list(SUPPORTED_MLA_CLASSES)


def find_family(module: Any) -> MLAFamily:
    """The adapter of ``module``; ``TypeError`` listing the supported classes otherwise."""
    for family in FAMILIES:
        if family.matches(module):
            return family
    raise TypeError(
        f"parallelize_mla supports {', '.join(supported_classes())} (or subclasses with the "
        f"same attributes); got {type(module).__name__}"
    )
