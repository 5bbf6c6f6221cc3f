"""What one rank holds after the real ``parallelize_model``, and what FSDP2 moves per step,
counted in one process over torch's fake process group (no process group of the caller's).

The stock model is built with every parameter on the meta device (no memory), in the plan's
dtype. Decoder layers whose blocks have the same classes place alike, so the model is cut to
one layer of each kind (its first occurrence) before the real ``parallelize_model`` places it;
each kind's bytes are then counted once and multiplied by how many layers it has. The fake
group stands in for ``dp·cp·tp`` ranks: its collectives move nothing (an all-gather hands back
this rank's own input), so hp-dtensor's consistency checks, which would compare this rank with
itself, are off around the call.

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
  root, which FSDP2 keeps unsharded after forward), its gradient reduce-scatter, and HSDP's
  all-reduce over the replicas.
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

__all__ = ["Placement", "layer_kinds", "place_on_fake_world"]

OPTIMIZERS = ("adamw", "sgd")
STEP_BYTES = 4  # AdamW's float32 `step` tensor, one per parameter


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


def _count(model: nn.Module, optimizer: str, layer_paths: list[str]) -> tuple[Placement, dict]:
    """The whole (cut) model's placement, and each kept layer's share of it by path."""
    from torch.distributed.fsdp import FSDPModule

    total = Placement()
    per_layer: dict[str, Placement] = {p: Placement() for p in layer_paths}
    owner_of: dict[int, Placement] = {}
    for name, p in model.named_parameters():
        dest = next((per_layer[lp] for lp in layer_paths if name.startswith(lp + ".")), total)
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
            (per_layer[lp] for lp in layer_paths if (mod_name + ".").startswith(lp + ".")), total
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
        # the root (the model's own unit) stays unsharded between forward and backward
        gathers = 1 if mod_name == "" else 2
        _add(unit_dest, "fsdp.all_gather", gathers * _link("all_gather", unsharded, shard))
        _add(unit_dest, "fsdp.reduce_scatter", _link("reduce_scatter", unsharded, shard))
        _add(unit_dest, "fsdp.all_reduce", _link("all_reduce", unsharded // shard, replicate))
        unit_dest.gathered_layer += unsharded
    for _, p in model.named_parameters():
        if id(p) not in managed:  # whole (or tp/ep-sharded) on every rank, as allocated
            local = _local(p)
            owner_of[id(p)].parameters += local.numel() * local.element_size()
            owner_of[id(p)].gradients += local.numel() * local.element_size()
    return total, per_layer


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


_TEMPLATES: dict[tuple[int, torch.dtype], tuple[Any, nn.Module, list, list, list[int]]] = {}
_PLACED: dict[tuple[Any, ...], Placement] = {}


def _template(config: Any, dtype: torch.dtype) -> tuple[nn.Module, list, list]:
    """The meta model of ``config`` cut to one layer of each kind, the kinds and their
    shapes; built once per config object and dtype (each placement places a copy)."""
    from hyper_parallel.models.plan.activations import layer_shape

    key = (id(config), dtype)
    hit = _TEMPLATES.get(key)
    if hit is None or hit[0] is not config:
        model = build_on_meta(config, dtype)
        base = model.get_submodule("model")
        layers: Any = base.get_submodule("layers")
        kinds = layer_kinds(base)
        order = layer_order(base)
        shapes = [(layer_shape(layers[i], config), count) for i, count in kinds]
        base.layers = nn.ModuleList([layers[i] for i, _ in kinds])
        _TEMPLATES.clear()  # one model at a time: a real-size meta model is cheap, not free
        _PLACED.clear()
        hit = _TEMPLATES[key] = (config, model, kinds, shapes, order)
    return hit[1], hit[2], hit[3]


def kinds_in_order(config: Any, dtype: torch.dtype) -> list[int]:
    """Each decoder layer's kind (an index into the shapes :func:`place_on_fake_world`
    returns), in model order."""
    _template(config, dtype)
    return list(_TEMPLATES[(id(config), dtype)][4])


def place_on_fake_world(
    config: Any,
    dims: tuple[int, int, int],
    *,
    ep: int,
    dtype: torch.dtype,
    optimizer: str,
    grad_reduction: str,
) -> tuple[Placement, list[tuple[Any, int]]]:
    """The busiest rank's :class:`Placement` under ``parallelize_model(model, mesh(dims),
    ep=ep, grad_reduction=grad_reduction)`` on a fake ``dp·cp·tp``-rank world (rank 0: with
    FSDP2's padded shards every rank of a unit holds the same bytes), and each layer kind's
    :class:`~hyper_parallel.models.plan.activations.LayerShape` with its count."""
    from hyper_parallel.dtensor import consistency_checks
    from hyper_parallel.models import parallelize_model

    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    template, kinds, shapes = _template(config, dtype)
    key = (id(config), dims, ep, dtype, optimizer, grad_reduction)
    if key in _PLACED:  # the same mesh planned again (e.g. with activation checkpointing)
        return copy.deepcopy(_PLACED[key]), shapes
    model = copy.deepcopy(template)
    world = dims[0] * dims[1] * dims[2]
    with fake_world(world), consistency_checks(False):
        parallelize_model(model, _mesh(dims), ep=ep, grad_reduction=grad_reduction)
        paths = [f"model.layers.{j}" for j in range(len(kinds))]
        total, per_layer = _count(model, optimizer, paths)
    total.gathered_layer = 0  # the root's unit: embeddings, final norm, head
    for path, (_, count) in zip(paths, kinds, strict=True):
        total.add(per_layer[path], count)
    _PLACED[key] = copy.deepcopy(total)
    return total, shapes
