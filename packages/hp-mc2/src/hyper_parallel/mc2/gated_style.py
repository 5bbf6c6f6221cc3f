"""``MC2GatedMLPParallel``: the ``ParallelStyle`` for gated MLP modules
(``down(act_fn(gate(x)) * up(x))``: Hugging Face ``LlamaMLP``, ``DeepseekV3MLP``,
``KimiLinearMLP`` and any module with the same three ``nn.Linear`` children and ``act_fn``).

Applied with torch's ``parallelize_module(mlp, tp_mesh, MC2GatedMLPParallel())``: the weights
become DTensors (gate/up ``Shard(0)``, down ``Shard(1)``, gate/up biases ``Shard(0)``, the
down bias ``Replicate()``) and the module's forward runs :func:`~hyper_parallel.mc2.gated_mlp`
on this rank's sequence block. The module keeps its class, children, ``act_fn`` and parameter
names; the parameters are new DTensor ``Parameter`` objects, as with torch's own styles.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from hyper_parallel.dtensor.amp import cast_for_autocast
from hyper_parallel.dtensor.consistency import checked_entry
from hyper_parallel.dtensor.rewrite import install_forward, is_parallelized, parallel_state
from hyper_parallel.mc2._block import block_fields, run_block
from hyper_parallel.mc2._block_style import (
    check_input,
    check_linears,
    check_style_options,
    check_tp_mesh,
    distribute_linears,
    on_rows,
    rows_of,
)
from hyper_parallel.mc2._keywords import impl_keyword
from hyper_parallel.mc2.activation import check_elementwise_activation

__all__ = ["MC2GatedMLPParallel"]

_NAME = "MC2GatedMLPParallel"
LAYER = "MC2GatedMLPParallel"  # the name this rewrite is installed under (hp-dtensor's rewrite)


@dataclass(frozen=True)
class _GatedPlan:
    """What a parallelized gated MLP runs: the state hp-dtensor's ``rewrite`` keeps for it
    (under :data:`LAYER`)."""

    gate: str
    up: str
    down: str
    sequence_dim: int
    impl: str
    chunks: int | None
    group: Any
    module_class: str = ""  # the module's own class name, for messages


def _local(t: Any) -> Any:
    return t.to_local() if isinstance(t, DTensor) else t


def _make_forward(original: type) -> Any:
    """The parallel forward of a parallelized ``original`` (built once per class by
    hp-dtensor's rewrite), its consistency check declared once, named after the class."""
    return checked_entry(f"{_NAME} ({original.__name__})", _forward_fields)(_gated_forward)


def _operands(self: nn.Module, plan: _GatedPlan) -> tuple[Any, Any]:
    """The local ``(W_g, W_u, W_d)`` and ``(b_g, b_u, b_d)`` of a parallelized module."""
    gate, up, down = (getattr(self, n) for n in (plan.gate, plan.up, plan.down))
    weights = (_local(gate.weight), _local(up.weight), _local(down.weight))
    return weights, (_local(gate.bias), _local(up.bias), _local(down.bias))


def _forward_fields(self: nn.Module, x: Any) -> tuple[Any, dict[str, Any]]:
    """What the ranks compare before the forward's first collective: the input block,
    ``sequence_dim`` and :func:`~hyper_parallel.mc2._block.block_fields` on its rows."""
    plan = cast(_GatedPlan, parallel_state(self, LAYER))
    weights, biases = _operands(self, plan)
    fields: dict[str, Any] = {"input": x, "sequence_dim": plan.sequence_dim}
    rows = rows_of(x, plan.sequence_dim)
    act = getattr(self, "act_fn", None)
    (wg, wu, wd), (bg, bu, bd) = weights, biases
    fields.update(
        block_fields(rows, (wg, wu), (bg, bu), wd, bd, plan.group, act, plan.impl, plan.chunks)
    )
    return plan.group, fields


def _gated_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The parallel forward: ``x`` ``[..., S_local, ..., D]`` (this rank's block, sequence at
    ``sequence_dim``) -> ``[..., S_local, ..., D]``, this rank's block of the output."""
    plan = cast(_GatedPlan, parallel_state(self, LAYER))
    (wg, wu, wd), (bg, bu, bd) = _operands(self, plan)
    if isinstance(x, torch.Tensor):  # under autocast: the dtypes F.linear would compute in
        x, wg, wu, wd, bg, bu, bd = cast_for_autocast(x.device.type, x, wg, wu, wd, bg, bu, bd)
    seq = check_input(x, wg, plan.sequence_dim, _NAME)
    act = cast(Any, self.act_fn)
    return on_rows(
        x,
        seq,
        lambda rows: run_block(
            rows, (wg, wu), (bg, bu), wd, bd, plan.group, act, plan.impl, plan.chunks
        ),
    )


class MC2GatedMLPParallel(ParallelStyle):
    """Tensor + sequence parallel gated MLP with one all-gather shared by gate and up.

    Input and output: this rank's sequence block as a local tensor, ``[B, S/tp, D]`` with
    ``sequence_dim=1`` (any layout with the sequence at ``sequence_dim`` and features last).
    Rank ``t`` of the tp mesh holds block ``t`` of the sequence. ``gate``, ``up``, ``down``
    name the module's ``nn.Linear`` children; the activation is the module's own
    ``act_fn`` (per-element only). ``impl`` (``backend=``: its deprecated name): the
    matmul+collective implementation, ``"auto"``, ``"torch"`` (chunked collectives
    overlapped with the matmuls) or ``"npu"`` (torch_npu MC2 kernels); ``chunks`` as in
    :func:`~hyper_parallel.mc2.gated_mlp`.

    Output and every gradient equal the serial module on the full sequence; ``dW`` of each
    weight is this rank's shard of the full gradient.

    Consistency mode (``HP_CHECK_CONSISTENCY=1`` or ``consistency_checks()``): applying the
    style compares, over the tp group and before the weights are distributed, the style's
    options (``gate``/``up``/``down``, ``sequence_dim``, ``impl``, ``chunks``), the module's
    class and its weights' shapes and dtypes; each forward compares the input block (shape,
    dtype), ``sequence_dim``, the weight shards, the chosen ``impl``, the chunk count and the
    tp size (:func:`~hyper_parallel.mc2.gated_mlp`'s fields), in one collective.
    """

    @impl_keyword(_NAME)
    def __init__(
        self,
        *,
        gate: str = "gate_proj",
        up: str = "up_proj",
        down: str = "down_proj",
        sequence_dim: int = 1,
        impl: str = "auto",
        chunks: int | None = None,
    ) -> None:
        super().__init__()
        for what, name in (("gate", gate), ("up", up), ("down", down)):
            if not isinstance(name, str) or not name:
                raise TypeError(f"{_NAME}: {what} must be a submodule name, got {name!r}")
        check_style_options(_NAME, sequence_dim, impl, chunks)
        self.gate, self.up, self.down = gate, up, down
        self.sequence_dim, self.impl, self.chunks = sequence_dim, impl, chunks

    def __repr__(self) -> str:
        return (
            f"{_NAME}(gate={self.gate!r}, up={self.up!r}, down={self.down!r}, "
            f"sequence_dim={self.sequence_dim}, impl={self.impl!r}, chunks={self.chunks})"
        )

    def _linears(self, module: nn.Module) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        kind = type(module).__name__
        children = [n for n, _ in module.named_children()]
        found = []
        for role, name in (("gate", self.gate), ("up", self.up), ("down", self.down)):
            child = module._modules.get(name)
            if child is None:
                raise ValueError(
                    f"{_NAME}: {kind} has no {role} submodule {name!r} (its children: "
                    f"{children}); pass {role}=<name> for modules that name it otherwise"
                )
            if not isinstance(child, nn.Linear):
                raise TypeError(
                    f"{_NAME}: {kind}.{name} ({role}) must be an nn.Linear, got "
                    f"{type(child).__name__}"
                )
            found.append(child)
        return found[0], found[1], found[2]

    def _apply_fields(self, module: nn.Module, mesh: Any) -> tuple[Any, dict[str, Any]] | None:
        """What the ranks compare before the weights are distributed (``None`` for a mesh the
        body rejects): the style, the module's class, its three linears' weights and biases."""
        if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
            return None
        fields: dict[str, Any] = {"style": repr(self), "module": type(module).__name__}
        for role, name in (("gate", self.gate), ("up", self.up), ("down", self.down)):
            child = module._modules.get(name)
            fields[role] = (getattr(child, "weight", None), getattr(child, "bias", None))
        fields["src_data_rank"] = getattr(self, "src_data_rank", 0)
        fields["world_size"] = mesh.size()
        return mesh.get_group(), fields

    def _check_module(self, module: nn.Module, ws: int) -> None:
        """Everything that can fail, before distribute_tensor communicates."""
        if is_parallelized(module):  # a rewrite's class is a direct subclass of the module's own
            own = type(module).__bases__[0].__name__
            raise RuntimeError(f"{_NAME}: this {own} is already parallelized")
        kind = type(module).__name__
        gate, up, down = self._linears(module)
        if not hasattr(module, "act_fn"):
            raise ValueError(f"{_NAME}: {kind} has no act_fn; the style uses the module's own")
        check_elementwise_activation(module.act_fn, f"{_NAME} ({kind})")
        d, f = gate.in_features, gate.out_features
        if (up.in_features, up.out_features) != (d, f) or (
            down.in_features,
            down.out_features,
        ) != (f, d):
            raise ValueError(
                f"{_NAME}: {kind} is not a gated MLP D -> F -> D: {self.gate} is {d}->{f}, "
                f"{self.up} is {up.in_features}->{up.out_features}, {self.down} is "
                f"{down.in_features}->{down.out_features}"
            )
        if f % ws:
            raise ValueError(
                f"{_NAME}: the intermediate size {f} is not divisible by the tp size {ws}"
            )
        lins = [(self.gate, gate), (self.up, up), (self.down, down)]
        check_linears(_NAME, kind, lins)

    @checked_entry(_NAME, lambda self, module, mesh: self._apply_fields(module, mesh))
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        check_tp_mesh(_NAME, device_mesh)
        self._check_module(module, device_mesh.size())
        gate, up, down = self._linears(module)
        layout = (
            (gate, "weight", Shard(0)),
            (gate, "bias", Shard(0)),
            (up, "weight", Shard(0)),
            (up, "bias", Shard(0)),
            (down, "weight", Shard(1)),
            (down, "bias", Replicate()),
        )
        distribute_linears(layout, device_mesh, getattr(self, "src_data_rank", 0))
        group = device_mesh.get_group()
        plan = _GatedPlan(
            self.gate, self.up, self.down, self.sequence_dim, self.impl, self.chunks, group,
            type(module).__name__,
        )  # fmt: skip
        install_forward(module, LAYER, plan, _make_forward, prefix="MC2Gated")
        return module
