"""``MC2MLPParallel``: the ``ParallelStyle`` for plain MLP modules (``down(act(up(x)))``:
Hugging Face ``CLIPMLP``/``PhiMLP`` (``fc1``/``fc2`` + ``activation_fn``), ``FalconMLP``/
``GPTNeoXMLP`` (``dense_h_to_4h``/``dense_4h_to_h`` + ``act``), modules with ``up_proj``/
``down_proj`` + ``act_fn`` or nn.Linear ``c_fc``/``c_proj`` + ``act``, and any module with
an up ``nn.Linear``, a per-element activation and a down ``nn.Linear``, named explicitly).

Applied with torch's ``parallelize_module(mlp, tp_mesh, MC2MLPParallel())``: the weights
become DTensors (up ``Shard(0)``, its bias ``Shard(0)``, down ``Shard(1)``, its bias
``Replicate()``) and the module's forward runs :func:`~hyper_parallel.mc2.mlp_block` (one
pipeline over row chunks, forward and backward) on this rank's sequence block. The module
keeps its class, children and parameter names; the parameters are new DTensor ``Parameter``
objects, as with torch's own styles.
"""

from __future__ import annotations

from collections.abc import Callable
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

__all__ = ["MC2MLPParallel"]

_NAME = "MC2MLPParallel"
LAYER = "MC2MLPParallel"  # the name this rewrite is installed under (hp-dtensor's rewrite)

# (up, down, activation attribute), tried in this order when not given explicitly
LAYOUTS: tuple[tuple[str, str, str], ...] = (
    ("up_proj", "down_proj", "act_fn"),
    ("fc1", "fc2", "activation_fn"),
    ("c_fc", "c_proj", "act"),
    ("dense_h_to_4h", "dense_4h_to_h", "act"),
)


@dataclass(frozen=True)
class _MLPPlan:
    """What a parallelized plain MLP runs (hp-dtensor's ``rewrite`` state under
    :data:`LAYER`): the child names, the activation (an attribute name of the module, or a
    callable given to the style), the style's options and the group."""

    up: str
    down: str
    act: str | Callable[..., Any]
    sequence_dim: int
    impl: str
    chunks: int | None
    group: Any
    module_class: str = ""


def _local(t: Any) -> Any:
    return t.to_local() if isinstance(t, DTensor) else t


def _act_of(module: nn.Module, act: str | Callable[..., Any]) -> Any:
    return getattr(module, act, None) if isinstance(act, str) else act


def _make_forward(original: type) -> Any:
    return checked_entry(f"{_NAME} ({original.__name__})", _forward_fields)(_mlp_forward)


def _operands(self: nn.Module, plan: _MLPPlan) -> tuple[Any, Any]:
    up, down = getattr(self, plan.up), getattr(self, plan.down)
    return (_local(up.weight), _local(down.weight)), (_local(up.bias), _local(down.bias))


def _forward_fields(self: nn.Module, x: Any) -> tuple[Any, dict[str, Any]]:
    """What the ranks compare before the forward's first collective: the input block,
    ``sequence_dim`` and :func:`~hyper_parallel.mc2._block.block_fields` on its rows."""
    plan = cast(_MLPPlan, parallel_state(self, LAYER))
    weights, biases = _operands(self, plan)
    fields: dict[str, Any] = {"input": x, "sequence_dim": plan.sequence_dim}
    act = _act_of(self, plan.act)
    rows = rows_of(x, plan.sequence_dim)
    (wu, wd), (bu, bd) = weights, biases
    fields.update(block_fields(rows, (wu,), (bu,), wd, bd, plan.group, act, plan.impl, plan.chunks))
    return plan.group, fields


def _mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The parallel forward: ``x`` ``[..., S_local, ..., D]`` (this rank's block, sequence at
    ``sequence_dim``) -> ``[..., S_local, ..., D]``, this rank's block of the output."""
    plan = cast(_MLPPlan, parallel_state(self, LAYER))
    (wu, wd), (bu, bd) = _operands(self, plan)
    if isinstance(x, torch.Tensor):  # under autocast: the dtypes F.linear would compute in
        x, wu, wd, bu, bd = cast_for_autocast(x.device.type, x, wu, wd, bu, bd)
    seq = check_input(x, wu, plan.sequence_dim, _NAME)
    act = _act_of(self, plan.act)
    return on_rows(
        x,
        seq,
        lambda rows: run_block(rows, (wu,), (bu,), wd, bd, plan.group, act, plan.impl, plan.chunks),
    )


class MC2MLPParallel(ParallelStyle):
    """Tensor + sequence parallel plain MLP ``down(act(up(x)))`` as one pipeline over row
    chunks (:func:`~hyper_parallel.mc2.mlp_block`), forward and backward.

    Input and output: this rank's sequence block as a local tensor, ``[B, S/tp, D]`` with
    ``sequence_dim=1`` (any layout with the sequence at ``sequence_dim`` and features last).
    Rank ``t`` of the tp mesh holds block ``t`` of the sequence.

    ``up`` and ``down`` name the module's ``nn.Linear`` children and ``act`` its activation
    attribute (or is the activation itself, a callable, for modules that call a function
    such as ``F.gelu`` in their forward). Left ``None``, they come from the first of
    :data:`LAYOUTS` whose up and down children the module has: ``up_proj``/``down_proj`` +
    ``act_fn``, ``fc1``/``fc2`` + ``activation_fn``, ``c_fc``/``c_proj`` + ``act``,
    ``dense_h_to_4h``/``dense_4h_to_h`` + ``act``. The activation must be per-element
    (:mod:`hyper_parallel.mc2.activation`); the module's forward must be exactly
    ``down(act(up(x)))`` (a module with an active ``nn.Dropout`` child is refused). ``impl``
    (``backend=``: its deprecated name) and ``chunks`` as in
    :func:`~hyper_parallel.mc2.mlp_block`.

    Output and every gradient equal the serial module on the full sequence; ``dW`` of each
    weight is this rank's shard of the full gradient.

    Consistency mode (``HP_CHECK_CONSISTENCY=1`` or ``consistency_checks()``): applying the
    style compares the style's options, the module's class and its weights' shapes and dtypes
    over the tp group before the weights are distributed; each forward compares the input
    block, ``sequence_dim``, the weight shards, the chosen ``impl``, the chunk count and the
    tp size, in one collective.
    """

    @impl_keyword(_NAME)
    def __init__(
        self,
        *,
        up: str | None = None,
        down: str | None = None,
        act: str | Callable[..., Any] | None = None,
        sequence_dim: int = 1,
        impl: str = "auto",
        chunks: int | None = None,
    ) -> None:
        super().__init__()
        for what, name in (("up", up), ("down", down)):
            if name is not None and (not isinstance(name, str) or not name):
                raise TypeError(f"{_NAME}: {what} must be a submodule name or None, got {name!r}")
        if act is not None and not (isinstance(act, str) and act) and not callable(act):
            raise TypeError(
                f"{_NAME}: act must be an attribute name, a callable or None, got {act!r}"
            )
        check_style_options(_NAME, sequence_dim, impl, chunks)
        self.up, self.down, self.act = up, down, act
        self.sequence_dim, self.impl, self.chunks = sequence_dim, impl, chunks

    def __repr__(self) -> str:
        act = self.act if self.act is None or isinstance(self.act, str) else _describe(self.act)
        return (
            f"{_NAME}(up={self.up!r}, down={self.down!r}, act={act!r}, "
            f"sequence_dim={self.sequence_dim}, impl={self.impl!r}, chunks={self.chunks})"
        )

    def resolve(self, module: nn.Module) -> tuple[str, str, str | Callable[..., Any]]:
        """``(up, down, act)`` this style uses on ``module``: the explicit names, the rest from
        the first matching layout. ``ValueError`` naming the children when none matches."""
        children = module._modules
        for up, down, act in LAYOUTS:
            up, down = self.up or up, self.down or down
            if up in children and down in children:
                return up, down, self.act if self.act is not None else act
        if self.up and self.down:  # explicit, but absent: reported by _linears
            return self.up, self.down, self.act if self.act is not None else "act_fn"
        kind = type(module).__name__
        known = ", ".join(f"{u}/{d} + {a}" for u, d, a in LAYOUTS)
        raise ValueError(
            f"{_NAME}: {kind} has none of the known up/down layouts ({known}); its children: "
            f"{list(children)}; pass up=<name>, down=<name> (and act=<name or callable>)"
        )

    def _linears(self, module: nn.Module, up: str, down: str) -> tuple[nn.Linear, nn.Linear]:
        kind = type(module).__name__
        found = []
        for role, name in (("up", up), ("down", down)):
            child = module._modules.get(name)
            if child is None:
                raise ValueError(
                    f"{_NAME}: {kind} has no {role} submodule {name!r} (its children: "
                    f"{list(module._modules)}); pass {role}=<name>"
                )
            if not isinstance(child, nn.Linear):
                raise TypeError(
                    f"{_NAME}: {kind}.{name} ({role}) must be an nn.Linear, got "
                    f"{type(child).__name__}"
                )
            found.append(child)
        return found[0], found[1]

    def _apply_fields(self, module: nn.Module, mesh: Any) -> tuple[Any, dict[str, Any]] | None:
        if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
            return None
        fields: dict[str, Any] = {"style": repr(self), "module": type(module).__name__}
        try:
            up, down, _ = self.resolve(module)
        except ValueError:  # rejected by the body, after the comparison
            up = down = ""
        for role, name in (("up", up), ("down", down)):
            child = module._modules.get(name)
            fields[role] = (name, getattr(child, "weight", None), getattr(child, "bias", None))
        fields["src_data_rank"] = getattr(self, "src_data_rank", 0)
        fields["world_size"] = mesh.size()
        return mesh.get_group(), fields

    def _check_module(self, module: nn.Module, ws: int) -> tuple[nn.Linear, nn.Linear, Any]:
        """Everything that can fail, before distribute_tensor communicates."""
        if is_parallelized(module):
            own = type(module).__bases__[0].__name__
            raise RuntimeError(f"{_NAME}: this {own} is already parallelized")
        kind = type(module).__name__
        up_name, down_name, act_name = self.resolve(module)
        up, down = self._linears(module, up_name, down_name)
        act = _act_of(module, act_name)
        if act is None:
            raise ValueError(
                f"{_NAME}: {kind} has no activation attribute {act_name!r}; pass act=<name> or "
                "act=<the activation>"
            )
        check_elementwise_activation(act, f"{_NAME} ({kind})")
        for name, child in module.named_children():
            if isinstance(child, nn.Dropout) and child.p > 0:
                raise ValueError(
                    f"{_NAME}: {kind}.{name} is a dropout (p={child.p}); the parallel forward is "
                    "down(act(up(x))) without dropout"
                )
        d, f = up.in_features, up.out_features
        if (down.in_features, down.out_features) != (f, d):
            raise ValueError(
                f"{_NAME}: {kind} is not an MLP D -> F -> D: {up_name} is {d}->{f}, "
                f"{down_name} is {down.in_features}->{down.out_features}"
            )
        if f % ws:
            raise ValueError(
                f"{_NAME}: the intermediate size {f} is not divisible by the tp size {ws}"
            )
        check_linears(_NAME, kind, [(up_name, up), (down_name, down)])
        return up, down, act_name

    @checked_entry(_NAME, lambda self, module, mesh: self._apply_fields(module, mesh))
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        check_tp_mesh(_NAME, device_mesh)
        up, down, act = self._check_module(module, device_mesh.size())
        up_name, down_name, _ = self.resolve(module)
        layout = (
            (up, "weight", Shard(0)),
            (up, "bias", Shard(0)),
            (down, "weight", Shard(1)),
            (down, "bias", Replicate()),
        )
        distribute_linears(layout, device_mesh, getattr(self, "src_data_rank", 0))
        plan = _MLPPlan(
            up_name, down_name, act, self.sequence_dim, self.impl, self.chunks,
            device_mesh.get_group(), type(module).__name__,
        )  # fmt: skip
        install_forward(module, LAYER, plan, _make_forward, prefix="MC2MLP")
        return module


def _describe(act: Any) -> str:
    return repr(act) if isinstance(act, nn.Module) else getattr(act, "__qualname__", repr(act))
