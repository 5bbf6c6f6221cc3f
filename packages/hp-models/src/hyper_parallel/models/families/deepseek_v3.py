"""DeepSeek-V3 (``DeepseekV3ForCausalLM``): MLA under ``self_attn``; dense MLPs in the first
layers, then MoE blocks with ungated shared experts; per-expert hub tensors (and FP8 blocks,
dequantised by :class:`~hyper_parallel.models.hub.HubFolder`). The model builds its own causal
mask; with packed documents it is given the block's plain causal mask."""

from __future__ import annotations

from hyper_parallel.models.families import ModelFamily
from hyper_parallel.models.hub import HubLayout, per_expert_gate_up_down
from hyper_parallel.models.roles import DENSE_MLP, MLA, MOE

__all__ = ["DEEPSEEK_V3"]

DEEPSEEK_V3 = ModelFamily(
    name="deepseek-v3",
    causal_lm="DeepseekV3ForCausalLM",
    base="DeepseekV3Model",
    blocks=(
        (("DeepseekV3Attention",), MLA),
        (("DeepseekV3MLP",), DENSE_MLP),
        (("DeepseekV3MoE",), MOE),
    ),
    model_type="deepseek_v3",
    hub=HubLayout(fused=per_expert_gate_up_down()),
)
