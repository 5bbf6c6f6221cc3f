"""The model families hp-models knows, as objects, recognised by class name (transformers is
never imported here, so a fork that keeps the class names and attributes is recognised too).

A :class:`ModelFamily` says where the decoder layers are, which submodule of a layer is its
token mixer and which its MLP, which :class:`~hyper_parallel.models.roles.Role` each block
class plays, how the parallelised forward hands the model its masks, and how its Hugging Face
hub files are laid out (:class:`~hyper_parallel.models.hub.HubLayout`). Each family is one
module of this package (:mod:`.kimi_linear`, :mod:`.deepseek_v3`, :mod:`.qwen3_next`); a new
family is a new module and one entry in :data:`FAMILIES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from hyper_parallel.models.absent import is_absent
from hyper_parallel.models.hub import HubLayout
from hyper_parallel.models.roles import Role

__all__ = [
    "FAMILIES",
    "ModelFamily",
    "family_named",
    "family_of",
    "family_of_config",
    "role_of",
    "supported_classes",
]


@dataclass(frozen=True)
class ModelFamily:
    """One family of stock models. ``causal_lm`` wraps ``base`` as ``.model`` and adds
    ``lm_head``; ``base`` holds ``embed_tokens``, ``layers`` (each with a token mixer, the first
    of ``mixers`` it has, and ``mlp``) and ``norm``.

    ``blocks``: ``(class names, role)`` pairs, every block class of the family's layers.
    ``layer_types``: the model takes a ready ``{layer type: mask}`` mapping as
    ``attention_mask`` (Kimi-Linear, Qwen3-Next): the parallelised forward passes every mask as
    ``None`` (causal order is kept by the layers' schedules). Empty: the model builds its own
    mask, and with packed documents it is given the block's plain causal mask so that it does
    not build a packed one from the per-document positions (DeepSeek-V3)."""

    name: str
    causal_lm: str
    base: str
    blocks: tuple[tuple[tuple[str, ...], Role], ...]
    mixers: tuple[str, ...] = ("self_attn",)
    model_type: str = ""  # config.json's ``model_type``
    hub: HubLayout = HubLayout()  # noqa: RUF009 (frozen: one shared default is safe)
    layer_types: tuple[str, ...] = ()

    def classes(self, role: Role) -> tuple[str, ...]:
        """The block classes of this family that play ``role``."""
        return tuple(c for names, r in self.blocks if r is role for c in names)

    def role_of(self, block: nn.Module) -> Role:
        """The role of ``block``; ``TypeError`` naming the known classes otherwise."""
        names = _names(block)
        for classes, role in self.blocks:
            if names & set(classes):
                return role
        raise TypeError(
            f"{self.name}: block {type(block).__name__} is none of the known kinds "
            f"{[c for classes, _ in self.blocks for c in classes]}"
        )

    def layer_blocks(self, layer: nn.Module, i: int) -> list[tuple[str, nn.Module]]:
        """``[(path, block)]`` of decoder layer ``i``: its token mixer and its MLP (paths
        relative to the base model, e.g. ``layers.3.linear_attn``); ``TypeError`` for a layer
        without them; none for a layer another pipeline stage holds
        (:class:`~hyper_parallel.models.absent.AbsentLayer`)."""
        if is_absent(layer):
            return []
        mixer = next((m for m in self.mixers if _has(layer, m)), None)
        if mixer is None or not _has(layer, "mlp"):
            raise TypeError(
                f"{self.name}: layer {i} ({type(layer).__name__}) has no token mixer "
                f"{' / '.join(self.mixers)} and mlp"
            )
        return [(f"layers.{i}.{n}", layer.get_submodule(n)) for n in (mixer, "mlp")]

    def forward_masks(self, kwargs: dict[str, Any], packed: bool) -> None:
        """Set the ``attention_mask`` the parallelised forward hands the model (in place; see
        the class docstring). ``packed``: the call carries a document table."""
        if self.layer_types:
            kwargs["attention_mask"] = dict.fromkeys(self.layer_types)
            return
        ids = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        if packed and isinstance(ids, Tensor):
            s = ids.shape[1]
            causal = torch.ones(s, s, dtype=torch.bool, device=ids.device).tril()
            kwargs["attention_mask"] = causal[None, None]


def _names(module: nn.Module) -> set[str]:
    # a subclass of a stock class (a team's fork) is that class too
    return {k.__name__ for k in type(module).__mro__}


def _has(module: nn.Module, name: str) -> bool:
    return isinstance(getattr(module, name, None), nn.Module)


# the registry: one line a family (imported here, after ModelFamily exists)
from hyper_parallel.models.families.deepseek_v3 import DEEPSEEK_V3  # noqa: E402
from hyper_parallel.models.families.kimi_linear import KIMI_LINEAR  # noqa: E402
from hyper_parallel.models.families.qwen3_next import QWEN3_NEXT  # noqa: E402

FAMILIES: tuple[ModelFamily, ...] = (KIMI_LINEAR, DEEPSEEK_V3, QWEN3_NEXT)


def _check_against_the_layers() -> None:
    """Every class a family gives a layer is one that layer supports (the layers own those
    tables): a family edited without its layer fails at import, not in a user's run."""
    for f in FAMILIES:
        for classes, role in f.blocks:
            if role.supported is None:
                continue
            unknown = sorted(set(classes) - set(role.supported))
            if unknown:
                raise ImportError(
                    f"hp-models family {f.name}: {role.name} classes {unknown} are not "
                    f"supported by the installed layer (it supports {list(role.supported)})"
                )


_check_against_the_layers()


def family_named(name: str) -> ModelFamily:
    """The family called ``name`` (:attr:`ModelFamily.name`); ``KeyError`` otherwise."""
    for fam in FAMILIES:
        if fam.name == name:
            return fam
    raise KeyError(f"no hp-models family {name!r}; known: {[f.name for f in FAMILIES]}")


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


def role_of(block: nn.Module, fam: ModelFamily) -> Role:
    """``fam.role_of(block)``."""
    return fam.role_of(block)
