"""Gated DeltaNet under context parallelism: the KDA machinery with a per-head scalar gate.

Gated DeltaNet (Qwen3-Next, Qwen3.5) is the delta rule with one log-decay per head and token,
``g [B, T, H]``, where KDA has one per key channel, ``g [B, T, H, K]``: one token is
``h ← e^{g_t} h``, then ``h ← h + β_t k_t (v_t − hᵀk_t)ᵀ``, i.e. KDA with ``g_t`` broadcast
along ``K``. So nothing here exchanges anything of its own: the gate is broadcast (a view) and
the call goes to :func:`~hyper_parallel.kda.kda_context_parallel`'s state machinery (its
summaries, protocols, fold kernels, packed documents, initial state and checks).

Grouped value heads (``num_v_heads = n · num_k_heads``): each query/key head serves ``n``
consecutive value heads (``repeat_interleave``, as the stock kernel does), so the recurrence
runs over the value heads with q and k repeated.

:func:`parallelize_gated_deltanet` rewrites a stock ``Qwen3NextGatedDeltaNet`` (or Qwen3.5's
``Qwen3_5GatedDeltaNet`` / ``Qwen3_5MoeGatedDeltaNet``, the same math with the projections
split differently), recognised by class name and attributes (this package never imports
transformers). Rank ``r`` of the 1-D CP mesh holds block ``r`` of the sequence; the rewritten
forward takes that block of ``hidden_states [B, T_r, D]`` and returns the same rows of the
serial layer's output:

1. the input projections (local, the module's own: ``in_proj_qkvz``/``in_proj_ba`` and
   ``fix_query_key_value_ordering`` for Qwen3-Next, ``in_proj_qkv``/``in_proj_z``/
   ``in_proj_b``/``in_proj_a`` for Qwen3.5) give the pre-convolution rows ``[q | k | v]``,
   the output gate ``z`` and ``b``, ``a``;
2. the halo of the ``W − 1`` previous pre-convolution rows is launched
   (:func:`~hyper_parallel.kda.halo.start_causal_conv_halo`; zeros on the first rank);
3. meanwhile (Qwen3.5: also ``in_proj_z``, ``in_proj_b``, ``in_proj_a``) ``β = sigmoid(b)``,
   ``g = −exp(A_log) · softplus(a + dt_bias)``;
4. the halo arrives; the depthwise causal convolution and its activation give q, k, v (the
   same helper as ``parallelize_kda``); q and k are repeated to the value heads and
   l2-normalised in fp32;
5. the recurrence runs through the module's state exchange with ``g`` broadcast along ``K``;
6. the gated RMSNorm ``norm(o, z)`` and ``out_proj`` are local.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from hyper_parallel.dtensor.consistency import checked_entry
from hyper_parallel.dtensor.rewrite import (
    install_forward,
    is_parallelized,
    parallel_state,
    uninstall_forward,
)

from ._signatures import (
    GDN_FORWARD_FIELDS,
    GDN_LAYER,
    GDN_PARALLELIZE_FIELDS,
    REJECTED_KWARGS,
    gdn_forward_mesh,
)
from .cost import CostParams
from .exchange import StateExchange
from .halo import start_causal_conv_halo
from .layer import check_inputs, executor_for, kda_context_parallel, run_with_executor
from .packing import place_block
from .parallelize import _check_call as check_call
from .parallelize import check_rewrite, conv_block, l2norm, local_compute
from .stock import StockKernel, run_stock_with_executor

__all__ = [
    "SUPPORTED_GDN_CLASSES",
    "ContextParallelGatedDeltaNet",
    "gated_deltanet_context_parallel",
    "is_gated_deltanet_parallel",
    "parallelize_gated_deltanet",
    "unparallelize_gated_deltanet",
]

SUPPORTED_GDN_CLASSES = (
    "Qwen3NextGatedDeltaNet",
    "Qwen3_5GatedDeltaNet",
    "Qwen3_5MoeGatedDeltaNet",
)
"""Class names :func:`parallelize_gated_deltanet` accepts (Hugging Face transformers'
Qwen3-Next and Qwen3.5 / Qwen3.5-MoE Gated DeltaNet layers)."""

_COMMON = ("conv1d", "A_log", "dt_bias", "norm", "out_proj", "num_k_heads", "num_v_heads",
           "head_k_dim", "head_v_dim", "key_dim", "value_dim", "conv_kernel_size",
           "activation", "hidden_size")  # fmt: skip
_QWEN3_NEXT = ("in_proj_qkvz", "in_proj_ba", "fix_query_key_value_ordering")
_QWEN3_5 = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
_CHUNK = 64


def _projections(module: Any) -> tuple[str, ...]:
    """The projection attributes of ``module``'s layout (Qwen3-Next's fused ones if present)."""
    return _QWEN3_NEXT if hasattr(module, "in_proj_qkvz") else _QWEN3_5


def _check_gdn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> int:
    """Gated DeltaNet's own shapes, before any communication: the repeat ``n`` of q/k heads."""
    for name, x in {"q": q, "k": k, "v": v, "g": g, "beta": beta}.items():
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if k.dim() != 4 or q.shape != k.shape:
        raise ValueError(
            f"q and k must be [B, T, H_k, K] alike, got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    if v.dim() != 4 or v.shape[:2] != k.shape[:2]:
        raise ValueError(f"v must be [B, T, H, V] with k's B, T, got {tuple(v.shape)}")
    H_k, H = k.shape[2], v.shape[2]
    if H_k < 1 or H % H_k:
        raise ValueError(f"the value heads ({H}) must be a multiple of the q/k heads ({H_k})")
    if tuple(g.shape) != tuple(v.shape[:3]):
        raise ValueError(
            f"g must be the per-head scalar gate [B, T, H] = {tuple(v.shape[:3])}, got "
            f"{tuple(g.shape)} (a per-channel gate [B, T, H, K] is KDA: kda_context_parallel)"
        )
    return H // H_k


def _as_kda(
    q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, H: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k repeated to the ``H`` value heads; ``g [B, T, H]`` broadcast to ``[B, T, H, K]``
    (a view)."""
    n = H // k.shape[2]
    if n != 1:
        q, k = q.repeat_interleave(n, dim=2), k.repeat_interleave(n, dim=2)
    return q, k, g.unsqueeze(-1).expand(*g.shape, k.shape[-1])


def gated_deltanet_context_parallel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    mesh: Any,
    *,
    protocol: str = "auto",
    group_size: int | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    kernel: str = "auto",
    cost_params: CostParams | None = None,
    cu_seqlens: torch.Tensor | None = None,
    sequence_context: Any = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule with the sequence split across the ranks of the 1-D ``mesh``:
    :func:`~hyper_parallel.kda.kda_context_parallel` with a per-head scalar gate.

    Per rank: ``q, k: [B, T_r, H_k, K]`` (already l2-normalised if the model does so),
    ``v: [B, T_r, H, V]`` with ``H`` a multiple of ``H_k`` (each q/k head serves ``H / H_k``
    consecutive value heads), ``g, beta: [B, T_r, H]`` (``g`` the log-decay, ≤ 0);
    ``initial_state [B, H, K, V]`` read on the first rank. Returns ``(o_local [B, T_r, H, V],
    final_state)``: this rank's rows of transformers' ``torch_chunk_gated_delta_rule`` on the
    whole sequence (with ``use_qk_l2norm_in_kernel=False``; scale ``K^{-1/2}`` by default).
    Every other argument, the packed documents, the consistency check and the errors are
    :func:`~hyper_parallel.kda.kda_context_parallel`'s; shape errors of its own
    (``ValueError``) come before any communication too.
    """
    _check_gdn(q, k, v, g, beta)
    q, k, g_k = _as_kda(q, k, g, v.shape[2])
    return kda_context_parallel(
        q, k, v, g_k, beta, mesh, protocol=protocol, group_size=group_size, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state,
        chunk_size=chunk_size, kernel=kernel, cost_params=cost_params, cu_seqlens=cu_seqlens,
        sequence_context=sequence_context,
    )  # fmt: skip


@dataclass(frozen=True)
class _GDNState:
    """What a rewritten forward reads: built once by :func:`parallelize_gated_deltanet`."""

    mesh: Any
    protocol: str
    group_size: int | None
    layer_class: str
    activation: Callable[[torch.Tensor], torch.Tensor]
    executor: StateExchange
    local: StockKernel | None = None  # the stock kernel as the local compute, or the project's

    @property
    def local_kernel(self) -> str:
        """The resolved ``local_kernel``: ``"stock"`` or ``"torch"``."""
        return "torch" if self.local is None else "stock"


def _project(
    self: Any, x: torch.Tensor
) -> tuple[torch.Tensor, Callable[[], tuple[torch.Tensor, ...]]]:
    """The stock projections of the block ``x [B, T, D]``: ``mixed [B, T, 2·key_dim +
    value_dim]`` (the pre-convolution ``[q | k | v]``) now, and a function giving ``z [B, T, H,
    V]``, ``b``, ``a [B, T, H]`` (run while the halo is in flight where the layout lets them
    wait: Qwen3.5's separate projections), by the module's own submodules (and, for
    Qwen3-Next, its own reordering)."""
    B, T = x.shape[:2]
    if hasattr(self, "in_proj_qkvz"):
        qkvz, ba = self.in_proj_qkvz(x), self.in_proj_ba(x)
        if T == 0:  # the stock reordering cannot reshape an empty block: pad a row, keep none
            pad = (0, 0, 0, 1)
            parts = self.fix_query_key_value_ordering(F.pad(qkvz, pad), F.pad(ba, pad))
            q, k, v, z, b, a = (p[:, :0] for p in parts)
        else:
            q, k, v, z, b, a = self.fix_query_key_value_ordering(qkvz, ba)
        mixed = torch.cat([t.reshape(B, T, t.shape[2] * t.shape[3]) for t in (q, k, v)], dim=-1)
        return mixed, lambda: (z, b, a)

    def rest() -> tuple[torch.Tensor, ...]:
        z = self.in_proj_z(x).reshape(B, T, self.num_v_heads, self.head_v_dim)
        return z, self.in_proj_b(x), self.in_proj_a(x)

    return self.in_proj_qkv(x), rest


def _check_call(self: Any, hidden_states: Any, cache_params: Any, mask: Any, kw: dict) -> None:
    model = "the stock model (create_recurrent_attention_mask)"
    check_call(
        self, hidden_states, cache_params, mask, kw, "parallelize_gated_deltanet", model,
        REJECTED_KWARGS,
    )  # fmt: skip


def _cp_forward(
    self: Any,
    hidden_states: torch.Tensor,
    cache_params: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    state: _GDNState = parallel_state(self, GDN_LAYER)
    _check_call(self, hidden_states, cache_params, attention_mask, kwargs)
    x = hidden_states
    B, T, _ = x.shape
    packed = place_block(
        state.mesh, B, T, x.device, "parallelize_gated_deltanet",
        cu_seqlens=kwargs.get("cu_seqlens"), context=kwargs.get("sequence_context"),
    )  # fmt: skip
    mixed, rest = _project(self, x)
    pending = start_causal_conv_halo(mixed, self.conv_kernel_size, state.mesh, seq_dim=1)
    z, b, a = rest()  # meanwhile: the per-token projections and gates
    beta = b.sigmoid()
    # the stock expression (A_log in fp32, as the stock layer computes it)
    g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
    conv = conv_block(pending, mixed, self.conv1d, packed, state.activation)
    H, K, V = self.num_v_heads, self.head_k_dim, self.head_v_dim
    q, k, v = conv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
    q, k = (t.reshape(B, T, self.num_k_heads, K) for t in (q, k))
    v = v.reshape(B, T, H, V)
    ex = state.executor
    if state.local is not None and T:  # the stock kernel: its own layouts, l2-norm, head groups
        o, _ = run_stock_with_executor(state.local, q, k, v, g, beta, ex, packed=packed)
    else:
        q, k, g_k = _as_kda(l2norm(q.float()), l2norm(k.float()), g, H)
        check_inputs(q, k, v, g_k, beta, None, _CHUNK, ex.kernel, state.mesh)
        o, _ = run_with_executor(q, k, v, g_k, beta, ex, chunk_size=_CHUNK, packed=packed)
    o = self.norm(o.reshape(-1, V), z.reshape(-1, V)).reshape(B, T, H * V)
    return self.out_proj(o)


def _make_forward(cls: type) -> Callable[..., torch.Tensor]:
    """The rewritten forward of a stock Gated DeltaNet class (its signature and doc kept)."""

    @functools.wraps(cls.forward)  # type: ignore[attr-defined]  # the stock signature and doc
    @checked_entry(
        f"parallelize_gated_deltanet ({cls.__name__}) forward",
        group=gdn_forward_mesh,
        extra=GDN_FORWARD_FIELDS,
    )
    def forward(
        self: Any,
        hidden_states: torch.Tensor,
        cache_params: Any = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        return _cp_forward(self, hidden_states, cache_params, attention_mask, **kwargs)

    return forward


def _dims(module: Any) -> tuple[int, int, int]:
    return (2 * module.key_dim + module.value_dim, module.head_k_dim, module.head_v_dim)


@checked_entry(
    "parallelize_gated_deltanet",
    compare=("protocol", "group_size", "kernel", "local_kernel"),
    group="cp_mesh",
    extra=GDN_PARALLELIZE_FIELDS,
)
def parallelize_gated_deltanet(
    module: nn.Module,
    cp_mesh: Any,
    *,
    protocol: str = "auto",
    group_size: int | None = None,
    kernel: str = "auto",
    local_kernel: str = "auto",
) -> nn.Module:
    """Rewrite a stock Gated DeltaNet layer in place for context parallelism over the 1-D
    ``cp_mesh`` (:data:`SUPPORTED_GDN_CLASSES`).

    The contract is :func:`~hyper_parallel.kda.parallelize_kda`'s: afterwards
    ``module(hidden_states [B, T_r, D])`` on rank ``r`` (block ``r``, in the mesh's rank order;
    blocks may differ in length, be shorter than the convolution window or empty) returns
    those rows of the serial layer's output, the input's gradient those rows of the serial
    one, and each parameter's gradient summed over the ranks the serial gradient. The same
    options (``protocol``, ``group_size``, ``kernel``; the executor built here, collectively,
    and kept by the module), the same packed documents (``cu_seqlens=`` global offsets or
    ``sequence_context=``: the result is the stock layer run on each document alone), the
    same consistency check and the same errors, before any communication: ``TypeError`` for
    another class or ``cp_mesh`` not a DeviceMesh, ``RuntimeError`` when already rewritten,
    ``ValueError`` for a bad mesh or option; at call time ``cache_params``, ``attention_mask``,
    ``seq_idx``, HF's ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (pass the global table as
    ``cu_seqlens``), a bad table or malformed ``hidden_states`` raise ``ValueError`` on every
    rank. Returns ``module``.
    """
    activation = check_rewrite(
        module, cp_mesh, protocol, kernel, what="parallelize_gated_deltanet",
        layer_name=GDN_LAYER, classes=SUPPORTED_GDN_CLASSES,
        attributes=_COMMON + _projections(module), dims=_dims,
    )  # fmt: skip
    local = local_compute(module, local_kernel, "torch_chunk_gated_delta_rule")
    executor = executor_for(cp_mesh, protocol, group_size, kernel, None)
    state = _GDNState(
        cp_mesh, protocol, group_size, type(module).__name__, activation, executor, local
    )
    install_forward(module, GDN_LAYER, state, _make_forward, prefix="ContextParallel")
    return module


def unparallelize_gated_deltanet(module: nn.Module) -> nn.Module:
    """Undo :func:`parallelize_gated_deltanet` (``RuntimeError`` if it was not applied)."""
    if not is_parallelized(module, GDN_LAYER):
        raise RuntimeError(
            "module is not context-parallel (parallelize_gated_deltanet was not applied)"
        )
    uninstall_forward(module, GDN_LAYER)
    return module


def is_gated_deltanet_parallel(module: nn.Module) -> bool:
    """Whether :func:`parallelize_gated_deltanet` rewrote ``module``."""
    return is_parallelized(module, GDN_LAYER)


class ContextParallelGatedDeltaNet(ParallelStyle):
    """torch ``ParallelStyle`` form of :func:`parallelize_gated_deltanet`::

    parallelize_module(
        model, cp_mesh, {"model.layers.0.linear_attn": ContextParallelGatedDeltaNet()}
    )
    """

    def __init__(
        self,
        protocol: str = "auto",
        *,
        group_size: int | None = None,
        kernel: str = "auto",
        local_kernel: str = "auto",
    ) -> None:
        super().__init__()
        self.protocol, self.group_size, self.kernel = protocol, group_size, kernel
        self.local_kernel = local_kernel

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        return parallelize_gated_deltanet(
            module, device_mesh, protocol=self.protocol, group_size=self.group_size,
            kernel=self.kernel, local_kernel=self.local_kernel,
        )  # fmt: skip
