"""``MC2Linear``: an ``nn.Linear`` whose forward can be a sequence+tensor parallel dual."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from hyper_parallel.dtensor.amp import cast_for_autocast
from hyper_parallel.dtensor.consistency import checked_entry
from hyper_parallel.dtensor.rewrite import (
    install_forward,
    is_parallelized,
    parallel_state,
    uninstall_forward,
)
from hyper_parallel.mc2._keywords import impl_keyword
from hyper_parallel.mc2._operands import check_chunks, dtype_name
from hyper_parallel.mc2.functional import _column, _row, dual_fields
from hyper_parallel.mc2.impls import check_impl_choice

__all__ = ["MC2Linear", "MC2Parallel"]

Mode = Literal["column", "row"]
LAYER = "MC2Linear"  # the name MC2Linear's rewrite is installed under (hp-dtensor's rewrite)


@dataclass(frozen=True, init=False)
class MC2Parallel:
    """How an :class:`MC2Linear` runs: ``column`` (sequence-sharded in, feature-sharded out,
    :func:`all_gather_matmul`) or ``row`` (feature-sharded in, sequence-sharded out,
    :func:`matmul_reduce_scatter`) over ``group``, the sequence at ``sequence_dim``, with the
    matmul+collective implementation ``impl`` (``backend=``: its deprecated name)."""

    mode: Mode
    group: Any
    sequence_dim: int = 1
    impl: str = "auto"
    chunks: int | None = None
    #: when set, outputs are wrapped as DTensors on this 1-D mesh (``use_local_output=False``)
    output_mesh: Any = None

    @impl_keyword("MC2Parallel")
    def __init__(
        self,
        mode: Mode,
        group: Any,
        sequence_dim: int = 1,
        impl: str = "auto",
        chunks: int | None = None,
        output_mesh: Any = None,
    ) -> None:
        names = ("mode", "group", "sequence_dim", "impl", "chunks", "output_mesh")
        for name, value in zip(names, (mode, group, sequence_dim, impl, chunks, output_mesh)):
            object.__setattr__(self, name, value)
        self._validate()

    @property
    def backend(self) -> str:
        """Deprecated name of :attr:`impl`."""
        warnings.warn(
            "MC2Parallel.backend is deprecated, use .impl", DeprecationWarning, stacklevel=2
        )
        return self.impl

    def _validate(self) -> None:
        if self.mode not in ("column", "row"):
            raise ValueError(f"mode must be 'column' or 'row', got {self.mode!r}")
        check_sequence_dim(self.sequence_dim)
        check_impl_choice(self.impl)
        check_chunks(self.chunks)


def check_sequence_dim(sequence_dim: Any) -> None:
    if not isinstance(sequence_dim, int) or isinstance(sequence_dim, bool):
        raise TypeError(f"sequence_dim must be an int, got {type(sequence_dim).__name__}")


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.to_local() if isinstance(t, DTensor) else t


class _MC2LinearType(type):
    """``isinstance(m, MC2Linear)`` also holds for any ``nn.Linear`` that carries MC2Linear's
    rewrite (an :class:`MC2ColwiseParallel` / :class:`MC2RowwiseParallel` output, or
    :meth:`MC2Linear.from_linear`): its class is then a cached subclass of its own class
    (hp-dtensor's ``rewrite``), not of ``MC2Linear``."""

    def __instancecheck__(cls, obj: Any) -> bool:
        if type.__instancecheck__(cls, obj):
            return True
        return cls is MC2Linear and isinstance(obj, nn.Module) and is_parallelized(obj, LAYER)


class MC2Linear(nn.Linear, metaclass=_MC2LinearType):
    """``nn.Linear`` that, once given an :class:`MC2Parallel` (usually by
    :class:`MC2ColwiseParallel` / :class:`MC2RowwiseParallel`), runs as a fused/overlapped
    sequence+tensor parallel layer. Without one it computes exactly ``nn.Linear``.

    Column mode: input ``[..., S/ws, ..., in]`` (sequence-sharded), output
    ``[..., S, ..., out/ws]``. Row mode: input ``[..., S, ..., in/ws]``, output
    ``[..., S/ws, ..., out]``. The weight (and bias) are this rank's shards, as plain tensors
    or DTensors.

    The parallel forward is installed with hp-dtensor's ``rewrite`` (``install_forward``, the
    :class:`MC2Parallel` as its state): the module's class becomes a cached subclass of its own
    class (``MC2Linear`` for an ``nn.Linear``), ``isinstance(module, MC2Linear)`` holds, a deep
    copy shares the config (and so the process group), and
    :func:`~hyper_parallel.mc2.unparallelize_mc2` undoes it.

    Consistency mode (hp-dtensor's README, "Ranks that disagree"): the ranks of the group
    compare the input (this rank's block), ``mode``, ``sequence_dim``, the weight and bias
    shards, the chosen ``impl``, the chunk count and the group size (a DTensor input that must
    be redistributed first: with its placements, before the redistribution).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: Any = None,
        dtype: Any = None,
        *,
        parallel: MC2Parallel | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        if parallel is not None:
            _install(self, parallel)

    @property
    def mc2(self) -> MC2Parallel | None:
        """The :class:`MC2Parallel` this module runs with (``None``: plain ``nn.Linear``)."""
        return cast("MC2Parallel | None", parallel_state(self, LAYER))

    @classmethod
    def from_linear(cls, linear: nn.Linear, parallel: MC2Parallel | None = None) -> MC2Linear:
        """Make ``linear`` an ``MC2Linear`` in place (same object, same ``Parameter`` objects,
        hooks kept) running ``parallel`` (``None``: still exactly ``nn.Linear``), replacing the
        config it ran with before, and return it."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(
                f"MC2Linear.from_linear needs an nn.Linear, got {type(linear).__name__}"
            )
        if is_parallelized(linear, LAYER):
            if parallel is None:
                return cast(MC2Linear, linear)
            uninstall_forward(linear, LAYER)
        elif type.__instancecheck__(MC2Linear, linear) and parallel is None:
            return cast(MC2Linear, linear)
        _install(linear, parallel)
        return cast(MC2Linear, linear)

    def extra_repr(self) -> str:
        return _extra_repr(self)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _forward(self, input)


def _install(module: nn.Linear, parallel: MC2Parallel | None) -> None:
    members = {"extra_repr": _extra_repr}
    install_forward(module, LAYER, parallel, _make_forward, prefix="MC2", members=members)


def _make_forward(original: type) -> Any:
    return _forward


def _extra_repr(module: nn.Linear) -> str:
    base = nn.Linear.extra_repr(module)
    cfg = cast("MC2Parallel | None", parallel_state(module, LAYER))
    if cfg is None:
        return base
    return (
        f"{base}, mode={cfg.mode}, sequence_dim={cfg.sequence_dim}, impl={cfg.impl}, "
        f"chunks={cfg.chunks}"
    )


def _forward(self: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    """The forward of an :class:`MC2Linear`: ``nn.Linear``'s without a config, else the
    column/row dual over the config's group (checked once, see :func:`_entry`)."""
    cfg = cast("MC2Parallel | None", parallel_state(self, LAYER))
    if cfg is None:
        return F.linear(input, self.weight, self.bias)
    return _entry(cfg.mode)(self, input)


@functools.cache
def _entry(mode: str) -> Callable[[nn.Linear, torch.Tensor], torch.Tensor]:
    """The parallel forward of ``mode``, its consistency check declared once (named
    ``MC2Linear (<mode>)``)."""
    return checked_entry(
        f"MC2Linear ({mode})",
        group=lambda a: cast(MC2Parallel, parallel_state(a.self, LAYER)).group,
        extra=lambda a: _fields(a.self, a.input),
    )(_parallel_forward)


def _target(x: DTensor, cfg: MC2Parallel) -> Shard | None:
    """The placement a DTensor input is brought to (``None``: no valid one; the body raises)."""
    d = x.dim()
    if d < 2 or not -d <= cfg.sequence_dim < d:
        return None
    return Shard(cfg.sequence_dim % d) if cfg.mode == "column" else Shard(d - 1)


def _block_of(x: DTensor, want: Shard | None) -> torch.Tensor:
    """This rank's block of ``x`` once redistributed to ``want``, without communicating: a
    zero-stride stand-in of that shape (``torch.chunk`` sizes, as DTensor shards)."""
    local = x.to_local()
    if want is None or tuple(x.placements) == (want,) or x.device_mesh.ndim != 1:
        return local
    shape = list(x.shape)
    n, ws, r = shape[want.dim], x.device_mesh.size(), x.device_mesh.get_local_rank()
    full = -(-n // ws)
    shape[want.dim] = max(0, min(n, full * (r + 1)) - full * r)
    return local.new_zeros(()).expand(shape)


def _fields(self: nn.Linear, input: Any) -> dict[str, Any]:
    """What the ranks compare before the forward's first collective (a redistribution of a
    DTensor input included; ``checked_entry``'s ``extra``): the input as given (with its
    placements), ``mode``, ``sequence_dim``, and the dual's fields on this rank's 2-D rows."""
    cfg = cast(MC2Parallel, parallel_state(self, LAYER))
    fields: dict[str, Any] = {
        "input": input, "mode": cfg.mode, "sequence_dim": cfg.sequence_dim,
    }  # fmt: skip
    x = input
    if isinstance(x, DTensor):
        fields["placements"] = tuple(x.placements)
        x = _block_of(x, _target(x, cfg))
    x = x.movedim(cfg.sequence_dim, 0)
    x = x.reshape(-1, x.shape[-1])
    op = "all_gather_matmul" if cfg.mode == "column" else "matmul_reduce_scatter"
    weight, bias = _local(self.weight), _local(self.bias)
    fields.update(dual_fields(op, x, weight, cfg.group, bias, cfg.impl, cfg.chunks))
    return fields


def _parallel_forward(self: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    cfg = cast(MC2Parallel, parallel_state(self, LAYER))
    x = input
    if isinstance(x, DTensor):
        # Bring a DTensor input to the layout this mode consumes, then work on its shard.
        want = _target(x, cfg)
        if want is not None and tuple(x.placements) != (want,):
            x = x.redistribute(placements=[want])
        x = x.to_local()
    weight, bias = _local(self.weight), _local(self.bias)
    assert weight is not None
    # under autocast: the dtypes F.linear would compute in (see hyper_parallel.dtensor.amp)
    x, weight, bias = cast_for_autocast(x.device.type, x, weight, bias)
    ws = dist.get_world_size(cfg.group)
    seq = _check_input(x, weight, bias, cfg, ws)
    # Sequence first, so flattening puts each rank's tokens in one contiguous row block.
    xs = x.movedim(seq, 0)
    lead = xs.shape[:-1]
    x2 = xs.reshape(-1, xs.shape[-1])
    if cfg.mode == "column":
        y2 = _column(x2, weight, cfg.group, bias, cfg.impl, cfg.chunks)
        out_lead = (lead[0] * ws, *lead[1:])
    else:
        y2 = _row(x2, weight, cfg.group, bias, cfg.impl, cfg.chunks)
        out_lead = (lead[0] // ws, *lead[1:])
    y = y2.view(*out_lead, y2.shape[-1]).movedim(0, seq)
    if cfg.output_mesh is not None:
        placement = Shard(y.dim() - 1) if cfg.mode == "column" else Shard(seq)
        y = DTensor.from_local(y, cfg.output_mesh, [placement], run_check=False)
    return y


def _check_input(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cfg: MC2Parallel,
    ws: int,
) -> int:
    """Local checks the same on every rank, before any communication; returns the
    normalised sequence dim."""
    if x.dim() < 2:
        raise ValueError(
            f"MC2Linear ({cfg.mode}) needs an input with a sequence dim and a feature dim, "
            f"got shape {tuple(x.shape)}"
        )
    d = x.dim()
    if not -d <= cfg.sequence_dim < d or cfg.sequence_dim % d == d - 1:
        raise ValueError(
            f"sequence_dim={cfg.sequence_dim} is out of range for a {x.dim()}-D input "
            f"{tuple(x.shape)} (the last dim holds the features)"
        )
    seq = cfg.sequence_dim % x.dim()
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"MC2Linear ({cfg.mode}): input has {x.shape[-1]} features but the local weight "
            f"is {tuple(weight.shape)} ([out, in])"
        )
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != x.dtype):
        raise TypeError(
            f"MC2Linear ({cfg.mode}): input is {dtype_name(x.dtype)} but the weight/bias "
            f"are {dtype_name(weight.dtype)}; cast the module or the input"
        )
    if cfg.mode == "row" and x.shape[seq] % ws:
        raise ValueError(
            f"MC2Linear (row): sequence length {x.shape[seq]} (dim {seq}) is not divisible "
            f"by the tensor-parallel size {ws}"
        )
    return seq
