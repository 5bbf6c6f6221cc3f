"""Which backend runs a call, and why: input validation and the NPU kernel constraints."""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hyper_parallel.mc2._keywords import impl_keyword
from hyper_parallel.mc2.npu_ops import NpuOps, current_npu_ops

__all__ = ["BACKENDS", "OPS", "default_chunks", "npu_constraint_failure", "select_backend"]

BACKENDS = ("auto", "torch", "npu")
OPS = ("all_gather_matmul", "matmul_reduce_scatter")
Op = Literal["all_gather_matmul", "matmul_reduce_scatter"]

K_MIN, K_MAX = 256, 65535  # contraction dim range of both MC2 kernels: [256, 65535)
_NPU_DTYPES = (torch.float16, torch.bfloat16)
_DTYPE_NAMES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float64: "fp64",
}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def _world_size(group: Any) -> int:
    return dist.get_world_size(group)


def validate_operands(
    op: Op,
    x: Any,
    weight: Any,
    bias: Any,
    world_size: int,
    backend: str,
    chunks: int | None,
) -> None:
    """Raise a clear error for inputs no backend can run. Purely local and the same on every
    rank when every rank passes same-shaped operands, so it runs before any communication."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if backend not in BACKENDS:
        raise ValueError(f"impl must be one of {BACKENDS}, got {backend!r}")
    if chunks is not None and (
        not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1
    ):
        raise ValueError(f"chunks must be a positive int or None, got {chunks!r}")
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if isinstance(t, DTensor):
            raise TypeError(
                f"{op}: {name} is a DTensor; the functional forms take this rank's local "
                f"tensors (pass {name}.to_local())"
            )
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{op}: {name} must be 2-D, got shape {tuple(t.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{op}: x must be a floating tensor, got {x.dtype}")
    if weight.dtype != x.dtype:
        raise TypeError(
            f"{op}: x is {dtype_name(x.dtype)} but weight is {dtype_name(weight.dtype)}; "
            "x, weight and bias must share one dtype"
        )
    if x.device != weight.device:
        raise ValueError(f"{op}: x is on {x.device} but weight is on {weight.device}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"{op}: inner dims differ: x is {tuple(x.shape)} ([m, k]) but weight is "
            f"{tuple(weight.shape)} ([n, k] in nn.Linear layout)"
        )
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"{op}: bias must be a torch.Tensor or None, got {type(bias).__name__}")
        which = "local shard [n_local]" if op == "all_gather_matmul" else "full, replicated [n]"
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(
                f"{op}: bias must be the {which} = ({weight.shape[0]},), got {tuple(bias.shape)}"
            )
        if bias.dtype != x.dtype:
            raise TypeError(
                f"{op}: x is {dtype_name(x.dtype)} but bias is {dtype_name(bias.dtype)}; "
                "x, weight and bias must share one dtype"
            )
        if bias.device != weight.device:
            raise ValueError(f"{op}: bias is on {bias.device} but weight is on {weight.device}")
    if op == "matmul_reduce_scatter" and x.shape[0] % world_size != 0:
        raise ValueError(
            f"{op}: m={x.shape[0]} rows are not divisible by the group size {world_size} "
            "(the reduce-scatter splits m evenly)"
        )


def npu_constraint_failure(
    op: Op, x: torch.Tensor, weight: torch.Tensor, world_size: int, ops: NpuOps | None = None
) -> str | None:
    """``None`` when the torch_npu MC2 kernels can run ``op`` forward and backward, else the
    first constraint that fails, worded like the kernels' own checks."""
    ops = ops or current_npu_ops()
    if x.device.type != ops.device_type:
        return f"tensors are on {x.device.type}, not {ops.device_type}"
    unavailable = ops.available()
    if unavailable:
        return unavailable
    if x.dtype not in _NPU_DTYPES:
        return f"{dtype_name(x.dtype)} is not supported by the NPU kernels (fp16/bf16 only)"
    if weight.dtype != x.dtype:
        return (
            f"x is {dtype_name(x.dtype)} but weight is {dtype_name(weight.dtype)}; "
            "the NPU kernels need equal dtypes"
        )
    sizes = ops.world_sizes()
    if world_size not in sizes:
        return f"world size {world_size} not in {{{', '.join(map(str, sorted(sizes)))}}}"
    k = x.shape[1]
    if not K_MIN <= k < K_MAX:
        return f"k={k} outside [{K_MIN}, {K_MAX})"
    # The backward runs the dual kernel, contracting over the weight's output dim.
    n = weight.shape[0]
    which = "n_local" if op == "all_gather_matmul" else "n"
    if not K_MIN <= n < K_MAX:
        return f"k={n} outside [{K_MIN}, {K_MAX}) ({which}, the contraction dim of the backward)"
    if op == "matmul_reduce_scatter" and x.shape[0] % world_size:
        return f"m={x.shape[0]} not divisible by world size {world_size}"
    return None


@impl_keyword("select_backend")
def select_backend(
    op: Op,
    x: torch.Tensor,
    weight: torch.Tensor,
    group: Any = None,
    *,
    impl: str = "auto",
) -> tuple[str, str]:
    """Return ``(choice, reason)``: the implementation (``"npu"`` or ``"torch"``) that ``op``
    runs with for these operands, and why. ``impl="npu"`` raises ``ValueError`` naming the
    failed kernel constraint instead of falling back (``backend=``: deprecated name of
    ``impl=``)."""
    backend = impl
    if backend not in BACKENDS:
        raise ValueError(f"impl must be one of {BACKENDS}, got {backend!r}")
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if backend == "torch":
        return "torch", "impl='torch' requested"
    failure = npu_constraint_failure(op, x, weight, _world_size(group))
    if backend == "npu":
        if failure:
            raise ValueError(f"impl='npu' cannot run {op}: {failure}")
        return "npu", "impl='npu' requested and every kernel constraint holds"
    if failure:
        return "torch", failure
    return "npu", "tensors are on npu, the kernels are available and every constraint holds"


def default_chunks(rows: int, k: int, n: int, world_size: int, device_type: str = "cpu") -> int:
    """Chunk count of the ``torch`` backend for a chunked dim of ``rows`` local rows.

    A pure function of the shapes, the group size and the device type, so every rank of a
    group computes the same count and runs the same sequence of collectives (a count read
    from a rank's own CPU affinity or thread count could differ between ranks). Each chunk
    should still be a matmul worth overlapping: >= 64 rows and >= ~134 MFLOP over all ranks'
    rows (``2·rows·ws·k·n / chunks >= 2**27``). Within that, at most 8 chunks on CPU (gloo)
    and 4 on an accelerator. On CPU the cap is what the benchmark's modeled link measured
    (README, "Chunk count"): 8 chunks hide the most of the link at its shapes (4 and 16
    within a few percent, 1 and 2 far behind). The accelerators' 4 is not measured here.
    """
    flops = 2 * rows * world_size * k * n
    cap = 8 if device_type == "cpu" else 4
    return max(1, min(cap, rows // 64, flops // (1 << 27)))
