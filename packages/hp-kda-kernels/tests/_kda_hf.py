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


# Gated DeltaNet (Qwen3-Next; Qwen3.5 has the same math with split projections)
QWEN3_NEXT = "transformers.models.qwen3_next.modeling_qwen3_next"
QWEN3_5 = "transformers.models.qwen3_5.modeling_qwen3_5"


def gdn_config(
    kind: str = "next", hidden: int = 32, k_heads: int = 2, v_heads: int = 4, conv: int = 4
) -> Any:
    """A tiny Qwen3-Next (``kind="next"``) or Qwen3.5 text config with one linear layer:
    grouped value heads (``v_heads`` a multiple of ``k_heads``), head dims 8."""
    from transformers import Qwen3_5TextConfig, Qwen3NextConfig

    cls = Qwen3NextConfig if kind == "next" else Qwen3_5TextConfig
    return cls(
        vocab_size=64, hidden_size=hidden, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        linear_num_key_heads=k_heads, linear_num_value_heads=v_heads, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=conv, layer_types=["linear_attention"],
    )  # fmt: skip


def gdn_layer(kind: str = "next", seed: int = 0, **config: Any) -> torch.nn.Module:
    """A float64 stock ``Qwen3NextGatedDeltaNet`` (``kind="next"``) or ``Qwen3_5GatedDeltaNet``
    (``"3.5"``) on its PyTorch path, deterministic weights (slow decay: the state carries
    across blocks)."""
    module = import_torch_path(QWEN3_NEXT if kind == "next" else QWEN3_5)
    cls = module.Qwen3NextGatedDeltaNet if kind == "next" else module.Qwen3_5GatedDeltaNet
    layer = cls(gdn_config(kind, **config), layer_idx=0).double()
    init_kda_weights(layer, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        layer.norm.weight.copy_(1.0 + 0.1 * torch.randn(layer.norm.weight.shape, generator=gen))
    return layer
