"""Which activations the gated MLP may apply to a feature shard: per-element ones only.

Tensor parallelism hands each rank ``G = X W_gᵀ`` for its own slice of the ``F`` intermediate
features, so ``act(G)`` is only exact when every output element depends on the matching input
element alone. That cannot be read off an arbitrary callable, so this is an allow-list:

- torch's per-element ``nn`` activation classes (``nn.SiLU``, ``nn.GELU``, ``nn.ReLU``, ...)
  and functions (``F.silu``, ``F.gelu``, ``torch.relu``, ``torch.tanh``, ...);
- the per-element activation classes of Hugging Face's ``ACT2FN`` (``SiLUActivation``,
  ``GELUActivation``, ``GELUTanh``, ``NewGELUActivation``, ...), recognised by class name and
  defining module (``transformers.*``) so this package never imports transformers.

Rejected, with the reason: anything else (``nn.Softmax``, ``nn.GLU``, anything with a ``dim``
argument, user callables), activations with parameters (``nn.PReLU``, ``XIELUActivation``:
their gradient would be a per-rank partial sum) and in-place ones (``inplace=True``: they would
overwrite the pre-activation kept for backward). The check is exact-type, so a subclass that
changes ``forward`` is not trusted either.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["check_elementwise_activation"]

_TORCH_MODULES: frozenset[type] = frozenset(
    {
        nn.CELU,
        nn.ELU,
        nn.GELU,
        nn.Hardshrink,
        nn.Hardsigmoid,
        nn.Hardswish,
        nn.Hardtanh,
        nn.Identity,
        nn.LeakyReLU,
        nn.LogSigmoid,
        nn.Mish,
        nn.ReLU,
        nn.ReLU6,
        nn.SELU,
        nn.SiLU,
        nn.Sigmoid,
        nn.Softplus,
        nn.Softshrink,
        nn.Softsign,
        nn.Tanh,
        nn.Tanhshrink,
        nn.Threshold,
    }
)

_HF_MODULES = frozenset(
    {
        "AccurateGELUActivation",
        "ClippedGELUActivation",
        "FastGELUActivation",
        "GELUActivation",
        "GELUTanh",
        "LaplaceActivation",
        "LinearActivation",
        "MishActivation",
        "NewGELUActivation",
        "PytorchGELUTanh",
        "QuickGELUActivation",
        "ReLUSquaredActivation",
        "SiLUActivation",
        "SqrtSoftplusActivation",
    }
)

_FUNCTIONS: frozenset[Callable[..., Any]] = frozenset(
    {
        F.celu,
        F.elu,
        F.gelu,
        F.hardsigmoid,
        F.hardswish,
        F.hardtanh,
        F.leaky_relu,
        F.logsigmoid,
        F.mish,
        F.relu,
        F.relu6,
        F.selu,
        F.sigmoid,
        F.silu,
        F.softplus,
        F.softsign,
        F.tanh,
        torch.relu,
        torch.sigmoid,
        torch.tanh,
    }
)


def _describe(act: Any) -> str:
    return repr(act) if isinstance(act, nn.Module) else getattr(act, "__qualname__", repr(act))


def check_elementwise_activation(act: Any, where: str) -> None:
    """Raise ``ValueError`` (``TypeError`` for a non-callable) unless ``act`` is a known
    per-element, parameter-free, out-of-place activation. ``where`` prefixes the message."""
    if not callable(act):
        raise TypeError(f"{where}: act_fn must be callable, got {type(act).__name__}")
    if isinstance(act, nn.Module):
        cls = type(act)
        known = cls in _TORCH_MODULES or (
            cls.__name__ in _HF_MODULES and cls.__module__.startswith("transformers.")
        )
        if any(True for _ in act.parameters()):
            raise ValueError(
                f"{where}: act_fn {_describe(act)} has parameters; under tensor parallelism "
                "their gradient would be a per-rank partial sum, so it is not supported"
            )
        if getattr(act, "inplace", False):
            raise ValueError(
                f"{where}: act_fn {_describe(act)} is in-place; the pre-activation is kept for "
                "backward, use the out-of-place form (inplace=False)"
            )
    else:
        known = act in _FUNCTIONS
    if not known:
        raise ValueError(
            f"{where}: act_fn {_describe(act)} is not known to be per-element; each rank "
            "applies it to its own slice of the intermediate features, which is exact only for "
            "per-element activations (nn.SiLU/GELU/ReLU/..., F.silu/gelu/relu/..., Hugging Face "
            "ACT2FN activations; not softmax-like or dim-wise ones)"
        )
