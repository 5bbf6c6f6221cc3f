"""The model families hp-models knows, recognised by class name (transformers is never imported
here, so a fork that keeps the class names and attributes is recognised too).

A family says where the decoder layers are and which submodule of a layer is which kind of
block: an MLA attention (context-parallel through hp-context-parallel), a KDA layer
(context-parallel through hp-kda-kernels), a dense gated MLP (tensor + sequence parallel
through hp-mc2) or an MoE block (local, replicated parameters).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from hyper_parallel.context_parallel import SUPPORTED_MLA_CLASSES
from hyper_parallel.kda import SUPPORTED_KDA_CLASSES
from hyper_parallel.models.hub import Fused, HubLayout

__all__ = [
    "FAMILIES",
    "BlockKinds",
    "ModelFamily",
    "family_of",
    "family_of_config",
    "supported_classes",
]


@dataclass(frozen=True)
class BlockKinds:
    """Class names of one family's blocks, by role."""

    mla: tuple[str, ...]
    kda: tuple[str, ...]
    dense_mlp: tuple[str, ...]
    moe: tuple[str, ...]


@dataclass(frozen=True)
class ModelFamily:
    """``causal_lm`` wraps ``base`` as ``.model`` and adds ``lm_head``; ``base`` holds
    ``embed_tokens``, ``layers`` (each with ``self_attn`` and ``mlp``) and ``norm``."""

    name: str
    causal_lm: str
    base: str
    blocks: BlockKinds
    model_type: str = ""  # config.json's ``model_type``
    hub: HubLayout = HubLayout()  # noqa: RUF009 (frozen: one shared default is safe)


FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily(
        name="kimi-linear",
        causal_lm="KimiLinearForCausalLM",
        base="KimiLinearModel",
        blocks=BlockKinds(
            mla=("KimiLinearAttention",),
            kda=("KimiLinearDeltaAttention",),
            dense_mlp=("KimiLinearMLP",),
            moe=("KimiLinearMoE",),
        ),
        model_type="kimi_linear",
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
    ),
    ModelFamily(
        name="deepseek-v3",
        causal_lm="DeepseekV3ForCausalLM",
        base="DeepseekV3Model",
        blocks=BlockKinds(
            mla=("DeepseekV3Attention",),
            kda=(),
            dense_mlp=("DeepseekV3MLP",),
            moe=("DeepseekV3MoE",),
        ),
        model_type="deepseek_v3",
        hub=HubLayout(
            fused=(
                Fused(
                    "experts.gate_up_proj",
                    ("experts.{e}.gate_proj.weight", "experts.{e}.up_proj.weight"),
                    per_expert=True,
                ),
                Fused("experts.down_proj", ("experts.{e}.down_proj.weight",), per_expert=True),
            ),
        ),
    ),
)


def _check_against_the_layers() -> None:
    """Every attention class a family names is one its layer supports (the layers own those
    tables): a family edited without its layer fails at import, not in a user's run."""
    for f in FAMILIES:
        for role, names, supported in (
            ("mla", f.blocks.mla, SUPPORTED_MLA_CLASSES),
            ("kda", f.blocks.kda, SUPPORTED_KDA_CLASSES),
        ):
            unknown = sorted(set(names) - set(supported))
            if unknown:
                raise ImportError(
                    f"hp-models family {f.name}: {role} classes {unknown} are not supported by "
                    f"the installed layer (it supports {list(supported)})"
                )


_check_against_the_layers()


def family_of_config(config: dict[str, Any]) -> ModelFamily:
    """The family of a ``config.json`` (its ``architectures`` or ``model_type``); ``TypeError``
    naming the supported ones otherwise."""
    archs = config.get("architectures") or []
    for fam in FAMILIES:
        if (
            fam.causal_lm in archs
            or fam.base in archs
            or config.get("model_type") == fam.model_type
        ):
            return fam
    raise TypeError(
        f"config.json names {archs or config.get('model_type')!r}; hp-models parallelises "
        f"{', '.join(f.causal_lm for f in FAMILIES)} (model_type "
        f"{', '.join(repr(f.model_type) for f in FAMILIES)})"
    )


def supported_classes() -> list[str]:
    """Every model class :func:`~hyper_parallel.models.parallelize_model` accepts."""
    return [c for f in FAMILIES for c in (f.causal_lm, f.base)]


def _names(module: nn.Module) -> set[str]:
    # a subclass of a stock class (a team's fork) is that class too
    return {k.__name__ for k in type(module).__mro__}


def family_of(model: nn.Module) -> tuple[ModelFamily, nn.Module]:
    """``(family, base model)`` for a supported model; ``TypeError`` naming the supported
    classes otherwise."""
    names = _names(model)
    for fam in FAMILIES:
        if fam.causal_lm in names:
            base = getattr(model, "model", None)
            if base is not None and fam.base in _names(base):
                return fam, base
        if fam.base in names:
            return fam, model
    raise TypeError(
        f"parallelize_model supports {', '.join(supported_classes())} (Hugging Face "
        f"transformers, or forks keeping those class names); got {type(model).__name__}"
    )


def role_of(block: nn.Module, fam: ModelFamily) -> str:
    """``"mla"``, ``"kda"``, ``"dense_mlp"`` or ``"moe"``; ``TypeError`` for anything else."""
    names = _names(block)
    for role in ("mla", "kda", "dense_mlp", "moe"):
        if names & set(getattr(fam.blocks, role)):
            return role
    raise TypeError(
        f"{fam.name}: block {type(block).__name__} is none of the known kinds "
        f"{[c for r in ('mla', 'kda', 'dense_mlp', 'moe') for c in getattr(fam.blocks, r)]}"
    )
