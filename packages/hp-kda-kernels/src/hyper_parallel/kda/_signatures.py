"""The consistency signatures of a ``parallelize_kda``-ed forward and of ``parallelize_kda``
itself (what the ranks compare in consistency mode; see :mod:`hyper_parallel.kda.parallelize`)."""

from __future__ import annotations

from typing import Any

import torch

from hyper_parallel.dtensor.rewrite import parallel_state

from ._checks import table_values
from .layer import chosen_protocol
from .merge import choose_kernel

LAYER = "parallelize_kda"  # the name this rewrite is installed under (hp-dtensor's rewrite)


def _state(args: Any) -> Any:
    return parallel_state(args.self, LAYER)


def forward_mesh(args: Any) -> Any:
    """The mesh a forward compares over: the layer's CP mesh."""
    return _state(args).mesh


def _rejected(args: Any) -> tuple[str, ...]:
    given = (("cache_params", args.cache_params), ("attention_mask", args.attention_mask),
             ("seq_idx", args.kwargs.get("seq_idx")))  # fmt: skip
    return tuple(name for name, value in given if value is not None)


def _protocol_chosen(args: Any) -> Any:
    self, x, state = args.self, args.hidden_states, _state(args)
    dims = (x.shape[0], self.num_heads, self.head_dim, self.head_dim)
    return chosen_protocol(state.mesh, state.protocol, state.group_size, dims, None)


def _kernel_chosen(args: Any) -> Any:
    self, kernel = args.self, _state(args).executor.kernel
    return choose_kernel(args.hidden_states.device, self.head_dim, self.head_dim, kernel)[0]


def _context(args: Any) -> Any:
    """A sequence context as compared across ranks: its table, whether it is still unchecked
    (the forward then gathers its fingerprint) and the block lengths (None for none)."""
    ctx = args.kwargs.get("sequence_context")
    return None if ctx is None else (ctx.offsets, ctx.needs_check, ctx.lengths)


def _needs_grad(args: Any) -> bool:
    x, params = args.hidden_states, list(args.self.parameters())
    return torch.is_grad_enabled() and (x.requires_grad or _any_grad(params))


# One forward's consistency fields (``checked_entry``'s ``extra``, over :func:`forward_mesh`),
# compared once before anything else: they also cover what the halo, the block placement and
# the recurrence would compare (their inputs derive from ``hidden_states``, the layer, the
# autocast state and the module's options). Not compared: the block length ``T_r`` (blocks
# may differ).
FORWARD_FIELDS: dict[str, Any] = {
    "hidden_states_B_D": lambda a: (a.hidden_states.shape[0], a.hidden_states.shape[-1]),
    "dtype": lambda a: str(a.hidden_states.dtype),
    "device": lambda a: a.hidden_states.device.type,
    "rejected_arguments": _rejected,
    "cu_seqlens": lambda a: table_values(a.kwargs.get("cu_seqlens")),
    "sequence_context": _context,
    "halo_width": lambda a: a.self.conv_kernel_size - 1,
    "protocol": lambda a: _state(a).protocol,
    "group_size": lambda a: _state(a).group_size,
    "protocol_chosen": _protocol_chosen,
    "kernel": lambda a: _state(a).executor.kernel,
    "kernel_chosen": _kernel_chosen,
    "layer": lambda a: layer_signature(a.self),
    "param_dtypes": lambda a: sorted({str(p.dtype) for p in a.self.parameters()}),
    "autocast": lambda a: _autocast_state(a.hidden_states.device.type),
    "training": lambda a: a.self.training,
    "grad_enabled": lambda a: torch.is_grad_enabled(),
    "needs_grad": _needs_grad,
    "cp_size": lambda a: _state(a).mesh.size(),
}

# ``parallelize_kda``'s fields beside its options (covers the executor it builds)
PARALLELIZE_FIELDS: dict[str, Any] = {
    "module": lambda a: type(a.module).__name__,
    "layer": lambda a: layer_signature(a.module),
    "cp_size": lambda a: a.cp_mesh.size(),
}


def _any_grad(params: list[torch.Tensor]) -> bool:
    return any(p.requires_grad for p in params)


def _autocast_state(device_type: str) -> Any:
    """Autocast on ``device_type``: its dtype, or False (the projections' output dtype, so
    the halo's, follows it)."""
    if not torch.is_autocast_enabled(device_type):
        return False
    return str(torch.get_autocast_dtype(device_type))


def layer_signature(module: Any) -> tuple[Any, ...]:
    """The sizes and parameter dtype of a KDA layer (compared across ranks when checking)."""
    return (
        module.hidden_size,
        module.num_heads,
        module.head_dim,
        module.conv_kernel_size,
        module.activation,
        str(module.q_proj.weight.dtype),
    )
