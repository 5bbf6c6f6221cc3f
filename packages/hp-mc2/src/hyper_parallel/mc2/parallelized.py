"""Undo and query what the MC2 styles installed: :func:`unparallelize_mc2`,
:func:`is_mc2_parallel`.

:class:`~hyper_parallel.mc2.MC2ColwiseParallel`, :class:`~hyper_parallel.mc2.MC2RowwiseParallel`
(and :meth:`~hyper_parallel.mc2.MC2Linear.from_linear` with a config) and
:class:`~hyper_parallel.mc2.MC2GatedMLPParallel` and :class:`~hyper_parallel.mc2.MC2MLPParallel`
install their parallel forward with
hp-dtensor's ``rewrite`` (``install_forward``): a cached subclass of the module's own class and
one state object (the layer's config). Undoing gives the module its own class back (so its own,
plain forward) and drops the config; the parameters the style sharded stay the DTensor
``Parameter`` objects it registered (the style does not keep the full tensors).
"""

from __future__ import annotations

from typing import TypeVar

from torch import nn

from hyper_parallel.dtensor.rewrite import is_parallelized, parallel_state, uninstall_forward
from hyper_parallel.mc2.gated_style import LAYER as GATED_LAYER
from hyper_parallel.mc2.linear import LAYER as LINEAR_LAYER
from hyper_parallel.mc2.mlp_style import LAYER as MLP_LAYER

__all__ = ["is_mc2_parallel", "unparallelize_mc2"]

_M = TypeVar("_M", bound=nn.Module)


def is_mc2_parallel(module: nn.Module) -> bool:
    """Whether ``module`` runs an hp-mc2 parallel forward: an ``nn.Linear`` given an
    :class:`~hyper_parallel.mc2.MC2Parallel` (by a colwise/rowwise style, ``from_linear`` or the
    ``MC2Linear`` constructor), a gated MLP parallelized by ``MC2GatedMLPParallel`` or a plain
    MLP parallelized by ``MC2MLPParallel``."""
    return (
        parallel_state(module, LINEAR_LAYER) is not None
        or is_parallelized(module, GATED_LAYER)
        or is_parallelized(module, MLP_LAYER)
    )


def unparallelize_mc2(module: _M) -> _M:
    """Undo an hp-mc2 style on ``module`` (in place; returns it): its own class and forward
    back, the config dropped (a deep copy made before keeps it). Its parameters stay the
    DTensor shards the style registered: to run the plain forward on full tensors, put full
    parameters back (e.g. ``nn.Parameter(p.full_tensor())``, or load a full state dict).
    A gated or plain MLP's linear children are plain ``nn.Linear`` throughout.

    ``RuntimeError`` if ``module`` does not run an hp-mc2 parallel forward
    (:func:`is_mc2_parallel` is false)."""
    if parallel_state(module, LINEAR_LAYER) is not None:
        uninstall_forward(module, LINEAR_LAYER)
    elif is_parallelized(module, GATED_LAYER):
        uninstall_forward(module, GATED_LAYER)
    elif is_parallelized(module, MLP_LAYER):
        uninstall_forward(module, MLP_LAYER)
    else:
        raise RuntimeError(
            f"unparallelize_mc2: this {type(module).__name__} is not parallelized by hp-mc2 "
            "(no MC2ColwiseParallel / MC2RowwiseParallel / MC2GatedMLPParallel / MC2MLPParallel "
            "forward on it)"
        )
    return module
