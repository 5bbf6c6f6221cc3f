"""A test double of the three torch_npu ops the ``npu`` backend of hp-moe uses, on CPU.

Same signatures as torch_npu (``npu_moe_token_permute``, ``npu_moe_token_unpermute``
positional-or-keyword; ``npu_grouped_matmul(x, weight, *, ...)`` keyword-only after
``weight``), the argument checks the Ascend docs state (dtypes, ranks, ``K <= 512``, fewer than
16777215 pairs, ``padded_mode`` False, ``sorted_indices`` an int32 permutation, group_list
forms, at most 1024 groups, inner dims below 65536, ``x`` not transposed), each failure a
``RuntimeError`` that starts with the op's name. Written from the docs, independently of the
package, so a test comparing the two catches drift.

Numbers: the token ops are index_select / multiply / sum in plain torch, differentiable like the
real ops (``tokens``; ``permuted_tokens`` and ``probs``); half-precision inputs are combined in
float32 and the result cast back. ``npu_grouped_matmul`` computes in float32 (float32 and half
inputs) and, like torch_npu, has **no derivative**: an output of inputs that require grad
raises on backward ("derivative for npu_grouped_matmul is not implemented", the message torch
gives ops without a derivative formula). Every call is recorded (op, shapes, dtypes, keywords,
whether the weight was a transposed view). The base, hp-dtensor's ``NpuDouble``, makes it a
provider on hp-dtensor's torch_npu seam: ``available(ops)`` names the ops it does not define.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from hyper_parallel.dtensor.npu_double import NpuDouble

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_NAMES = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.int32: "int32",
    torch.int64: "int64",
}
MAX_TOP_K = 512
MAX_INDEX = 16777215
MAX_GROUPS = 1024
INNER_LIMIT = 65536


def _name(dtype: torch.dtype) -> str:
    return _NAMES.get(dtype, str(dtype).replace("torch.", ""))


def _failure(op: str) -> Callable[[str], RuntimeError]:
    """The error of a failed check of ``op``: a ``RuntimeError`` that starts with its name."""
    return lambda msg: RuntimeError(f"{op}: {msg}")


@dataclass
class Call:
    op: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    kwargs: dict[str, Any]
    weight_transposed: bool = False


class _NoDerivative(torch.autograd.Function):
    """The autograd node torch attaches to an op without a derivative formula."""

    @staticmethod
    def forward(ctx: Any, out: Tensor, *inputs: Tensor) -> Tensor:  # type: ignore[override]
        return out.clone()

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Any:  # type: ignore[override]
        raise RuntimeError("derivative for npu_grouped_matmul is not implemented")


@dataclass
class NpuMoeOpsDouble(NpuDouble):
    """Implements :class:`hyper_parallel.moe.NpuMoeOps` on CPU tensors."""

    device_type: str = "cpu"
    unavailable_reason: str | None = None
    calls: list[Call] = field(default_factory=list)

    def available(self, ops: Iterable[str] = ()) -> str | None:
        return self.unavailable_reason or super().available(ops)

    def ops(self) -> list[str]:
        return [c.op for c in self.calls]

    # --- npu_moe_token_permute ------------------------------------------------------------

    def npu_moe_token_permute(
        self,
        tokens: Tensor,
        indices: Tensor,
        num_out_tokens: int | None = None,
        padded_mode: bool = False,
    ) -> tuple[Tensor, Tensor]:
        op = "npu_moe_token_permute"
        fail = _failure(op)

        self.calls.append(
            Call(
                op,
                (tuple(tokens.shape), tuple(indices.shape)),
                (_name(tokens.dtype), _name(indices.dtype)),
                {"num_out_tokens": num_out_tokens, "padded_mode": padded_mode},
            )
        )
        if padded_mode:
            raise fail("padded_mode=True is not supported (only False)")
        if tokens.dim() != 2:
            raise fail(f"tokens must be 2-D [num_tokens, hidden_size], got {tokens.dim()}-D")
        if tokens.dtype not in FLOATS:
            raise fail(f"tokens must be float16, bfloat16 or float32, got {_name(tokens.dtype)}")
        if indices.dtype not in (torch.int32, torch.int64):
            raise fail(f"indices must be int32 or int64, got {_name(indices.dtype)}")
        if indices.dim() not in (1, 2):
            raise fail(f"indices must be 1-D or 2-D, got {indices.dim()}-D")
        if indices.shape[0] != tokens.shape[0]:
            raise fail(
                f"indices has {indices.shape[0]} rows but tokens has {tokens.shape[0]} tokens"
            )
        top_k = 1 if indices.dim() == 1 else indices.shape[1]
        if top_k > MAX_TOP_K:
            raise fail(f"topK={top_k} > {MAX_TOP_K}")
        flat = indices.reshape(-1)
        if flat.numel() >= MAX_INDEX:
            raise fail(f"indices has {flat.numel()} elements, must be < {MAX_INDEX}")
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= MAX_INDEX):
            raise fail(f"indices values must be in [0, {MAX_INDEX})")
        if num_out_tokens is not None and not isinstance(num_out_tokens, int):
            raise fail(
                f"num_out_tokens must be an int or None, got {type(num_out_tokens).__name__}"
            )
        f = flat.numel()
        n = num_out_tokens or 0
        m = f if n == 0 else (min(n, f) if n > 0 else max(f + n, 0))
        first = torch.argsort(flat, stable=True)  # the pair of each sorted row
        sorted_indices = torch.argsort(first, stable=True).to(torch.int32)  # the row of each pair
        permuted = tokens.index_select(0, first[:m] // top_k)
        return permuted, sorted_indices

    # --- npu_moe_token_unpermute ----------------------------------------------------------

    def npu_moe_token_unpermute(
        self,
        permuted_tokens: Tensor,
        sorted_indices: Tensor,
        probs: Tensor | None = None,
        padded_mode: bool = False,
        restore_shape: Any = None,
    ) -> Tensor:
        op = "npu_moe_token_unpermute"
        fail = _failure(op)

        self.calls.append(
            Call(
                op,
                (
                    tuple(permuted_tokens.shape),
                    tuple(sorted_indices.shape),
                    tuple(probs.shape) if probs is not None else (),
                ),
                (
                    _name(permuted_tokens.dtype),
                    _name(sorted_indices.dtype),
                    _name(probs.dtype) if probs is not None else "",
                ),
                {"probs": probs is not None, "padded_mode": padded_mode},
            )
        )
        if padded_mode or restore_shape is not None:
            raise fail("only padded_mode=False with restore_shape=None is supported")
        if permuted_tokens.dim() != 2:
            raise fail(f"permuted_tokens must be 2-D, got {permuted_tokens.dim()}-D")
        if permuted_tokens.dtype not in FLOATS:
            raise fail(
                "permuted_tokens must be float16, bfloat16 or float32, got "
                f"{_name(permuted_tokens.dtype)}"
            )
        if sorted_indices.dtype != torch.int32:
            raise fail(f"sorted_indices must be int32, got {_name(sorted_indices.dtype)}")
        if sorted_indices.dim() != 1 or sorted_indices.numel() != permuted_tokens.shape[0]:
            raise fail(
                f"sorted_indices {tuple(sorted_indices.shape)} must be 1-D with one entry per row "
                f"of permuted_tokens ({permuted_tokens.shape[0]})"
            )
        f = sorted_indices.numel()
        if f:
            counts = torch.bincount(sorted_indices.long().clamp(0, f), minlength=f + 1)
            if int(sorted_indices.min()) < 0 or int(sorted_indices.max()) >= f or counts.max() > 1:
                raise fail(f"sorted_indices must be a permutation of [0, {f}) (no duplicates)")
        if probs is None:
            top_k = 1
        else:
            if probs.dtype not in FLOATS:
                raise fail(f"probs must be float16, bfloat16 or float32, got {_name(probs.dtype)}")
            if probs.dim() != 2 or probs.numel() != f:
                raise fail(
                    f"probs {tuple(probs.shape)} must be [num_tokens, topK] with num_tokens*topK = "
                    f"{f}"
                )
            top_k = probs.shape[1]
        if top_k > MAX_TOP_K:
            raise fail(f"topK={top_k} > {MAX_TOP_K}")
        work = torch.promote_types(permuted_tokens.dtype, torch.float32)
        rows = permuted_tokens.to(work).index_select(0, sorted_indices.long())
        if probs is not None:
            rows = rows * probs.to(work).reshape(-1, 1)
        out = rows.view(f // top_k, top_k, rows.shape[-1]).sum(1)
        return out.to(permuted_tokens.dtype)

    # --- npu_grouped_matmul ---------------------------------------------------------------

    def npu_grouped_matmul(
        self,
        x: list[Tensor],
        weight: list[Tensor],
        *,
        bias: list[Tensor] | None = None,
        scale: list[Tensor] | None = None,
        offset: list[Tensor] | None = None,
        antiquant_scale: list[Tensor] | None = None,
        antiquant_offset: list[Tensor] | None = None,
        per_token_scale: list[Tensor] | None = None,
        group_list: Any = None,
        activation_input: list[Tensor] | None = None,
        activation_quant_scale: list[Tensor] | None = None,
        activation_quant_offset: list[Tensor] | None = None,
        split_item: int = 0,
        group_type: int | None = None,
        group_list_type: int = 0,
        act_type: int = 0,
        output_dtype: torch.dtype | None = None,
        tuning_config: list[int] | None = None,
    ) -> list[Tensor]:
        op = "npu_grouped_matmul"
        fail = _failure(op)

        if not isinstance(x, (list, tuple)) or not isinstance(weight, (list, tuple)):
            raise fail("x and weight must be lists of tensors")
        kwargs = {
            "split_item": split_item,
            "group_type": group_type,
            "group_list_type": group_list_type,
            "group_list": None if group_list is None else type(group_list).__name__,
        }
        self.calls.append(
            Call(
                op,
                tuple(tuple(t.shape) for t in [*x, *weight]),
                tuple(_name(t.dtype) for t in [*x, *weight]),
                kwargs,
                weight_transposed=any(
                    t.dim() >= 2 and not t.is_contiguous() and t.transpose(-1, -2).is_contiguous()
                    for t in weight
                ),
            )
        )
        if len(x) > 128 or len(weight) > 128:
            raise fail("x and weight lists hold at most 128 tensors")
        extras = (scale, offset, antiquant_scale, antiquant_offset, per_token_scale)
        if any(e is not None for e in extras) or activation_input is not None:
            raise fail("the double implements the non-quantized form only")
        if activation_quant_scale is not None or activation_quant_offset is not None:
            raise fail("activation_quant_scale/offset only support None")
        if bias is not None or act_type != 0 or tuning_config is not None:
            raise fail("the double implements bias=None, act_type=0, tuning_config=None only")
        if group_type != 0 or len(x) != 1 or len(weight) != 1:
            raise fail(
                "the double implements the single-tensor form only (x, weight, y one tensor "
                "each, group_type=0)"
            )
        a, w = x[0], weight[0]
        if a.dtype not in FLOATS:
            raise fail(f"x must be float16, bfloat16 or float32, got {_name(a.dtype)}")
        if w.dtype != a.dtype:
            raise fail(f"x is {_name(a.dtype)} but weight is {_name(w.dtype)}; they must match")
        if output_dtype is not None and output_dtype != a.dtype:
            raise fail(f"output_dtype must be None or {_name(a.dtype)}")
        if split_item not in (2, 3):
            raise fail(
                f"group_type=0 with single tensors needs split_item 2 or 3, got {split_item}"
            )
        if a.dim() != 2 or w.dim() != 3:
            raise fail(
                f"group_type=0 with single tensors needs x 2-D and weight 3-D, got {a.dim()}-D "
                f"and {w.dim()}-D"
            )
        if not a.is_contiguous():
            raise fail("x must not be transposed (contiguous)")
        transposed = not w.is_contiguous()
        if transposed and not w.transpose(1, 2).is_contiguous():
            raise fail("weight must be contiguous or a transposed view of a contiguous tensor")
        groups, k, n = w.shape
        if a.shape[1] != k:
            raise fail(f"k of x {tuple(a.shape)} and weight {tuple(w.shape)} differ")
        inner_w = k if transposed else n
        if a.shape[1] >= INNER_LIMIT or inner_w >= INNER_LIMIT:
            raise fail(f"the last dim of x and of weight must be < {INNER_LIMIT}")
        if not isinstance(group_list, Tensor):
            raise fail("group_type=0 with single tensors needs group_list as a Tensor")
        if group_list.dtype != torch.int64 or group_list.dim() != 1:
            raise fail(
                f"group_list must be a 1-D int64 tensor, got {group_list.dim()}-D "
                f"{_name(group_list.dtype)}"
            )
        if group_list.numel() != groups:
            raise fail(f"group_list has {group_list.numel()} entries for {groups} weights")
        if groups > MAX_GROUPS:
            raise fail(f"at most {MAX_GROUPS} groups, got {groups}")
        values = [int(v) for v in group_list.tolist()]
        if group_list_type == 0:
            if any(v < 0 for v in values) or any(b < a_ for a_, b in zip(values, values[1:])):
                raise fail("group_list_type=0 needs a non-negative, non-decreasing group_list")
            if values[-1] != a.shape[0]:
                raise fail(f"the last value of group_list ({values[-1]}) must equal m={a.shape[0]}")
            sizes = [b - a_ for a_, b in zip([0, *values], values)]
        elif group_list_type == 1:
            if any(v < 0 for v in values) or len(values) == 1:
                raise fail("group_list_type=1 needs non-negative sizes, and not just one")
            if sum(values) != a.shape[0]:
                raise fail(f"the sizes in group_list sum to {sum(values)}, not m={a.shape[0]}")
            sizes = values
        else:
            raise fail(f"group_list_type={group_list_type} is for int8 inputs only")
        with torch.no_grad():
            a32, w32 = a.float(), w.float()
            parts = [a32[s : s + m] @ w32[e] for e, (s, m) in enumerate(_starts(sizes))]
            y = (torch.cat(parts) if parts else a32.new_zeros(0, n)).to(a.dtype)
        if torch.is_grad_enabled() and (a.requires_grad or w.requires_grad):
            y = _NoDerivative.apply(y, a, w)
        return [y]


def _starts(sizes: list[int]) -> list[tuple[int, int]]:
    out, s = [], 0
    for m in sizes:
        out.append((s, m))
        s += m
    return out
