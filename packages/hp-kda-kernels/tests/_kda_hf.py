"""Stock Hugging Face Kimi-Linear KDA layers for the tests: tiny random configs built in code,
imported on their PyTorch path (see ``hyper_parallel.kda.testing``), float64."""

from __future__ import annotations

import math
from typing import Any

import torch

from hyper_parallel.kda.testing import import_torch_path

MODELING = "transformers.models.kimi_linear.modeling_kimi_linear"


def kimi() -> Any:
    """transformers' Kimi-Linear modeling module with every function on its PyTorch path."""
    return import_torch_path(MODELING)


def tiny_config(
    hidden: int = 32, heads: int = 3, head_dim: int = 16, conv: int = 4, **kw: Any
) -> Any:
    from transformers import KimiLinearConfig

    kw.setdefault("num_hidden_layers", 1)
    return KimiLinearConfig(
        vocab_size=64, hidden_size=hidden, intermediate_size=48, num_attention_heads=2,
        num_key_value_heads=2, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=8,
        v_head_dim=8, linear_attn_config={"head_dim": head_dim, "num_heads": heads,
                                          "short_conv_kernel_size": conv},
        pad_token_id=0, bos_token_id=1, eos_token_id=2, **kw,
    )  # fmt: skip


def init_kda_weights(layer: torch.nn.Module, seed: int) -> None:
    """Deterministic random weights (the bare layer leaves A_log and dt_bias uninitialised):
    gates that decay slowly, so the state carries across the ranks' blocks."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(layer.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if name.endswith("A_log"):
                value = torch.log(1.0 + noise.abs())
            elif name.endswith("dt_bias"):
                value = noise * 0.5 - 3.0
            elif name.endswith("o_norm.weight"):
                value = 1.0 + 0.1 * noise
            elif name.startswith("conv1d"):
                value = noise * 0.5
            else:
                value = noise / math.sqrt(p.shape[-1])
            p.copy_(value.to(p.dtype))


def kda_layer(seed: int = 0, **config: Any) -> torch.nn.Module:
    """A float64 stock ``KimiLinearDeltaAttention`` (layer 0 of a tiny config)."""
    layer = kimi().KimiLinearDeltaAttention(tiny_config(**config), layer_idx=0).double()
    init_kda_weights(layer, seed)
    return layer
