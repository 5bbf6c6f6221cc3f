"""Tiny random stock Hugging Face models built in code (no downloads), for tests, examples and
benchmarks: ``tiny_model("kimi" | "deepseek" | "qwen3-next", seed, dtype, **config overrides)`` and
``random_batch``.

transformers routes Kimi-Linear's KDA (``chunk_kda``) and short convolution to
flash-linear-attention / causal-conv1d kernels whenever those packages are importable, and
those kernels need a GPU. On a CPU machine, use an environment without ``fla`` (hp-models does
not depend on it): :func:`import_transformers` raises when ``fla`` is importable on a machine
without CUDA, rather than letting a serial reference fail deep inside a Triton kernel.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

__all__ = [
    "DEEPSEEK_DEFAULTS",
    "KIMI_DEFAULTS",
    "QWEN3_NEXT_DEFAULTS",
    "deepseek_config",
    "import_transformers",
    "kimi_config",
    "qwen3_next_config",
    "random_batch",
    "tiny_model",
]


def import_transformers() -> Any:
    """``transformers``, after checking that Kimi-Linear's kernels can run here."""
    if importlib.util.find_spec("fla") is not None and not torch.cuda.is_available():
        raise RuntimeError(
            "flash-linear-attention (fla) is importable here: transformers would route "
            "Kimi-Linear's KDA to fla's GPU kernels; run these tests in an environment without fla"
        )
    import transformers

    return transformers


_COMMON: dict[str, Any] = {
    "vocab_size": 48,
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 8,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    "n_shared_experts": 1,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "use_cache": False,
}

KIMI_DEFAULTS: dict[str, Any] = {
    **_COMMON,
    "num_hidden_layers": 4,
    "q_lora_rank": None,
    "num_experts": 4,
    "num_experts_per_token": 2,
    "linear_num_heads": 2,
    "linear_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "mlp_layer_types": ["dense", "dense", "dense", "sparse"],
}
"""A 4-layer Kimi-Linear: KDA, MLA, KDA, MLA; dense MLPs and one MoE block last."""

DEEPSEEK_DEFAULTS: dict[str, Any] = {
    **_COMMON,
    "num_hidden_layers": 3,
    "q_lora_rank": 12,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 2,
    "rope_interleave": True,
}
"""A 3-layer DeepSeek-V3 with q LoRA: two dense MLP layers, then one MoE layer."""


QWEN3_NEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 48,
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 24,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "partial_rotary_factor": 0.5,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [0],
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "use_cache": False,
}
"""A 4-layer Qwen3-Next: Gated DeltaNet (2 key heads, 4 value heads), gated attention (4 query
heads, 2 key/value heads), Gated DeltaNet, gated attention; a dense MLP first, then MoE blocks
with the gated shared expert."""


def kimi_config(**overrides: Any) -> Any:
    """``KimiLinearConfig`` from :data:`KIMI_DEFAULTS` updated with ``overrides``."""
    cfg = import_transformers().KimiLinearConfig(**{**KIMI_DEFAULTS, **overrides})
    cfg._experts_implementation = "eager"  # grouped_mm has no float64 on CPU
    return cfg


def deepseek_config(**overrides: Any) -> Any:
    """``DeepseekV3Config`` from :data:`DEEPSEEK_DEFAULTS` updated with ``overrides``."""
    cfg = import_transformers().DeepseekV3Config(**{**DEEPSEEK_DEFAULTS, **overrides})
    cfg._experts_implementation = "eager"
    return cfg


def qwen3_next_config(**overrides: Any) -> Any:
    """``Qwen3NextConfig`` from :data:`QWEN3_NEXT_DEFAULTS` updated with ``overrides``."""
    cfg = import_transformers().Qwen3NextConfig(**{**QWEN3_NEXT_DEFAULTS, **overrides})
    cfg._experts_implementation = "eager"
    return cfg


def tiny_model(
    kind: str, seed: int = 0, dtype: torch.dtype = torch.float64, **overrides: Any
) -> Any:
    """A stock ``KimiLinearForCausalLM`` (``kind="kimi"``), ``DeepseekV3ForCausalLM``
    (``"deepseek"``) or ``Qwen3NextForCausalLM`` (``"qwen3-next"``) with seeded random weights
    (the same on every rank for the same seed); norm weights are perturbed so that every
    parameter shapes the output."""
    tf = import_transformers()
    torch.manual_seed(seed)
    if kind == "kimi":
        model = tf.KimiLinearForCausalLM(kimi_config(**overrides))
    elif kind == "deepseek":
        model = tf.DeepseekV3ForCausalLM(deepseek_config(**overrides))
    elif kind == "qwen3-next":
        model = tf.Qwen3NextForCausalLM(qwen3_next_config(**overrides))
    else:
        raise ValueError(f"kind must be 'kimi', 'deepseek' or 'qwen3-next', got {kind!r}")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.to(dtype)


def random_batch(
    vocab: int = 48, bsz: int = 2, seq: int = 16, seed: int = 1
) -> dict[str, torch.Tensor]:
    """``{"input_ids", "labels"}`` ``[bsz, seq]``, the same on every rank for the same seed."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (bsz, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}
