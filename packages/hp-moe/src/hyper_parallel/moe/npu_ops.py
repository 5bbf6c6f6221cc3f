"""The ``npu`` local backend (:class:`NpuExperts`) and what it needs of torch_npu's MoE ops.

The backend never imports ``torch_npu`` itself: it asks the process's provider on hp-dtensor's
one torch_npu seam (:mod:`hyper_parallel.dtensor.npu`; :func:`current_npu_ops`, the same one
for every layer) for three ops with torch_npu's signatures (availability asked by name:
:data:`MOE_OPS`). The default provider, :class:`TorchNpuOps` (hp-dtensor's ``TorchNpu``),
imports ``torch_npu`` on first use, and only once it is asked about tensors on an NPU (a CPU
machine never touches it). Tests install a double with :func:`use_npu_ops` to drive the same
code on CPU. ``current_npu_ops`` and ``use_npu_ops`` are hp-dtensor's own, re-exported here.

What the Ascend documentation says about the three ops (and what this backend relies on):

``npu_moe_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False)
-> (permuted_tokens, sorted_indices)``
    ``tokens [N, H]`` float16/bfloat16/float32, ``indices [N, K]`` (or ``[N]``: K = 1) int32 or
    int64 expert ids. The ``N·K`` (token, slot) pairs are sorted by expert id; row ``r`` of
    ``permuted_tokens`` (the dtype of ``tokens``) is the token of the r-th sorted pair.
    ``sorted_indices`` (int32, ``[N·K]``) is the *inverse* of that sort: ``sorted_indices[f]``
    is the row of flat pair ``f = n·K + k`` (the kernel computes ``argsort(argsort(indices))``;
    torch_npu's own test compares it with ``argsort(argsort(flat, stable=True), stable=True)``,
    so ties keep the (token, slot) order: the same rows as :class:`~.local.TorchExperts`).
    ``num_out_tokens``: ``None``/0 keeps every row, ``n > 0`` the first ``min(n, N·K)``, ``n < 0``
    drops ``|n|`` from the end. ``padded_mode`` must be False. Limits on Atlas A2/A3: ``K <= 512``;
    fewer than 16777215 elements in ``indices`` and ids in ``[0, 16777215)``. Differentiable in
    ``tokens`` (torch_npu registers ``npu_moe_token_permute_grad_v2``).
``npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False,
restore_shape=None) -> Tensor``
    ``out[n] = Σ_k permuted_tokens[sorted_indices[n·K + k]] · probs[n, k]`` (``probs [N, K]``;
    without ``probs`` K is 1 and rows are only put back). ``permuted_tokens`` and ``probs``
    float16/bfloat16/float32, independently of each other (the op definition lists all nine
    pairs); the output has the dtype of ``permuted_tokens``. ``sorted_indices`` int32, a
    permutation of ``[0, N·K)`` (no duplicates). ``padded_mode`` False, ``restore_shape`` None;
    ``K <= 512``. Differentiable in ``permuted_tokens`` and ``probs``.
``npu_grouped_matmul(x, weight, *, group_list, split_item, group_type, group_list_type, ...)
-> list[Tensor]``
    ``y_i = x_i @ weight_i`` for each group i; this backend uses the single-tensor form
    (``x [M, K]``, ``weight [G, K, N]`` i.e. ``x @ w``, ``y [M, N]``): ``group_type=0`` (groups
    along M), ``split_item`` 2 or 3 (one output tensor), ``group_list`` an int64 tensor of
    ``G <= 1024`` entries: with ``group_list_type=0`` the cumulative ends of the groups
    (non-decreasing, the last one ``M``), with 1 the group sizes (then at least two groups).
    float16, bfloat16 and float32 (float32 only in this single-tensor form); ``x`` must not be
    transposed, ``weight`` may be a transposed view; the last dimension of ``x`` and of each
    weight (``N``, or ``K`` for a transposed weight) must be below 65536. torch_npu registers
    **no derivative** for it (its docs name it an inference API): :class:`NpuExperts` wraps it
    in its own autograd function.

Sources: torch_npu's API docs and op schema in Ascend/op-plugin
(``docs/zh/custom_APIs/torch_npu/torch_npu-npu_grouped_matmul.md``,
``op_plugin/config/op_plugin_functions.yaml``, ``op_plugin/config/derivatives.yaml``,
``test/test_custom_ops/test_npu_moe_token_permute_and_unpermute.py``); CANN's aclnn docs
``aclnnMoeTokenPermute`` / ``aclnnMoeTokenUnpermute`` (hiascend.com, CANN 8.0; and
hicann/ops-transformer ``moe/moe_token_permute/docs``, ``moe/moe_token_unpermute/docs``,
``moe/moe_token_unpermute/op_host/moe_token_unpermute_def.cpp``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor

from hyper_parallel.dtensor.npu import NpuProvider, TorchNpu, current_npu_ops, use_npu_ops
from hyper_parallel.moe.local import TorchExperts, register_impl

__all__ = [
    "MOE_OPS",
    "NpuExperts",
    "NpuMoeOps",
    "TorchNpuOps",
    "current_npu_ops",
    "use_npu_ops",
]

#: dtypes the three ops take (float32 for grouped_matmul in its single-tensor form only)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_TOP_K = 512  # K of the token ops (Atlas A2/A3)
MAX_INDEX = 16777215  # the token ops sort fewer elements than this, with ids below it
MAX_GROUPS = 1024  # groups of npu_grouped_matmul's single-tensor form
INNER_LIMIT = 65536  # npu_grouped_matmul: the last dim of x and of each weight stays below it
#: the torch_npu ops the ``npu`` backend calls
MOE_OPS = ("npu_moe_token_permute", "npu_moe_token_unpermute", "npu_grouped_matmul")
_OPS = MOE_OPS
Act = Callable[[Tensor], Tensor]


class NpuMoeOps(NpuProvider, Protocol):
    """What the ``npu`` backend needs from torch_npu (or from a stand-in): a provider
    (:class:`hyper_parallel.dtensor.npu.NpuProvider`) with the three MoE ops."""

    def npu_moe_token_permute(
        self,
        tokens: Tensor,
        indices: Tensor,
        num_out_tokens: int | None = None,
        padded_mode: bool = False,
    ) -> tuple[Tensor, Tensor]: ...

    def npu_moe_token_unpermute(
        self,
        permuted_tokens: Tensor,
        sorted_indices: Tensor,
        probs: Tensor | None = None,
        padded_mode: bool = False,
        restore_shape: Any = None,
    ) -> Tensor: ...

    def npu_grouped_matmul(
        self,
        x: list[Tensor],
        weight: list[Tensor],
        *,
        group_list: Any = None,
        split_item: int = 0,
        group_type: int | None = None,
        group_list_type: int = 0,
        **kwargs: Any,
    ) -> list[Tensor]: ...


#: the provider of the real ops: hp-dtensor's, torch_npu imported on first use (never by
#: ``available`` when it is not installed)
TorchNpuOps = TorchNpu


def _grouped_mm(ops: NpuMoeOps, x: Tensor, w: Tensor, ends: Tensor) -> Tensor:
    """``x [M, K]`` rows grouped by ``ends`` (cumulative) through ``w [G, K, N]``: ``[M, N]``."""
    return ops.npu_grouped_matmul(
        [x], [w], group_list=ends, split_item=3, group_type=0, group_list_type=0
    )[0]


class _GroupedMatmul(torch.autograd.Function):
    """``y[rows of group e] = x[rows of group e] @ w[e]`` by one ``npu_grouped_matmul``, with the
    backward torch_npu does not register: ``dx`` by a second ``npu_grouped_matmul`` on the
    transposed weights, ``dw[e] = x_eᵀ @ dy_e`` by one matmul per non-empty group."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, w: Tensor, ends: Tensor, counts: list[int], ops: NpuMoeOps
    ) -> Tensor:
        ctx.save_for_backward(x, w, ends)
        ctx.counts, ctx.ops = counts, ops
        return _grouped_mm(ops, x, w, ends)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, w, ends = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _grouped_mm(ctx.ops, dy, w.transpose(1, 2), ends)
        if ctx.needs_input_grad[1]:
            # built as [G, N, K] and handed back transposed: the layout of ``w`` (a transposed
            # view of the module's weight), so the weight's own gradient comes out contiguous
            dwt = dy.new_zeros(w.shape[0], w.shape[2], w.shape[1])
            start = 0
            for e, m in enumerate(ctx.counts):
                if m:
                    dwt[e] = dy[start : start + m].t() @ x[start : start + m]
                start += m
            dw = dwt.transpose(1, 2)
        return dx, dw, None, None, None


def _weights_dtype(rows: torch.dtype, weights: torch.dtype) -> torch.dtype:
    """The dtype rows and routing weights are combined in: their promotion (as the stock module
    multiplies them), float32 where that is wider than the ops take."""
    common = torch.promote_types(rows, weights)
    return common if common in DTYPES else torch.float32


def _token_ops_fit(n: int, k: int) -> bool:
    """Whether the token ops take ``N·K`` (token, slot) pairs of ``K`` slots (else this rank's
    permute and unpermute run the torch reference: local work, no rank needs to agree)."""
    return 0 < n * k < MAX_INDEX and k <= MAX_TOP_K


class NpuExperts(TorchExperts):
    """torch_npu's fused ops: ``npu_moe_token_permute`` / ``npu_moe_token_unpermute`` (with the
    routing weights as ``probs``) and two ``npu_grouped_matmul`` per chunk (``gate_up`` as
    ``[E_l, H, 2I]``, ``down`` as ``[E_l, I, H]``, transposed views). Where a call is outside
    what the ops take (no rows, more than 512 slots or 16777215 pairs, more than 1024 local
    experts) that call runs the :class:`~.local.TorchExperts` reference instead: the same
    numbers and the same ``order``."""

    name = "npu"

    def unavailable(self, device_type: str, dtype: torch.dtype, shape: Any) -> str | None:
        ops = current_npu_ops()
        if device_type != ops.device_type:
            return f"its ops take {ops.device_type} tensors, not {device_type}"
        why = ops.available(ops=MOE_OPS)
        if why:
            return why
        if dtype not in DTYPES:
            return f"torch_npu's MoE ops take float16/bfloat16/float32, not {dtype}"
        if shape is not None:
            for what, size in (("H", shape.hidden), ("2I", 2 * shape.intermediate)):
                if size >= INNER_LIMIT:
                    return f"npu_grouped_matmul needs inner dims < {INNER_LIMIT} ({what}={size})"
            if shape.num_experts > MAX_INDEX:
                return (
                    f"npu_moe_token_permute sorts expert ids < {MAX_INDEX} (E={shape.num_experts})"
                )
        return None

    def permute(self, hidden: Tensor, top_k_index: Tensor) -> tuple[Tensor, Tensor]:
        n, k = top_k_index.shape
        if not _token_ops_fit(n, k):
            return super().permute(hidden, top_k_index)
        idx = top_k_index if top_k_index.dtype in (torch.int32, torch.int64) else top_k_index.long()
        rows, sorted_indices = current_npu_ops().npu_moe_token_permute(hidden, idx)
        # sorted_indices[f] is the row of pair f; ``order`` is its inverse (the pair of each row)
        order = torch.empty(n * k, dtype=torch.long, device=hidden.device)
        order[sorted_indices.long()] = torch.arange(n * k, device=hidden.device)
        return rows, order

    def unpermute(
        self, rows: Tensor, order: Tensor, top_k_weights: Tensor, dtype: torch.dtype
    ) -> Tensor:
        n, k = top_k_weights.shape
        if not _token_ops_fit(n, k):
            return super().unpermute(rows, order, top_k_weights, dtype)
        sorted_indices = torch.empty(n * k, dtype=torch.int32, device=rows.device)
        sorted_indices[order] = torch.arange(n * k, dtype=torch.int32, device=rows.device)
        # like the stock module, rows and weights meet in their promoted dtype; the sum over the
        # slots is then cast to ``dtype``
        common = _weights_dtype(rows.dtype, top_k_weights.dtype)
        out = current_npu_ops().npu_moe_token_unpermute(
            rows.to(common), sorted_indices, probs=top_k_weights.to(common)
        )
        return out.to(dtype)

    def experts(
        self, x: Tensor, counts: list[int], gate_up: Tensor, down: Tensor, act: Act
    ) -> Tensor:
        if x.shape[0] == 0 or len(counts) > MAX_GROUPS:
            return super().experts(x, counts, gate_up, down, act)
        ops = current_npu_ops()
        ends = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(x.device)
        # x @ w with w [E_l, H, 2I] and [E_l, I, H]: transposed views of the stock weights
        w1 = gate_up.contiguous().transpose(1, 2)
        w2 = down.contiguous().transpose(1, 2)
        h = _GroupedMatmul.apply(x.contiguous(), w1, ends, counts, ops)
        gate, up = h.chunk(2, dim=-1)
        return _GroupedMatmul.apply((act(gate) * up).contiguous(), w2, ends, counts, ops)


register_impl(NpuExperts())
