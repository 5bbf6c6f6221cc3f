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
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from hyper_parallel.dtensor import check_rank_order
from hyper_parallel.dtensor.amp import cast_for_autocast
from hyper_parallel.dtensor.consistency import checked_entry
from hyper_parallel.dtensor.rewrite import install_forward, is_parallelized, parallel_state
from hyper_parallel.mc2._keywords import impl_keyword
from hyper_parallel.mc2.activation import check_elementwise_activation
from hyper_parallel.mc2.backend import BACKENDS, dtype_name
from hyper_parallel.mc2.gated import gated_fields, run_gated_mlp
from hyper_parallel.mc2.linear import check_sequence_dim

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
    ``sequence_dim`` and :func:`~hyper_parallel.mc2.gated.gated_fields` on its rows."""
    plan = cast(_GatedPlan, parallel_state(self, LAYER))
    weights, biases = _operands(self, plan)
    fields: dict[str, Any] = {"input": x, "sequence_dim": plan.sequence_dim}
    rows = rows_of(x, plan.sequence_dim)
    act = getattr(self, "act_fn", None)
    fields.update(gated_fields(rows, weights, biases, plan.group, act, plan.impl, plan.chunks))
    return plan.group, fields


def _gated_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The parallel forward: ``x`` ``[..., S_local, ..., D]`` (this rank's block, sequence at
    ``sequence_dim``) -> ``[..., S_local, ..., D]``, this rank's block of the output."""
    plan = cast(_GatedPlan, parallel_state(self, LAYER))
    (wg, wu, wd), (bg, bu, bd) = _operands(self, plan)
    if isinstance(x, torch.Tensor):  # under autocast: the dtypes F.linear would compute in
        x, wg, wu, wd, bg, bu, bd = cast_for_autocast(x.device.type, x, wg, wu, wd, bg, bu, bd)
    seq = check_input(x, wg, plan.sequence_dim)
    act = cast(Any, self.act_fn)
    return on_rows(
        x,
        seq,
        lambda rows: run_gated_mlp(
            rows, (wg, wu, wd), (bg, bu, bd), plan.group, act, plan.impl, plan.chunks
        ),
    )


def rows_of(x: Any, sequence_dim: int) -> Any:
    """``x`` ``[..., S_local, ..., D]`` as rows ``[N, D]``, sequence first (for the consistency
    fields; ``x`` itself where the body will reject it)."""
    try:
        rows = x.movedim(sequence_dim, 0)
        return rows.reshape(-1, rows.shape[-1])
    except Exception:  # rejected by the body, after the comparison
        return x


def on_rows(x: torch.Tensor, seq: int, run: Any) -> torch.Tensor:
    """``run`` on ``x``'s rows, sequence first so each rank's tokens are one contiguous block
    of rows, and its ``[N, D]`` result back in ``x``'s layout."""
    xs = x.movedim(seq, 0)
    lead = xs.shape[:-1]
    y2 = run(xs.reshape(-1, xs.shape[-1]))
    return y2.view(*lead, y2.shape[-1]).movedim(0, seq)


def check_input(x: Any, weight: torch.Tensor, sequence_dim: int, where: str = _NAME) -> int:
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
        check_sequence_dim(sequence_dim)
        if impl not in BACKENDS:
            raise ValueError(f"{_NAME}: impl must be one of {BACKENDS}, got {impl!r}")
        if chunks is not None and (
            not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1
        ):
            raise ValueError(f"{_NAME}: chunks must be a positive int or None, got {chunks!r}")
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
        ref = gate.weight
        for lname, lin in ((self.gate, gate), (self.up, up), (self.down, down)):
            for pname in ("weight", "bias"):
                p = getattr(lin, pname)
                if p is None:
                    continue
                if isinstance(p, DTensor):
                    raise ValueError(f"{_NAME}: {kind}.{lname}.{pname} is already a DTensor")
                if p.device != lin.weight.device or p.device != ref.device:
                    raise ValueError(
                        f"{_NAME}: {kind}.{lname}.{pname} is on {p.device} but "
                        f"{self.gate}.weight is on {ref.device}; move the module to one device"
                    )
                if p.dtype != ref.dtype:
                    raise TypeError(
                        f"{_NAME}: {kind}.{lname}.{pname} is {dtype_name(p.dtype)} but "
                        f"{self.gate}.weight is {dtype_name(ref.dtype)}"
                    )

    @checked_entry(_NAME, lambda self, module, mesh: self._apply_fields(module, mesh))
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(device_mesh, DeviceMesh) or device_mesh.ndim != 1:
            what = (
                f"a {device_mesh.ndim}-D mesh"
                if isinstance(device_mesh, DeviceMesh)
                else (type(device_mesh).__name__)
            )
            raise ValueError(
                f"{_NAME} needs a 1-D tensor-parallel mesh (e.g. mesh['tp']), got {what}"
            )
        check_rank_order(device_mesh)
        self._check_module(module, device_mesh.size())
        gate, up, down = self._linears(module)
        src = getattr(self, "src_data_rank", 0)
        kwargs: dict[str, Any] = {} if src == 0 else {"src_data_rank": src}
        layout = (
            (gate, "weight", Shard(0)),
            (gate, "bias", Shard(0)),
            (up, "weight", Shard(0)),
            (up, "bias", Shard(0)),
            (down, "weight", Shard(1)),
            (down, "bias", Replicate()),
        )
        for lin, pname, placement in layout:
            p = getattr(lin, pname)
            if p is None:
                continue
            dp = distribute_tensor(p.detach(), device_mesh, [placement], **kwargs)
            lin.register_parameter(pname, nn.Parameter(dp, requires_grad=p.requires_grad))
        group = device_mesh.get_group()
        plan = _GatedPlan(
            self.gate, self.up, self.down, self.sequence_dim, self.impl, self.chunks, group,
            type(module).__name__,
        )  # fmt: skip
        install_forward(module, LAYER, plan, _make_forward, prefix="MC2Gated")
        return module
