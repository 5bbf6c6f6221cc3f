"""A test double of torch_npu's two MC2 kernels, for driving the ``npu`` implementation on CPU.

Same signatures as torch_npu 2.14 (positional ``input, x2, hcom, world_size``, everything
after ``world_size`` keyword-only), the same constraint checks with the same wording as
``hyper_parallel.mc2.npu_constraint_failure``, real gloo communication underneath
(``hcom`` names map back to process groups: hp-dtensor's ``NpuDouble``, its base) and fp32
compute. It is written independently of
the package's checks so a test comparing the two catches drift. Every call is recorded, so
tests can assert which operand was transposed and which keywords were passed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hyper_parallel.dtensor.npu_double import NpuDouble

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_NAMES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float64: "fp64",
}


@dataclass
class Call:
    op: str
    input_shape: tuple[int, ...]
    x2_shape: tuple[int, ...]
    x2_transposed_view: bool
    world_size: int
    kwargs: dict[str, Any]


@dataclass
class GlooMC2Double(NpuDouble):
    """Implements :class:`hyper_parallel.mc2.NpuOps` on CPU tensors over gloo (``available``,
    ``comm_name`` and ``group_of`` from :class:`~hyper_parallel.dtensor.npu_double.NpuDouble`)."""

    sizes: frozenset[int] = frozenset({2, 4, 8})
    device_type: str = "cpu"
    calls: list[Call] = field(default_factory=list)

    def world_sizes(self) -> frozenset[int]:
        return self.sizes

    # --- the kernels -----------------------------------------------------------------------

    def _check(self, op: str, x1: torch.Tensor, x2: torch.Tensor, hcom: str, ws: int) -> Any:
        def fail(msg: str) -> RuntimeError:
            return RuntimeError(f"{op}: {msg}")

        if x1.dim() != 2 or x2.dim() != 2:
            raise fail(f"x1 and x2 must be 2-D, got {x1.dim()}-D and {x2.dim()}-D")
        if x1.dtype not in (torch.float16, torch.bfloat16):
            name = _NAMES.get(x1.dtype, str(x1.dtype))
            raise fail(f"{name} is not supported by the NPU kernels (fp16/bf16 only)")
        if x2.dtype != x1.dtype:
            raise fail(
                f"x is {_NAMES[x1.dtype]} but weight is {_NAMES.get(x2.dtype, x2.dtype)}; "
                "the NPU kernels need equal dtypes"
            )
        if x1.shape[1] != x2.shape[0]:
            raise fail(f"k of x1 {tuple(x1.shape)} and x2 {tuple(x2.shape)} differ")
        if ws not in self.sizes:
            raise fail(f"world size {ws} not in {{{', '.join(map(str, sorted(self.sizes)))}}}")
        k = x1.shape[1]
        if not 256 <= k < 65535:
            raise fail(f"k={k} outside [256, 65535)")
        if not x1.is_contiguous():
            raise fail("x1 must be contiguous (a transposed x1 is not supported)")
        if not (x2.is_contiguous() or x2.t().is_contiguous()):
            raise fail("x2 must be contiguous or a transposed view of a contiguous tensor")
        try:
            group = self.group_of(hcom)
        except KeyError:
            raise fail(f"unknown hcom {hcom!r}") from None
        if dist.get_world_size(group) != ws:
            raise fail(
                f"world_size={ws} but the communicator has {dist.get_world_size(group)} ranks"
            )
        return group

    def npu_all_gather_base_mm(
        self,
        input: torch.Tensor,
        x2: torch.Tensor,
        hcom: str,
        world_size: int,
        *,
        bias: torch.Tensor | None = None,
        x1_scale: torch.Tensor | None = None,
        x2_scale: torch.Tensor | None = None,
        gather_index: int = 0,
        gather_output: bool = True,
        comm_turn: int = 0,
        output_dtype: torch.dtype | None = None,
        comm_mode: str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        op = "npu_all_gather_base_mm"
        kwargs = dict(bias=bias, gather_index=gather_index, gather_output=gather_output)
        self.calls.append(
            Call(
                op, tuple(input.shape), tuple(x2.shape), not x2.is_contiguous(), world_size, kwargs
            )
        )
        group = self._check(op, input, x2, hcom, world_size)
        if bias is not None:
            raise RuntimeError(f"{op}: a non-zero bias is not supported")
        if gather_index != 0 or comm_turn != 0:
            raise RuntimeError(f"{op}: only gather_index=0 and comm_turn=0 are supported")
        gathered = input.new_empty(world_size * input.shape[0], input.shape[1])
        _all_gather(gathered, input, group=group)
        out = (gathered.float() @ x2.float()).to(input.dtype)
        return out, (gathered if gather_output else input.new_empty(0))

    def npu_mm_reduce_scatter_base(
        self,
        input: torch.Tensor,
        x2: torch.Tensor,
        hcom: str,
        world_size: int,
        *,
        reduce_op: str = "sum",
        bias: torch.Tensor | None = None,
        x1_scale: torch.Tensor | None = None,
        x2_scale: torch.Tensor | None = None,
        comm_turn: int = 0,
        output_dtype: torch.dtype | None = None,
        comm_mode: str | None = None,
    ) -> torch.Tensor:
        op = "npu_mm_reduce_scatter_base"
        kwargs = dict(bias=bias, reduce_op=reduce_op)
        self.calls.append(
            Call(
                op, tuple(input.shape), tuple(x2.shape), not x2.is_contiguous(), world_size, kwargs
            )
        )
        group = self._check(op, input, x2, hcom, world_size)
        if input.shape[0] % world_size:
            raise RuntimeError(f"{op}: m={input.shape[0]} not divisible by world size {world_size}")
        if bias is not None:
            raise RuntimeError(f"{op}: a non-zero bias is not supported")
        if reduce_op != "sum" or comm_turn != 0:
            raise RuntimeError(f"{op}: only reduce_op='sum' and comm_turn=0 are supported")
        partial = input.float() @ x2.float()
        out = partial.new_empty(input.shape[0] // world_size, x2.shape[1])
        _reduce_scatter(out, partial, group=group)
        return out.to(input.dtype)
