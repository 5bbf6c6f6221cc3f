"""The mesh planner: for a model, a sequence length and a mesh, what the busiest rank holds and
what it moves per training step, from the real placement (``python -m
hyper_parallel.models.plan`` ranks every mesh of N devices; see :mod:`.__main__`).

- :func:`plan_memory` -> :class:`MemoryPlan`: parameters, gradients and optimizer states
  counted on the real ``parallelize_model`` over a fake process group (:mod:`.placement`),
  activations from each block's cost model (:mod:`.activations`), the bytes per collective
  (:mod:`.traffic` and FSDP2's units).
- :mod:`.measure`: the same quantities measured on a real step, to set beside the plan.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from hyper_parallel.models.plan.activations import (
    ATTN_IMPLEMENTATIONS,
    KDA_KERNELS,
    activation_bytes,
)
from hyper_parallel.models.plan.placement import OPTIMIZERS, kinds_in_order, place_on_fake_world
from hyper_parallel.models.plan.traffic import layer_collectives, merged

__all__ = ["ATTN_IMPLEMENTATIONS", "KDA_KERNELS", "OPTIMIZERS", "MemoryPlan", "plan_memory"]

GRAD_REDUCTIONS = ("fsdp", "allreduce")


@dataclass
class MemoryPlan:
    """One rank's plan (the busiest rank; bytes).

    ``parameters``, ``gradients``, ``optimizer`` (the states after a step): counted on the
    placement; ``activations``: the peak of one forward + backward, ``saved_activations``:
    what the forward keeps for backward; ``gathered_layer``: the largest layer as FSDP2
    all-gathers it (held during its forward and backward, twice with prefetch);
    ``collectives``: bytes over this rank's link per step by collective (hp-dtensor's
    recorder's names, FSDP2's as ``fsdp.*``); ``flops``: the rank's model FLOPs a step
    (``6·active parameters·tokens`` plus causal attention's ``6·T²/2`` per head dim).
    """

    dims: tuple[int, int, int]
    ep: int
    seq_len: int
    batch: int
    dtype: torch.dtype
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    saved_activations: int
    gathered_layer: int
    param_count: int
    flops: float
    collectives: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """Parameters, gradients, optimizer states, activations and two gathered layers."""
        return (
            self.parameters
            + self.gradients
            + self.optimizer
            + self.activations
            + 2 * self.gathered_layer
        )

    @property
    def comm_bytes(self) -> int:
        """Every collective's bytes a step."""
        return sum(self.collectives.values())


def _dims(dims: Any) -> tuple[int, int, int]:
    if isinstance(dims, Mapping):
        dims = (dims.get("dp", 1), dims.get("cp", 1), dims.get("tp", 1))
    out = tuple(int(x) for x in dims)
    if len(out) == 2:
        out = (1, *out)
    if len(out) != 3 or min(out) < 1:
        raise ValueError(f"dims must be (dp, cp, tp) of positive ints, got {dims!r}")
    return out  # type: ignore[return-value]


def _flops(shapes: list[Any], config: Any, tokens: int, seq: int, rows: int, p: int) -> float:
    """Model FLOPs of one rank a step: ``6·(active parameters)·n`` with ``n`` the rank's
    tokens, plus causal attention (``2·2·T²/2`` per head dim a row, ×3 for backward,
    ``H/P`` heads a rank)."""
    d, v = int(config.hidden_size), int(config.vocab_size)
    active = 2 * v * d  # embedding rows are looked up, but the head is a matmul; count both
    attn = 0.0
    for shape, count in shapes:
        g = shape.get
        if shape.attn == "mla":
            h = g("H")
            q = (
                d * g("q_lora") + g("q_lora") * h * (g("nope") + g("rope"))
                if g("q_lora")
                else (d * h * (g("nope") + g("rope")))
            )
            kv = d * (g("kv_lora") + g("rope")) + g("kv_lora") * h * (g("nope") + g("dv"))
            active += count * (q + kv + h * g("dv") * d)
            attn += count * 3 * rows * (h / p) * seq * seq * (g("nope") + g("rope") + g("dv"))
        elif shape.attn == "gqa":
            h, hd = g("H"), g("d")
            active += count * d * hd * (h * (2 + g("gated")) + 2 * g("Hkv"))
            attn += count * 3 * rows * (h / p) * seq * seq * 2 * hd
        elif shape.attn == "gdn":
            hk, hv, k, v = g("Hk"), g("Hv"), g("K"), g("V")
            active += count * d * (2 * hk * k + 3 * hv * v + 2 * hv)
            attn += count * 6 * rows * hv * (seq / p) * (64 * (k + v) + 2 * k * v)  # chunks
        else:
            h, k = g("H"), g("K")
            active += count * (4 * d * h * k + 2 * d * k)
            attn += count * 6 * rows * h * (seq / p) * (64 * k + 2 * k * k)  # chunks
        if shape.mlp == "dense":
            active += count * 3 * d * g("I")
        else:
            active += count * (3 * d * g("I") * g("k") + 3 * d * g("Is") + d * g("E"))
    return 6.0 * active * tokens + attn


def plan_memory(
    config: Any,
    *,
    dims: Any,
    ep: int = 1,
    seq_len: int,
    batch: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    optimizer: str = "adamw",
    grad_reduction: str = "fsdp",
    activation_checkpointing: bool = False,
    attn_implementation: str = "flash",
    kda_kernel: str = "torch",
    kda_protocol: str = "auto",
    device_type: str = "cpu",
) -> MemoryPlan:
    """Plan one training step of the stock model of ``config`` (a ``DeepseekV3Config``,
    ``KimiLinearConfig``, ...) under ``parallelize_model(model, mesh, ep=ep,
    grad_reduction=grad_reduction)`` on the ``dims = (dp, cp, tp)`` mesh (or a mapping
    ``{"dp": .., "cp": .., "tp": ..}``), ``batch`` rows of ``seq_len`` tokens (each rank holds
    ``batch/dp`` rows of ``seq_len/(cp·tp)`` tokens), parameters in ``dtype`` and ``optimizer``
    (``"adamw"``: two states shaped like each local parameter and a float32 step; ``"sgd"``:
    none), with or without Hugging Face's activation checkpointing.

    ``attn_implementation``: the attention kernel (``"flash"``/``"sdpa"``: a fused kernel
    keeps no ``T×T`` scores; ``"eager"``/``"sdpa-math"``: it keeps the softmax
    probabilities; CPU sdpa runs the math for MLA, whose q/k and v head dims differ);
    ``kda_kernel``: the KDA / Gated DeltaNet chunk kernel (``"torch"``: hp-kda-kernels' lean
    path, what ``parallelize_model`` runs where no fused kernel is installed, its bytes
    measured at the real head sizes on first use; ``"fused"``: one that keeps its inputs and a
    state per chunk, as flash-linear-attention's does); ``kda_protocol`` and
    ``device_type`` (``"cpu"``/``"cuda"``/``"npu"``): the KDA state exchange, ``"auto"`` as
    the layer's own cost model picks it for that device.

    Runs in one process with no process group of its own (it makes torch's fake one of
    ``dp·cp·tp`` ranks and removes it); raises ``RuntimeError`` where one exists, and
    ``parallelize_model``'s own errors for a mesh it cannot use.
    """
    dp, cp, tp = _dims(dims)
    if grad_reduction not in GRAD_REDUCTIONS:
        raise ValueError(f"grad_reduction must be one of {GRAD_REDUCTIONS}, got {grad_reduction!r}")
    if batch % dp:
        raise ValueError(f"batch {batch} is not divisible by dp = {dp}")
    p = cp * tp
    if seq_len % p:
        raise ValueError(f"seq_len {seq_len} is not divisible by cp·tp = {p}")
    placement, shapes = place_on_fake_world(
        config, (dp, cp, tp), ep=ep, dtype=dtype, optimizer=optimizer, grad_reduction=grad_reduction
    )
    rows = batch // dp
    acts = activation_bytes(
        shapes,
        config,
        rows=rows,
        seq=seq_len,
        p=p,
        ep=ep,
        dtype=dtype,
        attn_implementation=attn_implementation,
        kda_kernel=kda_kernel,
        checkpointing=activation_checkpointing,
        order=kinds_in_order(config, dtype),
    )
    layers = layer_collectives(
        shapes,
        dims=(dp, cp, tp),
        rows=rows,
        seq=seq_len,
        ep=ep,
        b=dtype.itemsize,
        device_type=device_type,
        kda_protocol=kda_protocol,
        checkpointing=activation_checkpointing,
    )
    tokens = rows * seq_len // p
    return MemoryPlan(
        dims=(dp, cp, tp),
        ep=ep,
        seq_len=seq_len,
        batch=batch,
        dtype=dtype,
        parameters=placement.parameters,
        gradients=placement.gradients,
        optimizer=placement.optimizer,
        activations=acts.peak,
        saved_activations=acts.saved,
        gathered_layer=placement.gathered_layer,
        param_count=placement.param_count,
        flops=_flops(shapes, config, tokens, seq_len, rows, p),
        collectives=merged(placement.collectives, layers),
    )
