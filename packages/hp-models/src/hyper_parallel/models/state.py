"""What :func:`~hyper_parallel.models.parallelize_model` leaves on a model: its state.

The model-level forward is installed with hp-dtensor's rewrite (``install_forward``, layer
name :data:`LAYER`), like every layer's: the model's class becomes a cached subclass whose
``forward`` is the parallel one, and the :class:`ParallelPlan` is the rewrite's state object
(``hyper_parallel.dtensor.parallel_state(model, "hp-models")``). Everything that acts on a
parallelised model (its forward, ``sync_gradients``, ``clip_grad_norm_``, ``save_pretrained``)
reads the plan from there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

from hyper_parallel.dtensor.rewrite import is_parallelized, parallel_state
from hyper_parallel.models.mesh import SequenceMesh

if TYPE_CHECKING:
    from hyper_parallel.models.families import ModelFamily
    from hyper_parallel.models.roles import Role

__all__ = ["LAYER", "OWNER", "ParallelPlan", "is_model_parallelized", "pipeline_parts", "plan_of"]

LAYER = "hp-models"
"""The rewrite's layer name of a model parallelised by ``parallelize_model``."""
OWNER = LAYER
"""The owner hp-models' own collectives are started under (``hyper_parallel.dtensor.comm``)."""


@dataclass
class ParallelPlan:
    """What :func:`~hyper_parallel.models.parallelize_model` did to a model: the state of its
    rewrite (``parallel_state(model, "hp-models")``). ``has_loss``: the model computes a loss
    (a ``*ForCausalLM``, not a base model)."""

    family: ModelFamily
    mesh: SequenceMesh
    grad_reduction: str  # "fsdp" or "allreduce"
    roles: dict[str, Role] = field(default_factory=dict)  # block path (from the base) -> role
    has_loss: bool = True
    moe: Any = None  # experts.MoEState: ep, the ep/edp meshes, the last routing counts


def is_model_parallelized(model: nn.Module) -> bool:
    """Whether ``model`` was parallelised by :func:`~hyper_parallel.models.parallelize_model`
    (a deep copy of such a model is too: it shares the plan, meshes and groups)."""
    return is_parallelized(model, LAYER)


def plan_of(model: nn.Module, what: str) -> ParallelPlan:
    """The plan of a parallelised ``model``; ``RuntimeError`` naming ``what`` otherwise."""
    plan = parallel_state(model, LAYER)
    if not isinstance(plan, ParallelPlan):
        raise RuntimeError(f"{what} needs a model parallelised by parallelize_model")
    return plan


def pipeline_parts(model: Any) -> list[nn.Module] | None:
    """This rank's stages of a :class:`~hyper_parallel.models.PipelinedModel` (each a model
    parallelised by ``parallelize_model``), or None for anything else."""
    if getattr(model, "__hp_pipeline__", False):
        return list(model.parts)
    return None
