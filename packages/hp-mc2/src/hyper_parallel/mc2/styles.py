"""``ParallelStyle``s for torch's ``parallelize_module``: drop-in replacements for the
``ColwiseParallel(input_layouts=Shard(seq))`` + ``RowwiseParallel(output_layouts=Shard(seq))``
pair of sequence parallelism, running :class:`MC2Linear`'s fused/overlapped duals."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import Placement

from hyper_parallel.dtensor import check_rank_order
from hyper_parallel.dtensor.consistency import checked_entry
from hyper_parallel.mc2._keywords import impl_keyword
from hyper_parallel.mc2.linear import MC2Linear, MC2Parallel, Mode, check_sequence_dim

__all__ = ["MC2ColwiseParallel", "MC2RowwiseParallel"]


def _style_fields(args: Any) -> dict[str, Any]:
    """What the ranks compare before the weights are distributed (``checked_entry``'s ``extra``
    of ``_shard_and_install``, over ``device_mesh``): the style, the module's class, its weight
    and bias."""
    style, module = args.self, args.module
    return {
        "style": repr(style), "module": type(module).__name__,
        "weight": getattr(module, "weight", None), "bias": getattr(module, "bias", None),
        "src_data_rank": getattr(style, "src_data_rank", 0), "world_size": args.device_mesh.size(),
    }  # fmt: skip


def _checked_apply(name: str) -> Any:
    return checked_entry(name, group="device_mesh", extra=_style_fields)(
        _MC2Style._shard_and_install
    )


class _MC2Style(ParallelStyle):
    """Consistency mode (hp-dtensor's README, "Ranks that disagree"): applying the style
    compares, over the tp group and before the weights are distributed, the style's options
    (``sequence_dim``, ``impl``, ``chunks``, ``use_local_output``), the module's class and its
    weight and bias; each forward is checked by :class:`MC2Linear`."""

    _mode: Mode

    @impl_keyword("MC2ColwiseParallel / MC2RowwiseParallel")
    def __init__(
        self,
        sequence_dim: int = 1,
        *,
        impl: str = "auto",
        chunks: int | None = None,
        use_local_output: bool = True,
    ) -> None:
        super().__init__()
        check_sequence_dim(sequence_dim)
        # Validate eagerly through the config type so a bad style fails where it is built.
        MC2Parallel(self._mode, None, sequence_dim, impl, chunks)
        self.sequence_dim = sequence_dim
        self.impl = impl
        self.chunks = chunks
        self.use_local_output = use_local_output

    def _placements(self) -> dict[str, Placement]:
        raise NotImplementedError

    def _shard_and_install(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        name = type(self).__name__
        if not isinstance(module, nn.Linear):
            raise TypeError(f"{name} only applies to nn.Linear, got {type(module).__name__}")
        if device_mesh.ndim != 1:
            raise ValueError(
                f"{name} needs a 1-D tensor-parallel mesh, got a {device_mesh.ndim}-D mesh"
            )
        # The gathers concatenate in group-rank order; the sequence blocks and the DTensor
        # shards follow mesh order: the two must agree.
        check_rank_order(device_mesh)
        # Shard the parameters the way torch's own Colwise/Rowwise styles do, so state dicts,
        # optimizers and FSDP see the same DTensor layout.
        kwargs: dict[str, Any] = {}
        src = getattr(self, "src_data_rank", 0)
        if src != 0:
            kwargs["src_data_rank"] = src
        for pname, placement in self._placements().items():
            param = getattr(module, pname)
            if param is None:
                continue
            dist_param = nn.Parameter(
                distribute_tensor(param, device_mesh, [placement], **kwargs),
                requires_grad=param.requires_grad,
            )
            module.register_parameter(pname, dist_param)
        parallel = MC2Parallel(
            self._mode,
            device_mesh.get_group(),
            self.sequence_dim,
            self.impl,
            self.chunks,
            output_mesh=None if self.use_local_output else device_mesh,
        )
        return MC2Linear.from_linear(module, parallel)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(sequence_dim={self.sequence_dim}, impl={self.impl!r}, "
            f"chunks={self.chunks}, use_local_output={self.use_local_output})"
        )


class MC2ColwiseParallel(_MC2Style):
    """Column-parallel ``nn.Linear`` over a sequence-sharded input.

    Input ``[..., S/ws, ..., in]`` sharded on ``sequence_dim`` (a local tensor, or a DTensor
    whose local shard that is); output ``[..., S, ..., out/ws]`` (local unless
    ``use_local_output=False``). Weight and bias become ``Shard(0)`` DTensors. Same result as
    torch's ``ColwiseParallel(input_layouts=Shard(sequence_dim))``, with the all-gather fused
    with (``npu``) or overlapped with (``torch``) the matmul.
    """

    _mode: Mode = "column"
    _apply = _checked_apply("MC2ColwiseParallel")

    def _placements(self) -> dict[str, Placement]:
        return {"weight": Shard(0), "bias": Shard(0)}


class MC2RowwiseParallel(_MC2Style):
    """Row-parallel ``nn.Linear`` producing a sequence-sharded output.

    Input ``[..., S, ..., in/ws]`` (feature-sharded, e.g. a column layer's output); output
    ``[..., S/ws, ..., out]`` sharded on ``sequence_dim``. Weight becomes ``Shard(1)``, bias
    ``Replicate()``. Same result as torch's ``RowwiseParallel(output_layouts=Shard(sequence_dim))``
    with the reduce-scatter fused with / overlapped with the matmul.
    """

    _mode: Mode = "row"
    _apply = _checked_apply("MC2RowwiseParallel")

    def _placements(self) -> dict[str, Placement]:
        return {"weight": Shard(1), "bias": Replicate()}
