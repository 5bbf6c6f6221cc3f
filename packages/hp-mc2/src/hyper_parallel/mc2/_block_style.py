"""The one ``ParallelStyle`` of an MLP block, parametrised by its input projections:
:class:`BlockStyle`. :class:`~hyper_parallel.mc2.MC2GatedMLPParallel` (gate and up,
``down(act_fn(gate(x)) * up(x))``) and :class:`~hyper_parallel.mc2.MC2MLPParallel` (up alone,
``down(act(up(x)))``) are its subclasses: each only names its constructor's options and how it
finds the module's children and activation.

Applying a block style checks the options, the mesh and the module's linears (all before any
collective), makes the weights DTensors (each input projection's weight and bias ``Shard(0)``,
down's weight ``Shard(1)`` and bias ``Replicate()``) and installs, with hp-dtensor's
``rewrite``, a forward that runs the block engine (:func:`~hyper_parallel.mc2._block.run_block`)
on this rank's sequence block. The module keeps its class, children and parameter names; the
parameters are new DTensor ``Parameter`` objects, as with torch's own styles.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from hyper_parallel.dtensor import check_rank_order
from hyper_parallel.dtensor.consistency import checked_entry
from hyper_parallel.dtensor.rewrite import install_forward, is_parallelized, parallel_state
from hyper_parallel.mc2._block import block_fields, cast_block, run_block
from hyper_parallel.mc2._operands import check_chunks, dtype_name
from hyper_parallel.mc2.activation import check_elementwise_activation
from hyper_parallel.mc2.impls import check_impl_choice
from hyper_parallel.mc2.linear import check_sequence_dim

__all__ = ["BlockPlan", "BlockStyle", "apply_fields"]

Act = str | Callable[..., Any]  # an attribute name of the module, or the activation itself


@dataclass(frozen=True)
class BlockPlan:
    """What a parallelized MLP block runs: the state hp-dtensor's ``rewrite`` keeps for it
    (under its style's layer name): the input projections' child names (``(gate, up)`` or
    ``(up,)``), down's, the activation, the style's options and the group."""

    inputs: tuple[str, ...]
    down: str
    act: Act
    sequence_dim: int
    impl: str
    chunks: int | None
    group: Any
    module_class: str = ""  # the module's own class name, for messages


def _local(t: Any) -> Any:
    return t.to_local() if isinstance(t, DTensor) else t


def _act_of(module: nn.Module, act: Act) -> Any:
    return getattr(module, act, None) if isinstance(act, str) else act


def _operands(module: nn.Module, plan: BlockPlan) -> tuple[Any, Any, Any, Any]:
    """The local ``(w_in, b_in, W_d, b_d)`` of a parallelized module."""
    ins = [getattr(module, n) for n in plan.inputs]
    down = getattr(module, plan.down)
    w_in, b_in = tuple(_local(p.weight) for p in ins), tuple(_local(p.bias) for p in ins)
    return w_in, b_in, _local(down.weight), _local(down.bias)


def _forward_fields(module: nn.Module, x: Any, layer: str) -> dict[str, Any]:
    """What the ranks compare before the forward's first collective (``checked_entry``'s
    ``extra``): the input block, ``sequence_dim`` and
    :func:`~hyper_parallel.mc2._block.block_fields` on its rows."""
    plan = cast(BlockPlan, parallel_state(module, layer))
    w_in, b_in, wd, bd = _operands(module, plan)
    fields: dict[str, Any] = {"input": x, "sequence_dim": plan.sequence_dim}
    rows, act = rows_of(x, plan.sequence_dim), _act_of(module, plan.act)
    fields.update(block_fields(rows, w_in, b_in, wd, bd, plan.group, act, plan.impl, plan.chunks))
    return fields


def _forward(module: nn.Module, x: torch.Tensor, layer: str, name: str) -> torch.Tensor:
    """The parallel forward: ``x`` ``[..., S_local, ..., D]`` (this rank's block, sequence at
    ``sequence_dim``) -> ``[..., S_local, ..., D]``, this rank's block of the output."""
    plan = cast(BlockPlan, parallel_state(module, layer))
    w_in, b_in, wd, bd = _operands(module, plan)
    if isinstance(x, torch.Tensor):  # under autocast: the dtypes F.linear would compute in
        x, w_in, b_in, wd, bd = cast_block(x, w_in, b_in, wd, bd)
    seq = check_input(x, w_in[0], plan.sequence_dim, name)
    act = _act_of(module, plan.act)
    return on_rows(
        x,
        seq,
        lambda rows: run_block(rows, w_in, b_in, wd, bd, plan.group, act, plan.impl, plan.chunks),
    )


def apply_fields(args: Any) -> dict[str, Any]:
    """What the ranks compare before the weights are distributed (``checked_entry``'s ``extra``
    of :meth:`BlockStyle._shard_and_install`, over ``device_mesh``): the style (its repr: every
    option), the module's class and, per role, the child's name, weight and bias."""
    style, module = args.self, args.module
    fields: dict[str, Any] = {"style": repr(style), "module": type(module).__name__}
    inputs, down, _ = style.resolve(module)
    for role, name in zip((*style._roles, "down"), (*inputs, down)):
        child = module._modules.get(name)
        fields[role] = (name, getattr(child, "weight", None), getattr(child, "bias", None))
    fields["src_data_rank"] = getattr(style, "src_data_rank", 0)
    fields["world_size"] = args.device_mesh.size()
    return fields


class BlockStyle(ParallelStyle):
    """Tensor + sequence parallel MLP block whose input projections are ``_roles``
    (``("gate", "up")`` or ``("up",)``), then an activation, then ``down``, as one pipeline
    over row chunks (:mod:`hyper_parallel.mc2._block`).

    A subclass sets the class attributes below, takes its options in ``__init__`` (calling
    :meth:`_set_options`), and defines :meth:`_options` (its repr), :meth:`resolve` (the
    module's children and activation) and :meth:`_no_act`, and
    ``_apply = checked_entry(<name>, group="device_mesh", extra=apply_fields)(
    BlockStyle._shard_and_install)``.
    """

    #: the style's name in messages and consistency checks (its class name)
    _style: ClassVar[str]
    #: the input projections, in the block's order
    _roles: ClassVar[tuple[str, ...]]
    #: what the module must be, in the shape check's message ("a gated MLP", "an MLP")
    _kind: ClassVar[str]
    #: hp-dtensor ``rewrite``: the layer name and the prefix of the rewritten class's name
    _layer: ClassVar[str]
    _prefix: ClassVar[str]
    #: refuse a module with an active ``nn.Dropout`` child (the parallel forward has none)
    _refuse_dropout: ClassVar[bool] = False

    sequence_dim: int
    impl: str
    chunks: int | None

    def _set_options(self, sequence_dim: int, impl: str, chunks: int | None) -> None:
        check_style_options(self._style, sequence_dim, impl, chunks)
        self.sequence_dim, self.impl, self.chunks = sequence_dim, impl, chunks

    def _options(self) -> list[tuple[str, str]]:
        """The subclass's own options, ``(name, repr of its value)``, first in the repr."""
        raise NotImplementedError

    def resolve(self, module: nn.Module) -> tuple[tuple[str, ...], str, Act]:
        """``(input projections, down, activation)`` this style uses on ``module``: child
        names, and the activation's attribute name or the activation itself."""
        raise NotImplementedError

    def _no_act(self, kind: str, act: Act) -> str:
        """The message for a module without the activation ``act``."""
        raise NotImplementedError

    def __repr__(self) -> str:
        opts = "".join(f"{k}={v}, " for k, v in self._options())
        return (
            f"{self._style}({opts}sequence_dim={self.sequence_dim}, impl={self.impl!r}, "
            f"chunks={self.chunks})"
        )

    def _linears(self, module: nn.Module, named: list[tuple[str, str]]) -> list[nn.Linear]:
        """The ``nn.Linear`` children ``named`` (``(role, child name)``), else a clear error."""
        kind = type(module).__name__
        children = [n for n, _ in module.named_children()]
        found = []
        for role, name in named:
            child = module._modules.get(name)
            if child is None:
                raise ValueError(
                    f"{self._style}: {kind} has no {role} submodule {name!r} (its children: "
                    f"{children}); pass {role}=<name> for modules that name it otherwise"
                )
            if not isinstance(child, nn.Linear):
                raise TypeError(
                    f"{self._style}: {kind}.{name} ({role}) must be an nn.Linear, got "
                    f"{type(child).__name__}"
                )
            found.append(child)
        return found

    def _check_module(
        self, module: nn.Module, ws: int
    ) -> tuple[list[nn.Linear], tuple[tuple[str, ...], str, Act]]:
        """Everything that can fail, before distribute_tensor communicates: the linears (the
        input projections, then down) and what :meth:`resolve` gave."""
        name = self._style
        if is_parallelized(module):  # a rewrite's class is a direct subclass of the module's own
            own = type(module).__bases__[0].__name__
            raise RuntimeError(f"{name}: this {own} is already parallelized")
        kind = type(module).__name__
        inputs, down_name, act_name = self.resolve(module)
        named = [*zip(self._roles, inputs), ("down", down_name)]
        lins = self._linears(module, named)
        act = _act_of(module, act_name)
        if act is None:
            raise ValueError(self._no_act(kind, act_name))
        check_elementwise_activation(act, f"{name} ({kind})")
        for child_name, child in module.named_children():
            if self._refuse_dropout and isinstance(child, nn.Dropout) and child.p > 0:
                raise ValueError(
                    f"{name}: {kind}.{child_name} is a dropout (p={child.p}); the parallel "
                    "forward is down(act(up(x))) without dropout"
                )
        d, f = lins[0].in_features, lins[0].out_features
        shapes = [(lin.in_features, lin.out_features) for lin in lins]
        if any(s != (d, f) for s in shapes[:-1]) or shapes[-1] != (f, d):
            which = ", ".join(f"{n} is {i}->{o}" for (_, n), (i, o) in zip(named, shapes))
            raise ValueError(f"{name}: {kind} is not {self._kind} D -> F -> D: {which}")
        if f % ws:
            raise ValueError(
                f"{name}: the intermediate size {f} is not divisible by the tp size {ws}"
            )
        check_linears(name, kind, [(n, lin) for (_, n), lin in zip(named, lins)])
        return lins, (inputs, down_name, act_name)

    def _shard_and_install(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        check_tp_mesh(self._style, device_mesh)
        lins, (inputs, down_name, act) = self._check_module(module, device_mesh.size())
        layout: list[tuple[nn.Linear, str, Placement]] = [
            (lin, pname, Shard(0)) for lin in lins[:-1] for pname in ("weight", "bias")
        ]
        layout += [(lins[-1], "weight", Shard(1)), (lins[-1], "bias", Replicate())]
        distribute_linears(layout, device_mesh, getattr(self, "src_data_rank", 0))
        plan = BlockPlan(
            inputs, down_name, act, self.sequence_dim, self.impl, self.chunks,
            device_mesh.get_group(), type(module).__name__,
        )  # fmt: skip
        install_forward(module, self._layer, plan, self._make_forward, prefix=self._prefix)
        return module

    @classmethod
    def _make_forward(cls, original: type) -> Any:
        """The parallel forward of a parallelized ``original`` (built once per class by
        hp-dtensor's rewrite), its consistency check declared once, named after the class."""
        layer, name = cls._layer, cls._style

        def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
            return _forward(self, x, layer, name)

        return checked_entry(
            f"{name} ({original.__name__})",
            group=lambda a: cast(BlockPlan, parallel_state(a.self, layer)).group,
            extra=lambda a: _forward_fields(a.self, a.x, layer),
        )(forward)


def check_style_options(where: str, sequence_dim: Any, impl: Any, chunks: Any) -> None:
    """A block style's ``sequence_dim``, ``impl`` and ``chunks`` (its constructor's checks)."""
    check_sequence_dim(sequence_dim)
    check_impl_choice(impl, where)
    check_chunks(chunks, where)


def check_tp_mesh(where: str, device_mesh: Any) -> None:
    """A 1-D tensor-parallel mesh in rank order, else ``ValueError`` (before any collective)."""
    if not isinstance(device_mesh, DeviceMesh) or device_mesh.ndim != 1:
        what = (
            f"a {device_mesh.ndim}-D mesh"
            if isinstance(device_mesh, DeviceMesh)
            else type(device_mesh).__name__
        )
        raise ValueError(f"{where} needs a 1-D tensor-parallel mesh (e.g. mesh['tp']), got {what}")
    check_rank_order(device_mesh)


def check_linears(where: str, kind: str, linears: list[tuple[str, nn.Linear]]) -> None:
    """Every weight and bias of ``linears`` (``(child name, linear)``, the first the reference)
    a plain tensor on the first weight's device, in its dtype."""
    ref_name, ref = linears[0][0], linears[0][1].weight
    for lname, lin in linears:
        for pname in ("weight", "bias"):
            p = getattr(lin, pname)
            if p is None:
                continue
            if isinstance(p, DTensor):
                raise ValueError(f"{where}: {kind}.{lname}.{pname} is already a DTensor")
            if p.device != lin.weight.device or p.device != ref.device:
                raise ValueError(
                    f"{where}: {kind}.{lname}.{pname} is on {p.device} but "
                    f"{ref_name}.weight is on {ref.device}; move the module to one device"
                )
            if p.dtype != ref.dtype:
                raise TypeError(
                    f"{where}: {kind}.{lname}.{pname} is {dtype_name(p.dtype)} but "
                    f"{ref_name}.weight is {dtype_name(ref.dtype)}"
                )


def distribute_linears(
    layout: Iterable[tuple[nn.Linear, str, Placement]], device_mesh: DeviceMesh, src: int
) -> None:
    """Each ``(linear, "weight"|"bias", placement)`` of ``layout`` made a DTensor
    ``Parameter`` (absent biases skipped), ``src`` the rank whose full tensors are sharded."""
    kwargs: dict[str, Any] = {} if src == 0 else {"src_data_rank": src}
    for lin, pname, placement in layout:
        p = getattr(lin, pname)
        if p is None:
            continue
        dp = distribute_tensor(p.detach(), device_mesh, [placement], **kwargs)
        lin.register_parameter(pname, nn.Parameter(dp, requires_grad=p.requires_grad))


def rows_of(x: Any, sequence_dim: int) -> Any:
    """``x`` ``[..., S_local, ..., D]`` as rows ``[N, D]``, sequence first (for the consistency
    fields)."""
    rows = x.movedim(sequence_dim, 0)
    return rows.reshape(-1, rows.shape[-1])


def on_rows(x: torch.Tensor, seq: int, run: Any) -> torch.Tensor:
    """``run`` on ``x``'s rows, sequence first so each rank's tokens are one contiguous block
    of rows, and its ``[N, D]`` result back in ``x``'s layout."""
    xs = x.movedim(seq, 0)
    lead = xs.shape[:-1]
    y2 = run(xs.reshape(-1, xs.shape[-1]))
    return y2.view(*lead, y2.shape[-1]).movedim(0, seq)


def check_input(x: Any, weight: torch.Tensor, sequence_dim: int, where: str) -> int:
    """Local checks, identical on every rank for same-shaped inputs; the normalised seq dim."""
    if isinstance(x, DTensor):
        raise TypeError(
            f"{where}: the input must be this rank's sequence block as a local tensor "
            f"[B, S/tp, D], got a DTensor with placements {x.placements}; pass x.to_local() "
            "(or the local block you would shard it into)"
        )
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{where}: the input must be a torch.Tensor, got {type(x).__name__}")
    d = x.dim()
    if d < 2 or not -d <= sequence_dim < d or sequence_dim % d == d - 1:
        raise ValueError(
            f"{where}: sequence_dim={sequence_dim} is out of range for a {d}-D input "
            f"{tuple(x.shape)} (the last dim holds the features)"
        )
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"{where}: input has {x.shape[-1]} features but the module's hidden size is "
            f"{weight.shape[1]}"
        )
    if x.dtype != weight.dtype:
        raise TypeError(
            f"{where}: input is {dtype_name(x.dtype)} but the weights are "
            f"{dtype_name(weight.dtype)}; cast the module or the input"
        )
    if x.device != weight.device:
        raise ValueError(f"{where}: input is on {x.device} but the weights are on {weight.device}")
    return sequence_dim % d
