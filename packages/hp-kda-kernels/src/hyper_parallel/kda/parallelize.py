"""``parallelize_kda``: context parallelism for a stock KDA layer, applied from outside.

Supported: Hugging Face ``KimiLinearDeltaAttention`` (transformers' Kimi-Linear), recognised by
class name and attributes (this package never imports transformers). Rank ``r`` of the 1-D CP
mesh holds block ``r`` of the sequence; the rewritten forward takes that block of
``hidden_states`` ``[B, T_r, D]`` and returns the same rows of the serial layer's output:

1. ``q_proj``, ``k_proj``, ``v_proj`` (local) give the pre-convolution rows ``[B, T_r, 3·H·K]``;
2. the halo exchange of their previous ``W − 1`` rows is launched
   (:func:`~hyper_parallel.kda.halo.start_causal_conv_halo`);
3. meanwhile the per-token projections run: ``forget_gate`` (g), ``b_proj`` (β),
   ``g_a_proj``/``g_b_proj`` (the output gate);
4. the halo arrives; the depthwise causal convolution over ``[halo ; block]`` without padding
   and the module's activation give q, k, v; q and k are l2-normalised in fp32;
5. the recurrence runs through :func:`~hyper_parallel.kda.kda_context_parallel`;
6. the gated output norm ``o_norm`` and ``o_proj`` are local.

The module keeps its class (a subclass is swapped in), its Parameters and its forward
signature; :func:`unparallelize_kda` restores the class.
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

from ._checks import check_kernel_dims
from ._renamed import accepts_backend
from ._signatures import FORWARD_FIELDS, LAYER, PARALLELIZE_FIELDS, forward_mesh
from .exchange import PROTOCOLS, StateExchange
from .halo import start_causal_conv_halo
from .layer import (
    check_inputs,
    executor_for,
    run_with_executor,
)
from .merge import KERNELS
from .packing import document_conv, place_block
from .stock import (
    LOCAL_KERNELS,
    StockKernel,
    resolve_local_kernel,
    run_stock_with_executor,
    stock_kernel,
)

__all__ = [
    "SUPPORTED_KDA_CLASSES",
    "ContextParallelKDA",
    "is_kda_parallel",
    "parallelize_kda",
    "unparallelize_kda",
]

SUPPORTED_KDA_CLASSES = ("KimiLinearDeltaAttention",)
"""Class names :func:`parallelize_kda` accepts (Hugging Face transformers' Kimi-Linear)."""

_ATTRIBUTES = ("q_proj", "k_proj", "v_proj", "conv1d", "forget_gate", "b_proj", "g_a_proj",
               "g_b_proj", "o_norm", "o_proj", "num_heads", "head_dim", "conv_kernel_size",
               "activation", "hidden_size")  # fmt: skip

# The activations transformers' ACT2FN gives these names, as plain torch functions.
_ACTIVATIONS: dict[Any, Callable[[torch.Tensor], torch.Tensor]] = {
    None: lambda x: x,
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
}
_L2_EPS = 1e-6  # the eps of Kimi-Linear's q/k l2-norm: x / sqrt(Σx² + eps)
_CHUNK = 64  # kda_context_parallel's default chunk size


@dataclass(frozen=True)
class _KDAState:
    """What a rewritten forward reads: built once by :func:`parallelize_kda` (collectively, the
    same on every rank), never looked up again per call."""

    mesh: Any
    protocol: str
    group_size: int | None
    layer_class: str
    activation: Callable[[torch.Tensor], torch.Tensor]
    executor: StateExchange  # the state exchange every forward runs (and its backward)
    local: StockKernel | None = None  # the stock kernel as the local compute, or the project's

    @property
    def local_kernel(self) -> str:
        """The resolved ``local_kernel``: ``"stock"`` or ``"torch"``."""
        return "torch" if self.local is None else "stock"


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + _L2_EPS)


def _check_call(
    module: Any,
    hidden_states: Any,
    cache_params: Any,
    attention_mask: Any,
    kwargs: dict,
    what: str = "parallelize_kda",
    model: str = "KimiLinearModel",
    rejected: tuple[str, ...] = ("seq_idx",),
) -> None:
    """Everything a forward call can get wrong, before any communication (``what``: the
    rewrite, ``model``: the stock model that drops an all-ones mask, ``rejected``: the
    document keywords refused)."""
    if cache_params is not None:
        raise ValueError(
            f"{what}: cache_params (a generation cache) is not supported under context "
            "parallelism (training only); run the model with use_cache=False"
        )
    if attention_mask is not None:
        raise ValueError(
            f"{what}: an attention_mask (padding) is not supported under context "
            f"parallelism; pass none ({model} turns an all-ones mask into None)"
        )
    for name in rejected:
        if kwargs.get(name) is not None:
            raise ValueError(
                f"{what}: {name} is not supported; pass the documents' global offsets as "
                "cu_seqlens (or a sequence_context)"
            )
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
        raise ValueError(f"{what}: hidden_states must be this rank's block [B, T_r, D]")
    if hidden_states.shape[-1] != module.hidden_size:
        raise ValueError(
            f"{what}: hidden_states has {hidden_states.shape[-1]} features, the layer "
            f"expects {module.hidden_size}"
        )


def conv_block(
    pending: Any,
    mixed: torch.Tensor,
    conv1d: Any,
    packed: Any,
    activation: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The stock depthwise causal convolution of this rank's pre-convolution rows ``mixed
    [B, T_r, C]`` and its activation, in ``mixed``'s dtype ``[B, T_r, C]``: the halo's rows
    (``pending``, :func:`start_causal_conv_halo`) in front, no padding; with packed
    documents no tap reads a row of an earlier document (:func:`document_conv`)."""
    T = mixed.shape[1]
    rows = torch.cat([pending.wait(), mixed], dim=1).transpose(1, 2)  # [B, C, W-1+T]
    weight = conv1d.weight  # [C, 1, W]
    if T and packed is not None:
        conv = document_conv(rows.to(weight.dtype), weight, conv1d.bias, packed)
    elif T:
        conv = F.conv1d(rows.to(weight.dtype), weight, conv1d.bias, groups=weight.shape[0])
    else:  # no outputs, but still tied to the halo: its backward must run on this rank too
        conv = rows[..., :0].to(weight.dtype)
    return activation(conv).to(mixed.dtype).transpose(1, 2)


def _cp_forward(
    self: Any,
    hidden_states: torch.Tensor,
    cache_params: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    state: _KDAState = parallel_state(self, LAYER)
    _check_call(self, hidden_states, cache_params, attention_mask, kwargs)
    x = hidden_states
    B, T, _ = x.shape
    packed = place_block(
        state.mesh, B, T, x.device, "parallelize_kda",
        cu_seqlens=kwargs.get("cu_seqlens"), context=kwargs.get("sequence_context"),
    )  # fmt: skip
    heads = (B, T, self.num_heads, self.head_dim)
    mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
    pending = start_causal_conv_halo(mixed, self.conv_kernel_size, state.mesh, seq_dim=1)
    if T:
        g = self.forget_gate(x)
    else:  # the stock gate cannot reshape an empty block: run it on one zero row, keep none
        g = self.forget_gate(x.new_zeros(B, 1, x.shape[-1]))[:, :0]
    beta = torch.sigmoid(self.b_proj(x))
    gate = self.g_b_proj(self.g_a_proj(x)).view(heads)
    conv = conv_block(pending, mixed, self.conv1d, packed, state.activation)
    q, k, v = (t.reshape(heads) for t in conv.split(self.num_heads * self.head_dim, dim=-1))
    ex = state.executor
    if state.local is not None and T:  # the stock kernel normalises q and k itself
        check_inputs(q, k, v, g, beta, None, _CHUNK, ex.kernel, state.mesh)
        o, _ = run_stock_with_executor(state.local, q, k, v, g, beta, ex, packed=packed)
    else:
        q, k = l2norm(q.float()), l2norm(k.float())
        check_inputs(q, k, v, g, beta, None, _CHUNK, ex.kernel, state.mesh)
        o, _ = run_with_executor(q, k, v, g, beta, ex, chunk_size=_CHUNK, packed=packed)
    return self.o_proj(self.o_norm(o, gate).reshape(B, T, self.num_heads * self.head_dim))


def _make_forward(cls: type) -> Callable[..., torch.Tensor]:
    """The rewritten forward of a stock KDA class (its signature and doc kept)."""

    @functools.wraps(cls.forward)  # type: ignore[attr-defined]  # the stock signature and doc
    @checked_entry(
        f"parallelize_kda ({cls.__name__}) forward", group=forward_mesh, extra=FORWARD_FIELDS
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


def check_rewrite(
    layer: nn.Module,
    cp_mesh: Any,
    protocol: Any,
    kernel: Any,
    *,
    what: str,
    layer_name: str,
    classes: tuple[str, ...],
    attributes: tuple[str, ...],
    dims: Callable[[Any], tuple[int, int, int]],
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The checks every layer rewrite makes before any communication (``what``: the rewrite's
    name, installed as ``layer_name``; ``classes``/``attributes``: the modules it accepts;
    ``dims(module)``: the conv channels and the recurrence's ``K``, ``V``); its activation."""
    module: Any = layer  # attributes checked below, by name
    if is_parallelized(module, layer_name):
        undo = what.replace("parallelize_", "unparallelize_", 1)
        raise RuntimeError(f"{what} was already applied to this module; call {undo} first")
    name = type(module).__name__
    missing = [a for a in attributes if not hasattr(module, a)]
    if not isinstance(layer, nn.Module) or name not in classes or missing:
        raise TypeError(
            f"{what} supports {', '.join(classes)} (Hugging Face transformers), got {name}"
            + (f" without {missing}" if missing else "")
        )
    from hyper_parallel.dtensor import DeviceMesh

    if not isinstance(cp_mesh, DeviceMesh):
        raise TypeError(f"cp_mesh must be a 1-D torch DeviceMesh, got {type(cp_mesh).__name__}")
    if cp_mesh.ndim != 1:
        raise ValueError(f"the context-parallel mesh must be 1-D, got {cp_mesh!r}")
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; expected one of {PROTOCOLS}")
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNELS}")
    channels, K, V = dims(module)
    if kernel == "triton" and (why := check_kernel_dims(K, V)):
        raise ValueError(f"{what}: kernel 'triton' does not support these dims: {why}")
    if module.activation not in _ACTIVATIONS:
        known = sorted(str(a) for a in _ACTIVATIONS if a is not None)
        raise ValueError(f"{what}: activation {module.activation!r} not in {known}")
    weight = module.conv1d.weight
    if tuple(weight.shape) != (channels, 1, module.conv_kernel_size):
        raise ValueError(
            f"{what}: conv1d weight {tuple(weight.shape)} is not the depthwise "
            f"[{channels}, 1, {module.conv_kernel_size}] of q/k/v"
        )
    return _ACTIVATIONS[module.activation]


def local_compute(module: Any, local_kernel: Any, name: str) -> StockKernel | None:
    """The stock kernel ``local_kernel`` selects for ``module`` (its modeling module's chunk
    function ``name``), or None for the project's torch path; checks before any
    communication."""
    if local_kernel not in LOCAL_KERNELS:
        raise ValueError(f"unknown local_kernel {local_kernel!r}; expected one of {LOCAL_KERNELS}")
    if local_kernel == "torch":
        return None
    try:
        found = stock_kernel(module, name)
    except TypeError:
        if local_kernel == "stock":
            raise
        return None
    return found if resolve_local_kernel(local_kernel, found) == "stock" else None


def _validate(
    layer: nn.Module, cp_mesh: Any, protocol: Any, kernel: Any
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Every check of :func:`parallelize_kda` (before any communication); the activation."""
    return check_rewrite(
        layer, cp_mesh, protocol, kernel, what="parallelize_kda", layer_name=LAYER,
        classes=SUPPORTED_KDA_CLASSES, attributes=_ATTRIBUTES,
        dims=lambda m: (3 * m.num_heads * m.head_dim, m.head_dim, m.head_dim),
    )  # fmt: skip


@accepts_backend("parallelize_kda")
@checked_entry(
    "parallelize_kda",
    compare=("protocol", "group_size", "kernel", "local_kernel"),
    group="cp_mesh",
    extra=PARALLELIZE_FIELDS,
)
def parallelize_kda(
    module: nn.Module,
    cp_mesh: Any,
    *,
    protocol: str = "auto",
    group_size: int | None = None,
    kernel: str = "auto",
    local_kernel: str = "auto",
) -> nn.Module:
    """Rewrite a stock KDA layer in place for context parallelism over the 1-D ``cp_mesh``.

    Afterwards ``module(hidden_states [B, T_r, D])`` on rank ``r`` (block ``r`` of the
    sequence, in the mesh's rank order; blocks may differ in length, be shorter than the
    convolution window or empty) returns those rows of the serial layer's output; the input's
    gradient equals the serial one's rows, and each parameter's gradient summed over the ranks
    equals the serial gradient (parameters stay whole and replicated). ``protocol`` and
    ``group_size`` choose the state exchange (see :func:`build_state_exchange`); its executor
    (and the grouped sub-meshes) is built here, collectively, so call this on every rank in
    the same order, and the module keeps it: a forward neither builds nor looks up an
    executor. ``kernel`` is its merge/scan fold kernel (``"auto"``, ``"torch"``,
    ``"triton"``, see :func:`choose_kernel`; ``backend=`` is accepted as a deprecated name).
    ``local_kernel`` is each rank's local compute of the recurrence
    (:mod:`hyper_parallel.kda.stock`): ``"stock"``, the chunk function the stock layer itself
    calls (``chunk_kimi_delta_attention`` of its modeling module: fla's fused ``chunk_kda``
    where transformers bound it to fla, its PyTorch reference elsewhere), called twice a
    block (the summary, then the outputs from the incoming state) with gradients through its
    own backward; ``"torch"``, the project's lean chunk path (:mod:`hyper_parallel.kda.lean`);
    ``"auto"`` (default), the stock kernel exactly when it is fused (fla's), else the
    project's path. Returns ``module``.

    Errors before any communication, leaving the module untouched: ``TypeError`` (a module
    other than :data:`SUPPORTED_KDA_CLASSES`, ``cp_mesh`` not a DeviceMesh,
    ``local_kernel="stock"`` for a layer whose module has no chunk function), ``RuntimeError``
    (already parallelized), ``ValueError`` (mesh not 1-D or not in chronological rank order,
    unknown protocol, kernel or local_kernel, bad ``group_size``, unsupported activation,
    ``kernel="triton"`` with a head dim it does not support). At call time, on every
    rank: ``cache_params`` or ``attention_mask`` not None, ``seq_idx``, a bad ``cu_seqlens``
    (see below) or a malformed ``hidden_states`` raise ``ValueError``.

    Packed documents: ``module(hidden_states, cu_seqlens=offsets)`` with ``offsets`` the global
    document offsets ``[0, …, T]`` over the whole sequence (1-D integer, identical on every
    rank, ``B == 1``) gives this rank's rows of the serial layer run on each document alone:
    the convolution reads no row of an earlier document and the recurrence restarts from zero
    at each start (see :mod:`hyper_parallel.kda.packing`: one all-gather of the block lengths,
    then the same exchanges as without documents). ``module(hidden_states,
    sequence_context=ctx)`` instead (hp-dtensor's ``SequenceContext`` over ``cp_mesh``, built
    once per forward by the caller, e.g. hp-models) takes the documents and the block's place
    from the context: no host read of the table, no gather (an unchecked context's
    fingerprint is compared once, with one all-gather). Ranks given different tables raise
    ``SequenceMismatchError`` on every rank, also with consistency mode off.

    Consistency mode (hp-dtensor's README, "Ranks that disagree"): before the executor is
    built, the ranks of ``cp_mesh`` compare ``protocol``, ``group_size``, ``kernel``, the
    layer's class, sizes and parameter dtype. Each forward is compared once, before anything
    else: ``hidden_states``' batch and feature sizes, dtype and device type (not its block
    length ``T_r``), the rejected arguments given, the ``cu_seqlens`` table's values (a
    sequence context's table, block lengths and whether it is unchecked), the halo width
    ``W − 1``, the protocol and what ``"auto"`` chose, the fold kernel, the layer's sizes and
    parameter dtypes, the autocast state, training mode, whether autograd records and whether
    gradients flow; the halo, the block placement and the recurrence it runs compare nothing
    more, nor does its backward.
    """
    activation = _validate(module, cp_mesh, protocol, kernel)
    local = local_compute(module, local_kernel, "chunk_kimi_delta_attention")
    # checks, then builds (or takes this world's executor for these options): once, here
    executor = executor_for(cp_mesh, protocol, group_size, kernel, None)
    state = _KDAState(
        cp_mesh, protocol, group_size, type(module).__name__, activation, executor, local
    )
    install_forward(module, LAYER, state, _make_forward, prefix="ContextParallel")
    return module


def unparallelize_kda(module: nn.Module) -> nn.Module:
    """Undo :func:`parallelize_kda` (``RuntimeError`` if it was not applied)."""
    if not is_parallelized(module, LAYER):
        raise RuntimeError("module is not context-parallel (parallelize_kda was not applied)")
    uninstall_forward(module, LAYER)
    return module


def is_kda_parallel(module: nn.Module) -> bool:
    """Whether :func:`parallelize_kda` rewrote ``module``."""
    return is_parallelized(module, LAYER)


class ContextParallelKDA(ParallelStyle):
    """torch ``ParallelStyle`` form of :func:`parallelize_kda`, for ``parallelize_module``::

    parallelize_module(model, cp_mesh, {"model.layers.0.self_attn": ContextParallelKDA()})
    """

    @accepts_backend("ContextParallelKDA")
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
        return parallelize_kda(
            module,
            device_mesh,
            protocol=self.protocol,
            group_size=self.group_size,
            kernel=self.kernel,
            local_kernel=self.local_kernel,
        )
