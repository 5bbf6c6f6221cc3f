"""The kinds of block a decoder layer is made of, as objects: what each is parallelised with,
which ranks its gradients are summed over, and what it needs of the mesh.

A :class:`~hyper_parallel.models.families.ModelFamily` maps each of its block classes to one of
these roles; everything in hp-models that acts per block (``parallelize_model``, FSDP2's
units, ``sync_gradients``' scopes, the experts, the save) asks the role, never a name. A new
token mixer is a new :class:`Role` (its layer's entry point and its mesh requirement); a new
family reuses the roles of the blocks it shares with the others.

=============  ==========================================================  ======  ===========
role           applied                                                     mesh    gradients
=============  ==========================================================  ======  ===========
``mla``        ``hyper_parallel.context_parallel.parallelize_mla``         flat    world
``attention``  ``hyper_parallel.context_parallel.parallelize_attention``   flat    world
``kda``        ``hyper_parallel.kda.parallelize_kda``                      flat    world
``gdn``        ``hyper_parallel.kda.parallelize_gated_deltanet``           flat    world
``dense_mlp``  ``parallelize_module(mlp, tp, MC2GatedMLPParallel())``      tp      cp (and dp)
``moe``        experts: ``hyper_parallel.moe.parallelize_experts`` (ep>1)  ep      world [#]_
=============  ==========================================================  ======  ===========

.. [#] the routed experts split over ep: over edp, the ranks holding the same experts.

"flat" is the (cp, tp) ranks flattened (one sequence, ``cp·tp`` blocks); "world" every rank
of the batch; a ``dense_mlp``'s weights are tp shards whose gradients already hold the sum over
tp, so they are summed over cp (and dp) only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

from hyper_parallel.context_parallel import (
    SUPPORTED_ATTENTION_CLASSES,
    SUPPORTED_MLA_CLASSES,
    parallelize_attention,
    parallelize_mla,
)
from hyper_parallel.kda import (
    SUPPORTED_GDN_CLASSES,
    SUPPORTED_KDA_CLASSES,
    parallelize_gated_deltanet,
    parallelize_kda,
)
from hyper_parallel.mc2 import MC2GatedMLPParallel

__all__ = [
    "ATTENTION",
    "DENSE_MLP",
    "GDN",
    "KDA",
    "MLA",
    "MOE",
    "ROLES",
    "BlockOptions",
    "Role",
]


@dataclass(frozen=True)
class BlockOptions:
    """The options of ``parallelize_model`` that reach the blocks."""

    mla_strategy: str = "latent"
    overlap: bool = True
    kda_protocol: str = "auto"
    local_kernel: str = "auto"


@dataclass(frozen=True)
class Role:
    """One kind of block. ``scope``: the ranks its parameters' gradients are summed over
    (``"world"``: every rank of the batch; ``"cp"``: cp and dp, for tp-sharded weights);
    ``split_heads``: the mixer splits its attention heads over the ``cp·tp`` ranks (Ulysses),
    so the heads must divide; ``routed``: an MoE block (experts, router, shared experts);
    ``supported``: the classes the role's layer accepts (the layer's own table), ``None`` where
    the layer takes any block of the form (hp-mc2's MLP style, hp-moe's experts)."""

    name: str
    scope: str = "world"
    split_heads: bool = False
    routed: bool = False
    supported: tuple[str, ...] | None = None

    def check(self, block: nn.Module, where: str, cp: int, tp: int) -> None:
        """``ValueError`` naming ``where`` when this block cannot be split over the mesh;
        collective-free, the same on every rank."""
        if self.split_heads:
            p = cp * tp
            heads = _heads(block)
            if heads % p:
                raise ValueError(
                    f"{where}: {heads} attention heads are not divisible by cp·tp = {cp}·{tp} "
                    f"= {p} (each rank computes H/(cp·tp) heads)"
                )

    def apply(self, block: nn.Module, sm: Any, options: BlockOptions) -> None:
        """Parallelise ``block`` in place over the model's :class:`SequenceMesh` ``sm``
        (collective: every rank, the same blocks in the same order)."""
        del block, sm, options  # the MoE role acts through the model's experts state


@dataclass(frozen=True)
class _MLA(Role):
    def apply(self, block: nn.Module, sm: Any, options: BlockOptions) -> None:
        parallelize_mla(block, sm.flat, strategy=options.mla_strategy, overlap=options.overlap)


@dataclass(frozen=True)
class _Attention(Role):
    def apply(self, block: nn.Module, sm: Any, options: BlockOptions) -> None:
        parallelize_attention(block, sm.flat, overlap=options.overlap)


@dataclass(frozen=True)
class _KDA(Role):
    def apply(self, block: nn.Module, sm: Any, options: BlockOptions) -> None:
        parallelize_kda(
            block, sm.flat, protocol=options.kda_protocol, local_kernel=options.local_kernel
        )


@dataclass(frozen=True)
class _GDN(Role):
    def apply(self, block: nn.Module, sm: Any, options: BlockOptions) -> None:
        parallelize_gated_deltanet(
            block, sm.flat, protocol=options.kda_protocol, local_kernel=options.local_kernel
        )


@dataclass(frozen=True)
class _DenseMLP(Role):
    def apply(self, block: nn.Module, sm: Any, options: BlockOptions) -> None:
        parallelize_module(block, sm.tp, MC2GatedMLPParallel())


MLA: Role = _MLA("mla", split_heads=True, supported=SUPPORTED_MLA_CLASSES)
ATTENTION: Role = _Attention("attention", split_heads=True, supported=SUPPORTED_ATTENTION_CLASSES)
KDA: Role = _KDA("kda", supported=SUPPORTED_KDA_CLASSES)
GDN: Role = _GDN("gdn", supported=SUPPORTED_GDN_CLASSES)
DENSE_MLP: Role = _DenseMLP("dense_mlp", scope="cp")
MOE: Role = Role("moe", routed=True)
ROLES: tuple[Role, ...] = (MLA, ATTENTION, KDA, GDN, DENSE_MLP, MOE)
"""Every role, by name in :attr:`Role.name`."""


def _heads(attn: nn.Module) -> int:
    for name in ("num_heads", "num_attention_heads"):
        if isinstance(getattr(attn, name, None), int):
            return int(getattr(attn, name))
    return int(getattr(attn, "config").num_attention_heads)  # noqa: B009
