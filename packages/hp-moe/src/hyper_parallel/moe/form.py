"""The stock experts form this layer parallelises, recognised without importing transformers.

The Hugging Face 5.x experts module (``DeepseekV3Experts``, ``KimiLinearExperts``,
``Qwen3MoeExperts``, ``Qwen3NextExperts``, ... and any class of the same form) holds every
routed expert of one MoE layer as two 3-D parameters and computes, for ``hidden [N, H]``,
``top_k_index [N, K]`` (global expert ids) and ``top_k_weights [N, K]``::

    out[n] = Σ_k  w[n, k] · down[e] @ (act(gate_up[e][:I] @ x[n]) * (gate_up[e][I:] @ x[n])),
    e = top_k_index[n, k]

with ``gate_up_proj [E, 2I, H]`` (gate rows first, then up rows) and ``down_proj [E, H, I]``.
Modules that store the weights transposed, interleaved, with biases, without a gate or with a
norm after each expert (transformers' ``is_transposed``, ``is_concatenated=False``,
``has_bias``, ``has_gate=False``, ``has_post_expert_norm``) are another form.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch import nn

__all__ = ["FORM", "ExpertsShape", "experts_shape"]

FORM = (
    "the Hugging Face 5.x experts form: 3-D parameters gate_up_proj [E, 2I, H] and down_proj "
    "[E, H, I], an act_fn, and forward(hidden [N, H], top_k_index [N, K], top_k_weights [N, K])"
)

# transformers' use_experts_implementation flags and the values of the stock form
_FLAGS = {
    "is_transposed": False,
    "is_concatenated": True,
    "has_bias": False,
    "has_gate": True,
    "has_post_expert_norm": False,
}


@dataclass(frozen=True)
class ExpertsShape:
    """``E`` experts, hidden size ``H``, expert intermediate size ``I``."""

    num_experts: int
    hidden: int
    intermediate: int


def experts_shape(module: nn.Module) -> ExpertsShape:
    """The shape of an experts module of the stock form; ``TypeError`` naming the form (and
    what differs) for anything else."""

    def refuse(why: str) -> TypeError:
        return TypeError(f"{type(module).__name__} is not of {FORM}: {why}")

    if not isinstance(module, nn.Module):
        raise refuse("not an nn.Module")
    params = dict(module.named_parameters(recurse=False))
    for name in ("gate_up_proj", "down_proj"):
        if name not in params:
            raise refuse(f"no parameter {name!r}")
    extra = sorted(set(params) - {"gate_up_proj", "down_proj"})
    if extra:
        raise refuse(f"unexpected parameters {extra} (biases or norms are another form)")
    if not callable(getattr(module, "act_fn", None)):
        raise refuse("no act_fn")
    for flag, stock in _FLAGS.items():
        if getattr(module, flag, stock) != stock:
            raise refuse(f"{flag}={getattr(module, flag)!r} (the stock form has {stock})")
    gu, dn = params["gate_up_proj"], params["down_proj"]
    if gu.dim() != 3 or dn.dim() != 3:
        raise refuse(f"gate_up_proj is {gu.dim()}-D and down_proj {dn.dim()}-D, both must be 3-D")
    e, two_i, h = gu.shape
    if two_i % 2 or tuple(dn.shape) != (e, h, two_i // 2):
        raise refuse(
            f"gate_up_proj {list(gu.shape)} and down_proj {list(dn.shape)} do not fit "
            "[E, 2I, H] and [E, H, I]"
        )
    try:
        names = list(inspect.signature(type(module).forward).parameters)[1:]
    except (TypeError, ValueError):
        names = []
    if names and len(names) < 3 and "args" not in names:
        raise refuse(f"forward takes {names}")
    return ExpertsShape(int(e), int(h), int(two_i) // 2)
