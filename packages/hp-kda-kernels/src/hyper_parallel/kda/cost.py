"""An explainable cost model for choosing the state-exchange protocol.

Per direction (forward ≈ backward), with ``s = 4·B·H·K·V`` bytes per state, ``m = 4·B·H·K·(K+V)``
bytes per packed summary ``[S | M]`` and ``f = 2·B·H·K²·V`` flops per fold step
(``acc = M acc + S``):

- ``p2p``:        ``(P-1)·(α + s/β + f/F)`` — every hop is serial.
- ``allgather``:  ``α·⌈log2 P⌉ + (P-1)·m/β + (P-1)·f/F`` — one collective, the last rank folds
  ``P-1`` summaries.
- ``grouped(w)``: ``α·⌈log2 w⌉ + (w-1)·m/β`` (gather in the group)
  ``+ (P/w-1)·(α + s/β + w·f/F)`` (the chain of group leaders, each scanning its group)
  ``+ ⌈log2 w⌉·(α + s/β)`` (broadcast in the group) ``+ (w-1)·f/F`` (the in-group prefix).

``α`` is the latency of one message, ``β`` the bandwidth a rank receives at, ``F`` the fold's
matmul rate. The defaults per device type are rough; pass a :class:`CostParams` to override.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["DEFAULT_COST_PARAMS", "CostParams", "ProtocolChoice", "choose_protocol"]


@dataclass(frozen=True)
class CostParams:
    """Latency ``α`` (s per message), bandwidth ``β`` (bytes/s received) and fold rate ``F``
    (fp32 flop/s) of one rank."""

    latency_s: float
    bandwidth_Bps: float
    flops_per_s: float

    def __post_init__(self) -> None:
        for name in ("latency_s", "bandwidth_Bps", "flops_per_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"CostParams.{name} must be a positive number, got {value!r}")


DEFAULT_COST_PARAMS: dict[str, CostParams] = {
    # gloo over localhost TCP, one intra-op thread per rank (measured on a small CPU host).
    "cpu": CostParams(latency_s=1.5e-4, bandwidth_Bps=1.5e9, flops_per_s=2.0e10),
    # NVLink-class links, exact-fp32 (ieee) Triton fold.
    "cuda": CostParams(latency_s=1.5e-5, bandwidth_Bps=1.0e11, flops_per_s=2.0e13),
    # HCCS links on Ascend, exact-fp32 fold.
    "npu": CostParams(latency_s=2.0e-5, bandwidth_Bps=5.0e10, flops_per_s=1.0e13),
}


@dataclass(frozen=True)
class ProtocolChoice:
    """The chosen protocol, its group width (grouped only), every candidate's modelled
    seconds, and a one-line explanation."""

    protocol: str
    group_size: int | None
    costs: dict[str, float] = field(default_factory=dict)
    explanation: str = ""


def _log2(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


def _costs(
    P: int, B: int, H: int, K: int, V: int, p: CostParams, widths: list[int]
) -> dict[str, float]:
    a, bw, F = p.latency_s, p.bandwidth_Bps, p.flops_per_s
    s = 4.0 * B * H * K * V
    m = 4.0 * B * H * K * (K + V)
    f = 2.0 * B * H * K * K * V
    costs = {
        "p2p": (P - 1) * (a + s / bw + f / F),
        "allgather": a * _log2(P) + (P - 1) * m / bw + (P - 1) * f / F,
    }
    for w in widths:
        costs[f"grouped:{w}"] = (
            a * _log2(w) + (w - 1) * m / bw
            + (P // w - 1) * (a + s / bw + w * f / F)
            + _log2(w) * (a + s / bw)
            + (w - 1) * f / F
        )  # fmt: skip
    return costs


def grouped_widths(P: int) -> list[int]:
    """Group widths the grouped protocol can use on ``P`` ranks (``2 <= w < P``, ``w | P``)."""
    return [w for w in range(2, P) if P % w == 0]


def choose_protocol(
    world_size: int,
    batch: int,
    heads: int,
    k_dim: int,
    v_dim: int,
    *,
    device_type: str = "cpu",
    params: CostParams | None = None,
    group_sizes: list[int] | None = None,
) -> ProtocolChoice:
    """Pick the protocol with the smallest modelled time for one exchange direction.

    ``group_sizes`` restricts the grouped candidates (default: every ``w`` with ``2 <= w < P``
    dividing ``P``). A single rank needs no exchange and gets ``p2p`` (which then sends nothing).
    """
    for name, value in (
        ("world_size", world_size), ("batch", batch), ("heads", heads),
        ("k_dim", k_dim), ("v_dim", v_dim),
    ):  # fmt: skip
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if params is None:
        if device_type not in DEFAULT_COST_PARAMS:
            raise ValueError(
                f"no default cost parameters for device type {device_type!r}; pass params="
            )
        params = DEFAULT_COST_PARAMS[device_type]
    widths = grouped_widths(world_size) if group_sizes is None else list(group_sizes)
    for w in widths:
        if w not in grouped_widths(world_size):
            raise ValueError(f"group size {w} invalid for {world_size} ranks")
    if world_size == 1:
        return ProtocolChoice("p2p", None, {"p2p": 0.0}, "one rank: nothing to exchange")
    costs = _costs(world_size, batch, heads, k_dim, v_dim, params, widths)
    best = min(costs, key=costs.__getitem__)
    protocol, _, width = best.partition(":")
    ranked = ", ".join(f"{n}={c * 1e3:.3f}ms" for n, c in sorted(costs.items(), key=lambda x: x[1]))
    explanation = (
        f"P={world_size}, state {4 * batch * heads * k_dim * v_dim} B, α={params.latency_s:g}s, "
        f"β={params.bandwidth_Bps:g}B/s, F={params.flops_per_s:g}flop/s: {ranked}"
    )
    return ProtocolChoice(protocol, int(width) if width else None, costs, explanation)
