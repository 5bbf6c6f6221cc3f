"""What one rank holds after the real ``parallelize_model``, and what FSDP2 moves per step,
counted in one process over torch's fake process group (no process group of the caller's).

The stock model is built with every parameter on the meta device (no memory), in the plan's
dtype. Decoder layers whose blocks have the same classes place alike, so the model is cut to
one layer of each kind (its first occurrence) before the real ``parallelize_model`` places it;
each kind's bytes are then counted once and multiplied by how many layers it has. The fake
group stands in for ``dp·cp·tp`` ranks: its collectives move nothing (an all-gather hands back
this rank's own input), so hp-dtensor's consistency checks, which would compare this rank with
itself, are off around the call.

Each piece is counted apart (:class:`Parts`: one layer of each kind, the embeddings, the final
norm and LM head), so that any pipeline stage is a sum of pieces (:func:`compose`): a decoder
layer places alike whichever other layers the model holds, and the root unit's parameters are
each sharded on their own.

Counted per rank (FSDP2 stores every shard padded to the first chunk's size, so every rank of
a unit holds the same bytes: ``FSDPParam.padded_sharded_param_size``):

- ``parameters``: the padded shards (``grad_reduction="fsdp"``), or the local tensors
  (``"allreduce"``: whole, but for tp/ep shards);
- ``gradients``: the same bytes (FSDP2's sharded gradients are views of its padded
  reduce-scatter output);
- ``optimizer``: the states AdamW creates at its first step: ``exp_avg`` and ``exp_avg_sq``
  shaped like each parameter's local (unpadded) tensor, plus one float32 ``step`` per
  parameter; SGD without momentum creates none;
- FSDP2's collectives per step, as bytes over this rank's link (hp-dtensor's
  ``comm.link_bytes``): each unit's all-gather (forward, and again in backward unless it is the
  root, which FSDP2 keeps unsharded after forward; a pipeline stage's units, with
  ``reshard_after_forward=False``, once), its gradient reduce-scatter, and HSDP's all-reduce
  over the replicas (where a unit has them).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "Parts",
    "Placement",
    "compose",
    "layer_kinds",
    "place_on_fake_world",
    "place_parts",
]

OPTIMIZERS = ("adamw", "sgd")
STEP_BYTES = 4  # AdamW's float32 `step` tensor, one per parameter
ROOT_PARTS = ("embed", "head", "other")


@dataclass
class Placement:
    """One rank's bytes (see the module docstring) and FSDP2's link bytes per step by
    collective (``"fsdp.all_gather"``, ``"fsdp.reduce_scatter"``, ``"fsdp.all_reduce"``)."""

    parameters: int = 0
    gradients: int = 0
    optimizer: int = 0
    param_count: int = 0  # the whole model's elements
    gathered_layer: int = 0  # bytes of the largest layer as FSDP2 all-gathers it
    collectives: dict[str, int] = field(default_factory=dict)

    def add(self, other: Placement, times: int) -> None:
        self.parameters += times * other.parameters
        self.gradients += times * other.gradients
        self.optimizer += times * other.optimizer
        self.param_count += times * other.param_count
        self.gathered_layer = max(self.gathered_layer, other.gathered_layer)
        for k, v in other.collectives.items():
            self.collectives[k] = self.collectives.get(k, 0) + times * v


def layer_kinds(base: nn.Module) -> list[tuple[int, int]]:
    """``(index of the first layer, how many layers)`` for every kind of decoder layer: the
    kind is the classes of its blocks (and their parameter shapes), so two layers of a kind
    are placed alike."""
    first = _kind_layers(base)
    return [(idx[0], len(idx)) for idx in first.values()]


def layer_order(base: nn.Module) -> list[int]:
    """Each decoder layer's kind, in model order (the kinds as :func:`layer_kinds` lists
    them)."""
    order = [0] * len(base.get_submodule("layers"))  # type: ignore[arg-type]
    for kind, idx in enumerate(_kind_layers(base).values()):
        for i in idx:
            order[i] = kind
    return order


def _kind_layers(base: nn.Module) -> dict[Any, list[int]]:
    first: dict[Any, list[int]] = {}
    layers: Any = base.get_submodule("layers")
    for i, layer in enumerate(layers):
        key = tuple(
            (type(m).__name__, tuple((n, tuple(p.shape)) for n, p in m.named_parameters()))
            for m in layer.children()
        )
        first.setdefault(key, []).append(i)
    return first


@contextlib.contextmanager
def fake_world(world: int, rank: int = 0) -> Iterator[None]:
    """The default process group as torch's fake one (``rank`` of ``world``) for the block;
    refused where the caller has a process group of its own."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "plan_memory runs in a process without a process group (it makes a fake one of "
            "the planned world size); call it before init_process_group or in another process"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _mesh(dims: tuple[int, int, int]) -> Any:
    from hyper_parallel.dtensor import init_device_mesh, unflatten

    world = init_device_mesh("cpu", (dims[0] * dims[1] * dims[2],), mesh_dim_names=("world",))
    return unflatten(world, "world", dims, ("dp", "cp", "tp"))


def _local(p: Any) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _root_part(name: str) -> str:
    """Which root part a parameter outside the decoder layers belongs to: the embeddings (the
    first pipeline stage's), the final norm and the LM head (the last's), or anything else."""
    if ".embed_tokens." in f".{name}":
        return "embed"
    if name.startswith(("model.norm.", "norm.", "lm_head.")):
        return "head"
    return "other"


def _count(
    model: nn.Module, optimizer: str, layer_paths: list[str]
) -> tuple[dict[str, Placement], dict[str, Placement]]:
    """The root's parameters by part (:func:`_root_part`) and each kept layer's share of the
    (cut) model by path. Each unit's FSDP2 collectives are counted once (one all-gather); the
    caller multiplies them by how often a step runs them."""
    from torch.distributed.fsdp import FSDPModule

    parts: dict[str, Placement] = {k: Placement() for k in ROOT_PARTS}
    per_layer: dict[str, Placement] = {p: Placement() for p in layer_paths}
    owner_of: dict[int, Placement] = {}
    for name, p in model.named_parameters():
        dest = next((per_layer[lp] for lp in layer_paths if name.startswith(lp + ".")), None)
        dest = parts[_root_part(name)] if dest is None else dest
        owner_of[id(p)] = dest
        local = _local(p)
        dest.param_count += p.numel()
        if optimizer == "adamw":
            dest.optimizer += 2 * local.numel() * local.element_size() + STEP_BYTES
    managed: set[int] = set()
    for mod_name, mod in model.named_modules():
        if not isinstance(mod, FSDPModule):
            continue
        state = mod._get_fsdp_state()
        group = state._fsdp_param_group
        if group is None:
            continue
        info: Any = group.mesh_info
        shard = int(info.shard_mesh_size)
        replicate = int(getattr(info, "replicate_mesh_size", 1) or 1)
        unit_dest = next(
            (per_layer[lp] for lp in layer_paths if (mod_name + ".").startswith(lp + ".")), None
        )
        unsharded = 0
        for fp in group.fsdp_params:
            managed.add(id(fp.sharded_param))
            nbytes = (
                torch.Size(fp.padded_sharded_param_size).numel() * fp.sharded_param.element_size()
            )
            dest = owner_of[id(fp.sharded_param)]
            dest.parameters += nbytes
            dest.gradients += nbytes
            unsharded += nbytes * shard
            if unit_dest is None:  # the root's unit: each part's padded shards (exact: a
                # padded shard times the shard count is the gathered bytes)
                _add_unit(dest, nbytes * shard, shard, replicate)
        if unit_dest is not None:
            _add_unit(unit_dest, unsharded, shard, replicate)
    for _, p in model.named_parameters():
        if id(p) not in managed:  # whole (or tp/ep-sharded) on every rank, as allocated
            local = _local(p)
            owner_of[id(p)].parameters += local.numel() * local.element_size()
            owner_of[id(p)].gradients += local.numel() * local.element_size()
    return parts, per_layer


def _add_unit(dest: Placement, unsharded: int, shard: int, replicate: int) -> None:
    """One FSDP2 unit's (or a root part's) collectives, an all-gather counted once, and its
    gathered bytes."""
    _add(dest, "fsdp.all_gather", _link("all_gather", unsharded, shard))
    _add(dest, "fsdp.reduce_scatter", _link("reduce_scatter", unsharded, shard))
    _add(dest, "fsdp.all_reduce", _link("all_reduce", unsharded // shard, replicate))
    dest.gathered_layer += unsharded


def _add(pl: Placement, key: str, nbytes: int) -> None:
    if nbytes:
        pl.collectives[key] = pl.collectives.get(key, 0) + nbytes


def _link(op: str, nbytes: int, size: int) -> int:
    from hyper_parallel.dtensor.comm import link_bytes

    return link_bytes(op, nbytes, size)


def build_on_meta(config: Any, dtype: torch.dtype) -> nn.Module:
    """The stock ``*ForCausalLM`` of ``config`` (transformers' ``AutoModelForCausalLM``) with
    every parameter and buffer on the meta device, in ``dtype``."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to(dtype)


_TEMPLATES: dict[tuple[int, torch.dtype], tuple[Any, nn.Module, list, list, list[int], Any]] = {}
_PLACED: dict[tuple[Any, ...], Any] = {}


def _template(config: Any, dtype: torch.dtype) -> tuple[nn.Module, list, list]:
    """The meta model of ``config`` cut to one layer of each kind, the kinds and their
    shapes; built once per config object and dtype (each placement places a copy)."""
    from hyper_parallel.models.pipeline.split import layer_costs
    from hyper_parallel.models.plan.activations import layer_shape

    key = (id(config), dtype)
    hit = _TEMPLATES.get(key)
    if hit is None or hit[0] is not config:
        model = build_on_meta(config, dtype)
        base = model.get_submodule("model")
        layers: Any = base.get_submodule("layers")
        kinds = layer_kinds(base)
        order = layer_order(base)
        costs = layer_costs(model)  # the pipeline's split, from the whole model
        shapes = [(layer_shape(layers[i], config), count) for i, count in kinds]
        base.layers = nn.ModuleList([layers[i] for i, _ in kinds])
        _TEMPLATES.clear()  # one model at a time: a real-size meta model is cheap, not free
        _PLACED.clear()
        hit = _TEMPLATES[key] = (config, model, kinds, shapes, order, costs)
    return hit[1], hit[2], hit[3]


def kinds_in_order(config: Any, dtype: torch.dtype) -> list[int]:
    """Each decoder layer's kind (an index into the shapes :func:`place_on_fake_world`
    returns), in model order."""
    _template(config, dtype)
    return list(_TEMPLATES[(id(config), dtype)][4])


def costs_of(config: Any, dtype: torch.dtype) -> tuple[list[float], float]:
    """:func:`hyper_parallel.models.pipeline.split.layer_costs` of the whole model of
    ``config``: each decoder layer's cost and the LM head's, what ``pipeline_model`` splits
    the layers by."""
    _template(config, dtype)
    costs, head = _TEMPLATES[(id(config), dtype)][5]
    return list(costs), float(head)


@dataclass
class Parts:
    """One rank's :class:`Placement` of each piece of the model, each FSDP2 unit's all-gather
    counted once: ``kinds[i]`` one decoder layer of kind ``i`` (``gathered_layer``: its units'
    gathered bytes), ``embed`` the embeddings, ``head`` the final norm and the LM head,
    ``other`` anything else outside the decoder layers (each root part's ``gathered_layer``:
    its share of the root unit's gathered bytes)."""

    kinds: list[Placement]
    embed: Placement
    head: Placement
    other: Placement


def place_parts(
    config: Any,
    dims: tuple[int, int, int],
    *,
    ep: int,
    dtype: torch.dtype,
    optimizer: str,
    grad_reduction: str,
) -> tuple[Parts, list[tuple[Any, int]]]:
    """The :class:`Parts` of the busiest rank under ``parallelize_model(model, mesh(dims),
    ep=ep, grad_reduction=grad_reduction)`` on a fake ``dp·cp·tp``-rank world (rank 0: with
    FSDP2's padded shards every rank of a unit holds the same bytes), and each layer kind's
    :class:`~hyper_parallel.models.plan.activations.LayerShape` with its count. A decoder
    layer places alike whichever other layers the model holds, so these parts also make up
    any pipeline stage (its layers; the embeddings on the first, the norm and head on the
    last)."""
    from hyper_parallel.dtensor import consistency_checks
    from hyper_parallel.models import parallelize_model

    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    template, kinds, shapes = _template(config, dtype)
    key = (id(config), dims, ep, dtype, optimizer, grad_reduction)
    if key in _PLACED:  # the same mesh planned again (e.g. with activation checkpointing)
        return _PLACED[key], shapes
    model = copy.deepcopy(template)
    world = dims[0] * dims[1] * dims[2]
    with fake_world(world), consistency_checks(False):
        parallelize_model(model, _mesh(dims), ep=ep, grad_reduction=grad_reduction)
        paths = [f"model.layers.{j}" for j in range(len(kinds))]
        root, per_layer = _count(model, optimizer, paths)
    parts = Parts([per_layer[p] for p in paths], root["embed"], root["head"], root["other"])
    _PLACED[key] = parts  # shared: read, never changed
    return parts, shapes


def compose(
    parts: Parts,
    layer_kinds_: list[int],
    *,
    embed: bool,
    head: bool,
    layer_gathers: int,
) -> tuple[Placement, int]:
    """``(placement, gathered bytes)`` of a model or pipeline stage holding the decoder layers
    of kinds ``layer_kinds_`` (one entry a layer), with the embeddings and the norm and head
    where asked (and the root's other parameters whenever ``embed``), each layer's units
    all-gathered ``layer_gathers`` times a step and the root's once; ``gathered_layer``: the
    largest layer's gathered bytes, the gathered bytes: every unit's together."""
    total = Placement()
    gathered = 0
    roots = ([parts.embed, parts.other] if embed else []) + ([parts.head] if head else [])
    for part in roots:
        total.add(part, 1)
        gathered += part.gathered_layer
    total.gathered_layer = 0
    counts: dict[int, int] = {}
    for kind in layer_kinds_:
        counts[kind] = counts.get(kind, 0) + 1
    for kind, count in counts.items():
        layer = parts.kinds[kind]
        total.add(layer, count)
        gathered += count * layer.gathered_layer
        gather = layer.collectives.get("fsdp.all_gather", 0)
        if gather and layer_gathers != 1:
            total.collectives["fsdp.all_gather"] += (layer_gathers - 1) * count * gather
    return total, gathered


def place_on_fake_world(
    config: Any,
    dims: tuple[int, int, int],
    *,
    ep: int,
    dtype: torch.dtype,
    optimizer: str,
    grad_reduction: str,
) -> tuple[Placement, list[tuple[Any, int]]]:
    """The busiest rank's :class:`Placement` of the whole model (:func:`place_parts`): every
    layer's units all-gathered twice a step (forward, and again in backward), the root's once
    (FSDP2 keeps the root unsharded after forward); ``gathered_layer``: the largest layer's
    gathered bytes."""
    parts, shapes = place_parts(
        config, dims, ep=ep, dtype=dtype, optimizer=optimizer, grad_reduction=grad_reduction
    )
    order = kinds_in_order(config, dtype)
    total, _ = compose(parts, order, embed=True, head=True, layer_gathers=2)
    return total, shapes
