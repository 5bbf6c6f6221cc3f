"""Qwen3-Next (``Qwen3NextForCausalLM``): Gated DeltaNet layers (``linear_attn``) and gated GQA
attention layers (``self_attn``), three to one by default; MoE blocks with a gated shared
expert (``shared_expert``, ``shared_expert_gate``), dense MLPs at ``mlp_only_layers``; the
model takes a ready ``{layer type: mask}`` mapping; per-expert hub tensors as DeepSeek-V3's
(the multi-token-prediction ``mtp.*`` tensors of the hub folder are not part of the model)."""

from __future__ import annotations

from hyper_parallel.models.families import ModelFamily
from hyper_parallel.models.hub import HubLayout, per_expert_gate_up_down
from hyper_parallel.models.roles import ATTENTION, DENSE_MLP, GDN, MOE

__all__ = ["QWEN3_NEXT"]

QWEN3_NEXT = ModelFamily(
    name="qwen3-next",
    causal_lm="Qwen3NextForCausalLM",
    base="Qwen3NextModel",
    blocks=(
        (("Qwen3NextAttention",), ATTENTION),
        (("Qwen3NextGatedDeltaNet",), GDN),
        (("Qwen3NextMLP",), DENSE_MLP),
        (("Qwen3NextSparseMoeBlock",), MOE),
    ),
    mixers=("linear_attn", "self_attn"),
    model_type="qwen3_next",
    layer_types=("full_attention", "linear_attention"),
    hub=HubLayout(fused=per_expert_gate_up_down()),
)
