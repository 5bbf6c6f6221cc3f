"""The consistency signatures of a ``parallelize_kda``-ed forward and of ``parallelize_kda``
itself (what the ranks compare in consistency mode; see :mod:`hyper_parallel.kda.parallelize`)."""

from __future__ import annotations

from typing import Any

import torch

from hyper_parallel.dtensor.rewrite import parallel_state

from .layer import chosen_protocol, read_field, table_values
from .merge import choose_kernel

LAYER = "parallelize_kda"  # the name this rewrite is installed under (hp-dtensor's rewrite)


def forward_fields(
    self: Any,
    hidden_states: Any,
    cache_params: Any = None,
    attention_mask: Any = None,
    **kwargs: Any,
) -> tuple[Any, dict[str, Any]]:
    """One forward's consistency signature, compared once before anything else: it also
    covers what the halo, the block placement and the recurrence would compare (their inputs
    derive from ``hidden_states``, the layer, the autocast state and the module's options).
    Not compared: the block length ``T_r`` (blocks may differ)."""
    state = parallel_state(self, LAYER)
    x, mesh = hidden_states, state.mesh
    B = read_field(lambda: x.shape[0])
    dims = read_field(lambda: (x.shape[0], self.num_heads, self.head_dim, self.head_dim))
    params = list(self.parameters())
    kernel = state.executor.kernel
    given = (("cache_params", cache_params), ("attention_mask", attention_mask),
             ("seq_idx", kwargs.get("seq_idx")))  # fmt: skip
    return mesh.get_group(0), {
        "hidden_states_B_D": read_field(lambda: (B, x.shape[-1])),
        "dtype": read_field(lambda: str(x.dtype)),
        "device": read_field(lambda: x.device.type),
        "rejected_arguments": tuple(name for name, value in given if value is not None),
        "cu_seqlens": table_values(kwargs.get("cu_seqlens")),
        "sequence_context": _context_fields(kwargs.get("sequence_context")),
        "halo_width": read_field(lambda: self.conv_kernel_size - 1),
        "protocol": state.protocol,
        "group_size": state.group_size,
        "protocol_chosen": read_field(
            lambda: chosen_protocol(mesh, state.protocol, state.group_size, dims, None)
        ),
        "kernel": kernel,
        "kernel_chosen": read_field(
            lambda: choose_kernel(x.device, self.head_dim, self.head_dim, kernel)[0]
        ),
        "layer": read_field(lambda: layer_signature(self)),
        "param_dtypes": sorted({str(p.dtype) for p in params}),
        "autocast": read_field(lambda: _autocast_state(x.device.type)),
        "training": self.training,
        "grad_enabled": torch.is_grad_enabled(),
        "needs_grad": read_field(
            lambda: torch.is_grad_enabled() and (x.requires_grad or _any_grad(params))
        ),
        "cp_size": mesh.size(),
    }


def _context_fields(ctx: Any) -> Any:
    """A sequence context as compared across ranks: its table, whether it is still unchecked
    (the forward then gathers its fingerprint) and the block lengths (None for none)."""
    if ctx is None:
        return None
    return read_field(lambda: (ctx.offsets, ctx.needs_check, ctx.lengths))


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
