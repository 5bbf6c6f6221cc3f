"""The consistency signatures of a ``parallelize_kda``-ed (or ``parallelize_gated_deltanet``-ed)
forward and of the rewrite itself (what the ranks compare in consistency mode; see
:mod:`hyper_parallel.kda.parallelize`). One set of fields, parametrised by the rewrite's name
and the layer's ``(H, K, V)`` and signature functions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hyper_parallel.dtensor.rewrite import parallel_state

from ._checks import table_values
from .layer import chosen_protocol
from .merge import choose_kernel

LAYER = "parallelize_kda"  # the name this rewrite is installed under (hp-dtensor's rewrite)
GDN_LAYER = "parallelize_gated_deltanet"
REJECTED_KWARGS = ("seq_idx", "cu_seq_lens_q", "cu_seq_lens_k")  # given: a forward raises


def _mesh_of(layer: str) -> Callable[[Any], Any]:
    def forward_mesh(args: Any) -> Any:
        """The mesh a forward compares over: the layer's CP mesh."""
        return parallel_state(args.self, layer).mesh

    return forward_mesh


forward_mesh = _mesh_of(LAYER)
gdn_forward_mesh = _mesh_of(GDN_LAYER)


def _rejected(args: Any) -> tuple[str, ...]:
    given = [("cache_params", args.cache_params), ("attention_mask", args.attention_mask)]
    given += [(name, args.kwargs.get(name)) for name in REJECTED_KWARGS]
    return tuple(name for name, value in given if value is not None)


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
def forward_fields(
    layer: str, hkv: Callable[[Any], tuple[int, int, int]], signature: Callable[[Any], Any]
) -> dict[str, Any]:
    """The fields of a forward of the rewrite ``layer``; ``hkv(module)`` gives the recurrence's
    ``(H, K, V)``, ``signature(module)`` the layer's sizes and parameter dtype."""

    def _state(args: Any) -> Any:
        return parallel_state(args.self, layer)

    def _protocol_chosen(args: Any) -> Any:
        state = _state(args)
        dims = (args.hidden_states.shape[0], *hkv(args.self))
        return chosen_protocol(state.mesh, state.protocol, state.group_size, dims, None)

    def _kernel_chosen(args: Any) -> Any:
        _, K, V = hkv(args.self)
        kernel = _state(args).executor.kernel
        return choose_kernel(args.hidden_states.device, K, V, kernel)[0]

    return {
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
        "local_kernel": lambda a: _state(a).local_kernel,
        "layer": lambda a: signature(a.self),
        "param_dtypes": lambda a: sorted({str(p.dtype) for p in a.self.parameters()}),
        "autocast": lambda a: _autocast_state(a.hidden_states.device.type),
        "training": lambda a: a.self.training,
        "grad_enabled": lambda a: torch.is_grad_enabled(),
        "needs_grad": _needs_grad,
        "cp_size": lambda a: _state(a).mesh.size(),
    }


def parallelize_fields(signature: Callable[[Any], Any]) -> dict[str, Any]:
    """A rewrite's fields beside its options (covers the executor it builds)."""
    return {
        "module": lambda a: type(a.module).__name__,
        "layer": lambda a: signature(a.module),
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


def gdn_signature(module: Any) -> tuple[Any, ...]:
    """The sizes and parameter dtype of a Gated DeltaNet layer."""
    return (
        module.hidden_size,
        module.num_k_heads,
        module.num_v_heads,
        module.head_k_dim,
        module.head_v_dim,
        module.conv_kernel_size,
        module.activation,
        str(module.conv1d.weight.dtype),
    )


# The recurrence's (H, K, V) of each layer kind: KDA's heads; Gated DeltaNet's value heads
# (q and k repeated to them), key and value head dims.
FORWARD_FIELDS = forward_fields(LAYER, lambda m: (m.num_heads, m.head_dim, m.head_dim),
                                layer_signature)  # fmt: skip
PARALLELIZE_FIELDS = parallelize_fields(layer_signature)
GDN_FORWARD_FIELDS = forward_fields(
    GDN_LAYER, lambda m: (m.num_v_heads, m.head_k_dim, m.head_v_dim), gdn_signature
)
GDN_PARALLELIZE_FIELDS = parallelize_fields(gdn_signature)
