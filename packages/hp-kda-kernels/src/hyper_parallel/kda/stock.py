"""The stock layer's own chunk kernel as each rank's local compute (``local_kernel="stock"``).

A stock Hugging Face delta-rule layer calls a module-level chunk function: Kimi-Linear's
``chunk_kimi_delta_attention``, Qwen3-Next's ``torch_chunk_gated_delta_rule``. transformers
binds that name once, at import, to flash-linear-attention's fused Triton kernel (``chunk_kda``
/ ``chunk_gated_delta_rule``, CUDA and Ascend) wherever ``fla`` imports, and to its own PyTorch
reference elsewhere. Under context parallelism a rank needs two things from its block, and both
are calls of that same function with ``initial_state`` and ``output_final_state``:

- the block's affine summary ``h_out = M h_in + S``: the recurrence is linear column by column
  in the state, so one call with the values widened by ``K`` zero columns, ``[v | 0]``, from
  the initial state ``[0 | I]`` ends in the state ``[S | M]``. A block that contains a document
  start has ``M = 0`` and ``S`` the last document's final state from zero: one call over the
  block's last document, with the plain values;
- its outputs from the true incoming state ``h_in``: a second call with ``initial_state=h_in``.
  Packed documents go through the kernel's ``cu_seqlens`` where it takes them (fla: one call,
  initial states ``[h_in, 0, …]``), one call per document where it does not (transformers'
  reference refuses ``cu_seqlens``).

Gradients flow through the kernel's own backward (fla's fused one; autograd through the
reference). Between the two calls the summary crosses ranks by the same state exchange as the
project's own path (:mod:`hyper_parallel.kda.layer`).

========================================  ==================================================
math                                      function
========================================  ==================================================
``[S | M]`` from ``[v | 0]``, ``[0 | I]``  :func:`stock_summary`
``o``, ``h_out`` from ``h_in``             :func:`stock_outputs`
the kernel the layer calls, fused or not   :func:`stock_kernel`, :func:`is_fused`
``auto``                                   :func:`resolve_local_kernel`
========================================  ==================================================
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hyper_parallel.dtensor import overlap
from hyper_parallel.dtensor.amp import without_autocast

from .exchange import StateExchange
from .packing import PackedBlock

__all__ = [
    "LOCAL_KERNELS",
    "StockKernel",
    "is_fused",
    "resolve_local_kernel",
    "run_stock_with_executor",
    "stock_kernel",
    "stock_outputs",
    "stock_summary",
]

LOCAL_KERNELS = ("auto", "stock", "torch")
"""Values of ``local_kernel``: the stock layer's kernel, the project's torch chunk path, or
``auto`` (the stock kernel where transformers bound it to a fused one, else the project's)."""

# packages whose kernels transformers routes the delta-rule functions to (fused, on a device)
_FUSED_PACKAGES = ("fla",)


def is_fused(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` (a stock module's chunk function) runs an external fused kernel: the name
    transformers' ``use_kernel_func_from_hub_with_fallback`` bound to another package's
    implementation (fla's), or such an implementation itself."""
    module = getattr(inspect.unwrap(fn), "__module__", "") or ""
    if module.split(".")[0] in _FUSED_PACKAGES:
        return True
    closure = getattr(fn, "__closure__", None)
    if closure and inspect.isfunction(fn):
        free = inspect.getclosurevars(fn).nonlocals
        if free.get("is_new_implementation"):
            return True
    return False


def _takes_cu_seqlens(fn: Callable[..., Any]) -> bool:
    """Whether the kernel keeps packed documents apart itself (fla does; transformers'
    reference refuses ``cu_seqlens``)."""
    if is_fused(fn):
        return True
    try:
        params = inspect.signature(inspect.unwrap(fn)).parameters
    except (TypeError, ValueError):
        return False
    return "cu_seqlens" in params


@dataclass(frozen=True)
class StockKernel:
    """The chunk function a stock layer calls: ``fn(query, key, value, g=, beta=,
    initial_state=, output_final_state=, use_qk_l2norm_in_kernel=, [cu_seqlens=])`` with
    fla's layouts (``[B, T, H, K]``, state ``[B, H, K, V]`` fp32), resolved when the layer is
    rewritten. ``fused``: bound to fla's kernel; ``varlen``: takes ``cu_seqlens``."""

    fn: Callable[..., Any]
    name: str
    fused: bool
    varlen: bool


def stock_kernel(module: Any, name: str) -> StockKernel:
    """The chunk function ``name`` of ``module``'s modeling module (what its forward calls).
    ``TypeError`` when that module has no such function."""
    home = sys.modules.get(type(module).__module__)
    fn = getattr(home, name, None)
    if not callable(fn):
        raise TypeError(
            f"{type(module).__name__}: its module {type(module).__module__} has no chunk "
            f"function {name!r} to run as the local kernel; use local_kernel='torch'"
        )
    return StockKernel(fn, name, is_fused(fn), _takes_cu_seqlens(fn))


def resolve_local_kernel(choice: str, kernel: StockKernel) -> str:
    """``"stock"`` or ``"torch"`` for ``local_kernel=choice``: ``auto`` takes the stock kernel
    exactly when transformers bound it to a fused one (fla's), which is what the serial stock
    layer runs on this machine; the reference it falls back to elsewhere keeps pairwise gate
    tensors of every chunk, heavier than the project's own path."""
    if choice not in LOCAL_KERNELS:
        raise ValueError(f"unknown local_kernel {choice!r}; expected one of {LOCAL_KERNELS}")
    if choice == "auto":
        return "stock" if kernel.fused else "torch"
    return choice


def _segments(packed: PackedBlock | None, T: int) -> tuple[list[int], bool]:
    """Cut points ``[0, …, T]`` of this block at its documents' starts (host values), and
    whether a document other than the first starts at the block's first token (its first
    segment then starts from zero, not from the incoming state)."""
    if packed is None:
        return [0, T], False
    inner = [o - packed.start for o in packed.offsets if packed.start < o < packed.start + T]
    return [0, *inner, T], 0 < packed.start in packed.offsets


def _call(kernel: StockKernel, q: Any, k: Any, v: Any, g: Any, beta: Any, h: Any, **kw: Any) -> Any:
    return kernel.fn(
        q, k, v, g=g, beta=beta, initial_state=h, output_final_state=True,
        use_qk_l2norm_in_kernel=True, **kw,
    )  # fmt: skip


def stock_summary(
    kernel: StockKernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    packed: PackedBlock | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This block's summary ``(S [B, H, K, V], M [B, H, K, K])``, fp32, from one kernel call.

    Inputs as the stock layer passes them to its kernel (q, k before the l2-norm the kernel
    applies; ``v [B, T, H, V]``; ``g`` and ``beta`` in the kernel's layout), ``T > 0``."""
    B, T, H, V = v.shape
    K = k.shape[-1]
    cuts, fresh = _segments(packed, T)
    if len(cuts) > 2 or fresh:  # a document starts here: M = 0, S its last one's from zero
        lo = cuts[-2]
        _, S = _call(kernel, q[:, lo:], k[:, lo:], v[:, lo:], g[:, lo:], beta[:, lo:], None)
        S = S.to(torch.float32)
        return S, S.new_zeros(B, H, K, K)
    wide = torch.cat([v, v.new_zeros(B, T, H, K)], dim=-1)
    start = torch.zeros(B, H, K, V + K, dtype=torch.float32, device=v.device)
    start[..., V:] = torch.eye(K, dtype=torch.float32, device=v.device)
    _, SM = _call(kernel, q, k, wide, g, beta, start)
    SM = SM.to(torch.float32)
    return SM[..., :V], SM[..., V:]


def stock_outputs(
    kernel: StockKernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    h_in: torch.Tensor,
    packed: PackedBlock | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o [B, T, H, V] in the kernel's output dtype, h_out [B, H, K, V] fp32)``: this block
    run by the kernel from the incoming state ``h_in`` (documents restart from zero)."""
    cuts, fresh = _segments(packed, v.shape[1])
    if fresh:  # a document starts at the first token; h_in stays in the graph (zero gradient)
        h_in = h_in * 0
    if len(cuts) == 2:
        o, h = _call(kernel, q, k, v, g, beta, h_in)
        return o, h.to(torch.float32)
    if kernel.varlen:
        cu = torch.tensor(cuts, dtype=torch.int64, device=v.device)
        rest = h_in.new_zeros(len(cuts) - 2, *h_in.shape[1:])
        o, h = _call(kernel, q, k, v, g, beta, torch.cat([h_in, rest]), cu_seqlens=cu)
        return o, h[-1:].to(torch.float32)
    outs, h = [], h_in
    for i, (lo, hi) in enumerate(zip(cuts[:-1], cuts[1:])):
        qs, ks, vs, gs, bs = (x[:, lo:hi] for x in (q, k, v, g, beta))
        o, h = _call(kernel, qs, ks, vs, gs, bs, h_in if i == 0 else None)
        outs.append(o)
    return torch.cat(outs, dim=1), h.to(torch.float32)


@without_autocast
def run_stock_with_executor(
    kernel: StockKernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ex: StateExchange,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    packed: PackedBlock | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One rank's block (``T > 0``) of a context-parallel delta-rule recurrence with the stock
    ``kernel`` as the local compute: the summary call, the state exchange on ``ex`` (the same
    nodes as :func:`~hyper_parallel.kda.layer.run_with_executor`), the output call. Returns
    ``(o_local, final state on the last rank when asked, else None)``; ``initial_state`` is
    read on the first rank."""
    from .layer import _Exchange  # the exchange's autograd nodes, shared with the torch path

    first = ex.position == 0
    last = ex.position == ex.world_size - 1
    S, M = stock_summary(kernel, q, k, v, g, beta, packed)
    h0 = initial_state.to(torch.float32) if (first and initial_state is not None) else None
    if h0 is not None:
        S = M @ h0 + S
    state = _Exchange(ex)
    h_x = overlap.wait(state, overlap.launch(state, state.pack(S, M, ())))
    h_in = h_x + h0 if h0 is not None else h_x
    o, h_out = stock_outputs(kernel, q, k, v, g, beta, h_in, packed)
    return o, (h_out if output_final_state and last else None)
