"""The mesh planner: for a model, a sequence length and a mesh, what the busiest rank holds and
what it moves per training step, from the real placement (``python -m
hyper_parallel.models.plan`` ranks every mesh of N devices; see :mod:`.__main__`).

- :func:`plan_memory` -> :class:`MemoryPlan`: parameters, gradients and optimizer states
  counted on the real ``parallelize_model`` over a fake process group (:mod:`.placement`),
  activations from each block's cost model (:mod:`.activations`), the bytes per collective
  (:mod:`.traffic` and FSDP2's units); for ``pipeline_model`` (``pp``, micro-batches, a
  schedule) each stage's share, what torch's schedule keeps in flight and its bubble
  (:mod:`.schedule`), every pp rank (:class:`RankPlan`) and stage (:class:`StagePlan`).
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
    stage_activation_bytes,
)
from hyper_parallel.models.plan.placement import (
    OPTIMIZERS,
    compose,
    costs_of,
    kinds_in_order,
    place_on_fake_world,
    place_parts,
)
from hyper_parallel.models.plan.schedule import SCHEDULES, bubble, in_flight_peak, rank_actions
from hyper_parallel.models.plan.traffic import layer_collectives, merged

__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "KDA_KERNELS",
    "OPTIMIZERS",
    "SCHEDULES",
    "MemoryPlan",
    "RankPlan",
    "StagePlan",
    "plan_memory",
]

GRAD_REDUCTIONS = ("fsdp", "allreduce")
P2P_NAME = "p2p:pipeline"  # the hidden states and their gradients between pipeline stages
PIPELINE_LOSS = "all_reduce:pipeline_loss"  # the step's loss summed over the pp group


@dataclass
class StagePlan:
    """One pipeline stage on one of its ranks (bytes): ``layers`` its decoder layers,
    ``pp_rank`` the pp rank holding it; ``parameters``, ``gradients``, ``optimizer`` as
    placed; ``gathered`` its FSDP2 units' gathered bytes (held from the step's first forward
    to its last backward, beside as many bytes of unsharded gradients); ``saved`` and
    ``peak``: one micro-batch's activations kept for backward and their peak through its own
    forward + backward; ``flops`` and ``collectives``: the whole step's (every micro-batch;
    FSDP2's once, the pipeline's point-to-point and loss left to :class:`RankPlan`)."""

    index: int
    layers: range
    pp_rank: int
    parameters: int
    gradients: int
    optimizer: int
    gathered: int
    saved: int
    peak: int
    flops: float
    collectives: dict[str, int] = field(default_factory=dict)


@dataclass
class RankPlan:
    """One pp rank (its ``stages``; bytes): the sums over its stages, ``activations`` the peak
    of what the schedule keeps in flight (``saved_activations``: the most its forwards keep at
    once, ``in_flight``: the most micro-batch stages at once), ``buffers`` the receive
    buffers torch's stages allocate for every micro-batch (hidden states from the previous
    rank, gradients from the next), ``collectives`` everything it moves a step."""

    pp_rank: int
    stages: tuple[int, ...]
    parameters: int
    gradients: int
    optimizer: int
    gathered: int
    activations: int
    saved_activations: int
    in_flight: int
    buffers: int
    flops: float
    collectives: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """Parameters, gradients, optimizer states, activations, buffers, and the gathered
        parameters with their unsharded gradients."""
        return (
            self.parameters
            + self.gradients
            + self.optimizer
            + self.activations
            + self.buffers
            + 2 * self.gathered
        )

    @property
    def comm_bytes(self) -> int:
        return sum(self.collectives.values())


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

    A pipeline (``pp > 1`` or ``microbatches > 1``: ``pipeline_model``): ``dims`` stays
    ``(dp, cp, tp)``, each stage's mesh, and :attr:`mesh_dims` is ``(pp, dp, cp, tp)``; the
    bytes are those of the busiest pp rank (``pp_rank``, holding ``stages``; every rank in
    ``ranks``, every stage in ``stage_plans``), ``activations`` what its schedule keeps in
    flight at its peak (``in_flight`` micro-batch stages at most), ``pipeline_buffers`` torch's
    receive buffers, ``gathered_stage`` its stages' FSDP2 units gathered for the whole step
    (their unsharded gradients as many bytes again); ``collectives`` each collective at its
    busiest rank (with ``p2p:pipeline``, the hidden states and gradients a rank sends to its
    neighbours), ``flops`` the most of any rank; ``bubble`` the schedule's idle share with
    equal stages (:mod:`.schedule`); ``stage_layers`` the decoder layers of each stage.
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
    pp: int = 1
    microbatches: int = 1
    schedule: str | None = None
    stages_per_rank: int = 1
    bubble: float = 0.0
    stage_layers: tuple[int, ...] = ()
    pp_rank: int = 0
    stages: tuple[int, ...] = ()
    in_flight: int = 1
    gathered_stage: int = 0
    pipeline_buffers: int = 0
    ranks: list[RankPlan] = field(default_factory=list)
    stage_plans: list[StagePlan] = field(default_factory=list)

    @property
    def pipelined(self) -> bool:
        """Whether this plans ``pipeline_model`` (a schedule) rather than
        ``parallelize_model``."""
        return self.schedule is not None

    @property
    def mesh_dims(self) -> tuple[int, int, int, int]:
        """``(pp, dp, cp, tp)``."""
        return (self.pp, *self.dims)

    @property
    def devices(self) -> int:
        return self.pp * self.dims[0] * self.dims[1] * self.dims[2]

    @property
    def gathered(self) -> int:
        """FSDP2's gathered parameters this rank holds at its peak: two layers (prefetch),
        or a pipeline rank's stages with their unsharded gradients."""
        return 2 * (self.gathered_stage if self.pipelined else self.gathered_layer)

    @property
    def total(self) -> int:
        """Parameters, gradients, optimizer states, activations, the pipeline's receive
        buffers and :attr:`gathered`."""
        return (
            self.parameters
            + self.gradients
            + self.optimizer
            + self.activations
            + self.pipeline_buffers
            + self.gathered
        )

    @property
    def comm_bytes(self) -> int:
        """Every collective's bytes a step."""
        return sum(self.collectives.values())

    @property
    def rank_comm_bytes(self) -> int:
        """The most bytes any one rank moves a step (every collective of its own)."""
        if not self.ranks:
            return self.comm_bytes
        return max(r.comm_bytes for r in self.ranks)


def _dims(dims: Any) -> tuple[int | None, int, int, int]:
    """``(pp or None, dp, cp, tp)`` of ``dims``: ``(cp, tp)``, ``(dp, cp, tp)``,
    ``(pp, dp, cp, tp)`` (pp first, as the pipeline mesh has it) or a mapping of those
    names."""
    pp: Any = None
    if isinstance(dims, Mapping):
        unknown = set(dims) - {"pp", "dp", "cp", "tp"}
        if unknown:
            raise ValueError(f"dims has unknown mesh dims {sorted(unknown)}: pp, dp, cp, tp")
        pp = dims.get("pp")
        dims = (dims.get("dp", 1), dims.get("cp", 1), dims.get("tp", 1))
    out = tuple(int(x) for x in dims)
    if len(out) == 2:
        out = (1, *out)
    if len(out) == 4:
        pp, out = out[0], out[1:]
    if len(out) != 3 or min(out) < 1 or (pp is not None and int(pp) < 1):
        raise ValueError(
            f"dims must be (dp, cp, tp) or (pp, dp, cp, tp) of positive ints, got {dims!r}"
        )
    return (None if pp is None else int(pp), *out)  # type: ignore[return-value]


def _flops(
    shapes: list[Any],
    config: Any,
    tokens: int,
    seq: int,
    rows: int,
    p: int,
    *,
    embed: bool = True,
    head: bool = True,
) -> float:
    """Model FLOPs of one rank a step: ``6·(active parameters)·n`` with ``n`` the rank's
    tokens, plus causal attention (``2·2·T²/2`` per head dim a row, ×3 for backward,
    ``H/P`` heads a rank); ``embed``/``head``: with the embeddings / the LM head (a pipeline
    stage holds them only first / last)."""
    d, v = int(config.hidden_size), int(config.vocab_size)
    # embedding rows are looked up, but the head is a matmul; count both
    active = (int(embed) + int(head)) * v * d
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
    pp: int | None = None,
    microbatches: int = 1,
    schedule: str = "1F1B",
    stages_per_rank: int = 1,
    layer_split: Any = None,
) -> MemoryPlan:
    """Plan one training step of the stock model of ``config`` (a ``DeepseekV3Config``,
    ``KimiLinearConfig``, ...) under ``parallelize_model(model, mesh, ep=ep,
    grad_reduction=grad_reduction)`` on the ``dims = (dp, cp, tp)`` mesh (or a mapping
    ``{"dp": .., "cp": .., "tp": ..}``), ``batch`` rows of ``seq_len`` tokens (each rank holds
    ``batch/dp`` rows of ``seq_len/(cp·tp)`` tokens), parameters in ``dtype`` and ``optimizer``
    (``"adamw"``: two states shaped like each local parameter and a float32 step; ``"sgd"``:
    none), with or without Hugging Face's activation checkpointing.

    Pipeline parallelism: ``pp`` (or ``dims = (pp, dp, cp, tp)`` / a mapping with ``"pp"``),
    ``microbatches``, ``schedule``, ``stages_per_rank`` and ``layer_split`` plan
    ``pipeline_model(model, mesh, microbatches=..., schedule=..., stages_per_rank=...,
    layer_split=..., ep=ep, grad_reduction=grad_reduction)`` on the ``(pp, dp, cp, tp)`` mesh
    (``pp = 1`` with ``microbatches = 1`` is ``parallelize_model``): the layers split into
    ``pp·stages_per_rank`` stages as the runtime splits them (by cost, or ``layer_split``),
    each stage placed on its ``dp·cp·tp`` ranks like a model holding only its layers (the
    embeddings on the first, the final norm and the LM head on the last), FSDP2's units
    gathered once a step and kept, with their unsharded gradients, until the step's last
    backward (``reshard_after_forward=False``, gradient sync on the last micro-batch only),
    micro-batches of ``batch/(dp·m)`` rows kept in flight as torch's schedule runs them
    (:mod:`.schedule`), the hidden states ``[batch/(dp·m), seq_len/(cp·tp), hidden]`` and
    their gradients sent between the ranks of neighbouring stages. The plan is the busiest
    pp rank's (by its total bytes), every rank and stage beside it (:class:`MemoryPlan`).

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
    ``parallelize_model``'s (``pipeline_model``'s) own errors for a mesh it cannot use.
    """
    pp_dims, dp, cp, tp = _dims(dims)
    if pp is not None and pp_dims is not None and pp != pp_dims:
        raise ValueError(f"pp={pp} but dims give pp = {pp_dims}")
    pp = pp if pp is not None else (pp_dims or 1)
    if grad_reduction not in GRAD_REDUCTIONS:
        raise ValueError(f"grad_reduction must be one of {GRAD_REDUCTIONS}, got {grad_reduction!r}")
    if batch % dp:
        raise ValueError(f"batch {batch} is not divisible by dp = {dp}")
    p = cp * tp
    if seq_len % p:
        raise ValueError(f"seq_len {seq_len} is not divisible by cp·tp = {p}")
    kw: dict[str, Any] = dict(
        ep=ep, seq_len=seq_len, batch=batch, dtype=dtype, optimizer=optimizer,
        grad_reduction=grad_reduction, activation_checkpointing=activation_checkpointing,
        attn_implementation=attn_implementation, kda_kernel=kda_kernel,
        kda_protocol=kda_protocol, device_type=device_type,
    )  # fmt: skip
    if pp > 1 or microbatches != 1 or stages_per_rank != 1 or layer_split is not None:
        return _plan_pipeline(
            config, (dp, cp, tp), pp=pp, microbatches=microbatches, schedule=schedule,
            stages_per_rank=stages_per_rank, layer_split=layer_split, **kw,
        )  # fmt: skip
    return _plan_whole(config, (dp, cp, tp), **kw)


def _plan_whole(
    config: Any,
    dims: tuple[int, int, int],
    *,
    ep: int,
    seq_len: int,
    batch: int,
    dtype: torch.dtype,
    optimizer: str,
    grad_reduction: str,
    activation_checkpointing: bool,
    attn_implementation: str,
    kda_kernel: str,
    kda_protocol: str,
    device_type: str,
) -> MemoryPlan:
    """``parallelize_model``'s step (:func:`plan_memory` without a pipeline)."""
    dp, cp, tp = dims
    p = cp * tp
    placement, shapes = place_on_fake_world(
        config, dims, ep=ep, dtype=dtype, optimizer=optimizer, grad_reduction=grad_reduction
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
        dims=dims,
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
        dims=dims,
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


_SPLITS: dict[tuple[Any, ...], list[int]] = {}


def _split(config: Any, dtype: torch.dtype, num_stages: int, layer_split: Any) -> list[int]:
    """Decoder layers a stage, as ``pipeline_model`` splits them (by cost: computed once per
    model and stage count)."""
    from hyper_parallel.models.pipeline.split import balanced_split, check_layer_split

    costs, head = costs_of(config, dtype)
    if layer_split is not None:
        return check_layer_split(layer_split, len(costs), num_stages)
    key = (tuple(costs), head, num_stages)
    if key not in _SPLITS:
        if len(_SPLITS) > 256:
            _SPLITS.clear()
        _SPLITS[key] = balanced_split(costs, num_stages, last_extra=head)
    return list(_SPLITS[key])


def _plan_pipeline(
    config: Any,
    dims: tuple[int, int, int],
    *,
    pp: int,
    microbatches: int,
    schedule: str,
    stages_per_rank: int,
    layer_split: Any,
    ep: int,
    seq_len: int,
    batch: int,
    dtype: torch.dtype,
    optimizer: str,
    grad_reduction: str,
    activation_checkpointing: bool,
    attn_implementation: str,
    kda_kernel: str,
    kda_protocol: str,
    device_type: str,
) -> MemoryPlan:
    """``pipeline_model``'s step (:func:`plan_memory`'s docstring)."""
    from hyper_parallel.models.pipeline.schedules import check_schedule, stages_of_rank
    from hyper_parallel.models.pipeline.split import stage_ranges

    dp, cp, tp = dims
    p = cp * tp
    m = microbatches
    spec = check_schedule(schedule, pp, stages_per_rank, m)
    if batch % (dp * m):
        raise ValueError(
            f"batch {batch} does not divide into microbatches·dp = {m}·{dp}: each micro-batch "
            "takes batch/microbatches rows and each dp replica batch/(microbatches·dp) of them"
        )
    num_stages = pp * stages_per_rank
    sizes = _split(config, dtype, num_stages, layer_split)
    ranges = stage_ranges(sizes)
    order = kinds_in_order(config, dtype)
    b = dtype.itemsize
    rows = batch // (dp * m)  # a micro-batch's rows on one rank
    n = rows * seq_len // p
    hidden = n * int(config.hidden_size) * b  # one micro-batch's hidden states on one rank
    parts, shapes = place_parts(
        config, dims, ep=ep, dtype=dtype, optimizer=optimizer, grad_reduction=grad_reduction
    )
    holder = {s: r for r in range(pp) for s in stages_of_rank(spec, r, pp, stages_per_rank)}
    last = num_stages - 1
    tokens = batch // dp * seq_len // p  # a rank's tokens a step, every micro-batch
    act_kw: dict[str, Any] = dict(
        rows=rows, seq=seq_len, p=p, ep=ep, b=b, attn_implementation=attn_implementation,
        kda_kernel=kda_kernel, checkpointing=activation_checkpointing,
    )  # fmt: skip
    stage_plans: list[StagePlan] = []
    for s, layers in enumerate(ranges):
        kinds = [order[i] for i in layers]
        first_s, last_s = s == 0, s == last
        placed, gathered = compose(parts, kinds, embed=first_s, head=last_s, layer_gathers=1)
        counted = [(shape, kinds.count(k)) for k, (shape, _) in enumerate(shapes)]
        counted = [(shape, c) for shape, c in counted if c]
        acts = stage_activation_bytes(shapes, config, kinds, first=first_s, last=last_s, **act_kw)
        moved = layer_collectives(
            counted, dims=dims, rows=rows, seq=seq_len, ep=ep, b=b, device_type=device_type,
            kda_protocol=kda_protocol, checkpointing=activation_checkpointing, loss=False,
        )  # fmt: skip
        moved = {k: v * m for k, v in moved.items() if v}
        if last_s:  # each micro-batch's loss share summed over the stage's ranks
            moved["all_reduce:loss"] = m * _link("all_reduce", 4, dp * p)
        flops = _flops(counted, config, tokens, seq_len, batch // dp, p, embed=first_s, head=last_s)
        stage_plans.append(
            StagePlan(
                index=s,
                layers=layers,
                pp_rank=holder[s],
                parameters=placed.parameters,
                gradients=placed.gradients,
                optimizer=placed.optimizer,
                gathered=gathered,
                saved=acts.saved,
                peak=acts.peak,
                flops=flops,
                collectives=merged(placed.collectives, moved),
            )
        )
    actions = rank_actions(schedule, pp, m, stages_per_rank)
    ranks: list[RankPlan] = []
    for r in range(pp):
        mine = [sp for sp in stage_plans if sp.pp_rank == r]
        peak, kept, most = in_flight_peak(
            actions[r], {sp.index: sp.saved for sp in mine}, {sp.index: sp.peak for sp in mine}
        )
        buffers = sends = 0
        for sp in mine:
            if sp.index > 0 and holder[sp.index - 1] != r:  # hidden states in, gradient out
                buffers += m * hidden
                sends += m * hidden
            if sp.index < last and holder[sp.index + 1] != r:  # gradient in, hidden states out
                buffers += m * hidden
                sends += m * hidden
        extra = {P2P_NAME: sends, PIPELINE_LOSS: _link("all_reduce", 4, pp)}
        ranks.append(
            RankPlan(
                pp_rank=r,
                stages=tuple(sp.index for sp in mine),
                parameters=sum(sp.parameters for sp in mine),
                gradients=sum(sp.gradients for sp in mine),
                optimizer=sum(sp.optimizer for sp in mine),
                gathered=sum(sp.gathered for sp in mine),
                activations=peak,
                saved_activations=kept,
                in_flight=most,
                buffers=buffers,
                flops=sum(sp.flops for sp in mine),
                collectives=merged(
                    *(sp.collectives for sp in mine), {k: v for k, v in extra.items() if v}
                ),
            )
        )
    busiest = max(ranks, key=lambda rp: (rp.total, -rp.pp_rank))
    collectives: dict[str, int] = {}
    for rp in ranks:  # each collective at its busiest rank
        for k, v in rp.collectives.items():
            collectives[k] = max(collectives.get(k, 0), v)
    param_count = sum(parts.kinds[k].param_count for k in order)
    param_count += parts.embed.param_count + parts.head.param_count + parts.other.param_count
    mine = [sp for sp in stage_plans if sp.pp_rank == busiest.pp_rank]
    return MemoryPlan(
        dims=dims,
        ep=ep,
        seq_len=seq_len,
        batch=batch,
        dtype=dtype,
        parameters=busiest.parameters,
        gradients=busiest.gradients,
        optimizer=busiest.optimizer,
        activations=busiest.activations,
        saved_activations=busiest.saved_activations,
        gathered_layer=max(
            (parts.kinds[order[i]].gathered_layer for sp in mine for i in sp.layers), default=0
        ),
        param_count=param_count,
        flops=max(rp.flops for rp in ranks),
        collectives=collectives,
        pp=pp,
        microbatches=m,
        schedule=schedule,
        stages_per_rank=stages_per_rank,
        bubble=bubble(schedule, pp, m, stages_per_rank, activation_checkpointing),
        stage_layers=tuple(sizes),
        pp_rank=busiest.pp_rank,
        stages=busiest.stages,
        in_flight=busiest.in_flight,
        gathered_stage=busiest.gathered,
        pipeline_buffers=busiest.buffers,
        ranks=ranks,
        stage_plans=stage_plans,
    )


def _link(op: str, nbytes: int, size: int) -> int:
    from hyper_parallel.dtensor.comm import link_bytes

    return link_bytes(op, nbytes, size)
