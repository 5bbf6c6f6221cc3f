"""Kimi-Linear (``KimiLinearForCausalLM``): KDA and MLA token mixers, all under ``self_attn``;
dense MLPs and MoE blocks with ungated shared experts; the hub's ``block_sparse_moe`` experts
``w1``/``w3``/``w2`` and separate q/k/v convolutions."""

from __future__ import annotations

from hyper_parallel.models.families import ModelFamily
from hyper_parallel.models.hub import Fused, HubLayout
from hyper_parallel.models.roles import DENSE_MLP, KDA, MLA, MOE

__all__ = ["KIMI_LINEAR"]

KIMI_LINEAR = ModelFamily(
    name="kimi-linear",
    causal_lm="KimiLinearForCausalLM",
    base="KimiLinearModel",
    blocks=(
        (("KimiLinearAttention",), MLA),
        (("KimiLinearDeltaAttention",), KDA),
        (("KimiLinearMLP",), DENSE_MLP),
        (("KimiLinearMoE",), MOE),
    ),
    model_type="kimi_linear",
    layer_types=("full_attention", "linear_attention"),
    hub=HubLayout(
        renames=(
            (r"\.mlp\.", ".block_sparse_moe."),
            (r"\.self_attn\.forget_gate\.", ".self_attn."),
        ),
        fused=(
            Fused("conv1d.weight", ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")),
            Fused(
                "experts.gate_up_proj",
                ("experts.{e}.w1.weight", "experts.{e}.w3.weight"),
                per_expert=True,
            ),
            Fused("experts.down_proj", ("experts.{e}.w2.weight",), per_expert=True),
        ),
    ),
)
