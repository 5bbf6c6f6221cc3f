"""Every mesh of N devices a model can use, each planned and ranked.

A mesh is ``(pp, dp, cp, tp)`` with ``pp·dp·cp·tp = N`` and ``ep``: ``cp·tp`` divides the
MLA heads (each rank computes ``H/(cp·tp)`` heads) and the sequence length, ``tp <= tp_max``
(tp's all-gathers run every layer: kept inside a node), ``ep`` divides the routed experts and
each stage's ``dp·cp·tp`` ranks; ``pp`` (default: 1 and every divisor of N up to ``pp_max``
whose stages the layers can fill) runs ``pipeline_model`` with each schedule asked for
(``1F1B``, ``Interleaved1F1B`` with 2 stages a rank, ...) and micro-batches ``m`` (powers of
two from the least the schedule takes up to ``max_microbatches``). The batch: ``rows``
sequences per dp replica and micro-batch (a step of a pipeline runs ``m`` of them), or a
fixed global ``batch`` (each mesh splits it into ``dp`` replicas of ``m`` micro-batches).
Ranked: the meshes that fit first, then by modeled tokens a second per device, then by memory.

Modeled step time (no overlap of compute and communication: an upper bound):
``flops / (peak · mfu) / (1 − bubble) + bytes / link``, with the busiest rank's model FLOPs,
the schedule's bubble (:func:`hyper_parallel.models.plan.schedule.bubble`; 0 without a
pipeline) and the most bytes one rank moves over its link per step
(:class:`~hyper_parallel.models.plan.MemoryPlan`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from hyper_parallel.models.plan import MemoryPlan, plan_memory
from hyper_parallel.models.plan.schedule import rank_actions

__all__ = ["Candidate", "meshes", "pipeline_options", "rank_meshes", "real_config"]

# the published Kimi-Linear-48B-A3B layer pattern (1-indexed, as in its config.json): MLA at
# layers 4, 8, ..., 24, 27; KimiLinearConfig()'s own default differs (no MLA at 27)
_KIMI_MLA_LAYERS = (4, 8, 12, 16, 20, 24, 27)
_KIMI_LINEAR_ATTN = {
    "full_attn_layers": list(_KIMI_MLA_LAYERS),
    "kda_layers": [i for i in range(1, 28) if i not in _KIMI_MLA_LAYERS],
    "num_heads": 32,
    "head_dim": 128,
    "short_conv_kernel_size": 4,
}
MODELS = ("deepseek-v3", "kimi-linear", "qwen3-next")


def real_config(name: str) -> Any:
    """The published model's config: ``"deepseek-v3"`` (``DeepseekV3Config()``'s defaults:
    671B, without the multi-token-prediction layer), ``"kimi-linear"`` (Kimi-Linear-48B-A3B,
    with its checkpoint's layer pattern), ``"qwen3-next"`` (``Qwen3NextConfig()``'s defaults:
    Qwen3-Next-80B-A3B), or a path to a folder / ``config.json``."""
    import transformers

    cfg: Any
    if name == "deepseek-v3":
        cfg = transformers.DeepseekV3Config()
    elif name == "kimi-linear":
        published: dict[str, Any] = {"linear_attn_config": _KIMI_LINEAR_ATTN}
        cfg = transformers.KimiLinearConfig(**published)
    elif name == "qwen3-next":
        cfg = transformers.Qwen3NextConfig()
    else:
        cfg = transformers.AutoConfig.from_pretrained(name)
    cfg._experts_implementation = "eager"
    return cfg


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _model_limits(config: Any) -> tuple[int | None, int | None]:
    """``(MLA heads or None, routed experts or None)`` of ``config``."""
    heads = getattr(config, "num_attention_heads", None)
    experts = getattr(config, "n_routed_experts", None) or getattr(config, "num_experts", None)
    return heads, experts


def meshes(
    config: Any, devices: int, seq_len: int, *, tp_max: int = 8, eps: list[int] | None = None
) -> list[tuple[tuple[int, int, int], int]]:
    """Every valid ``((dp, cp, tp), ep)`` of ``devices`` (module docstring)."""
    heads, experts = _model_limits(config)
    out = []
    for tp in _divisors(devices):
        if tp > tp_max:
            continue
        for cp in _divisors(devices // tp):
            p = cp * tp
            if (heads and heads % p) or seq_len % p:
                continue
            dp = devices // p
            ep_options = eps or [e for e in _divisors(devices) if experts and experts % e == 0]
            for ep in ep_options or [1]:
                if devices % ep or (experts and experts % ep):
                    continue
                out.append(((dp, cp, tp), ep))
    return out


@dataclass
class Candidate:
    """One planned mesh: the plan, whether it fits ``memory``, its modeled times (s; the
    compute with the pipeline's bubble)."""

    plan: MemoryPlan
    checkpointing: bool
    fits: bool
    t_compute: float
    t_comm: float

    @property
    def t_step(self) -> float:
        return self.t_compute + self.t_comm

    @property
    def tokens_per_s(self) -> float:
        """Tokens a second per device: the global batch's tokens over the step time and the
        devices."""
        p = self.plan
        return p.batch * p.seq_len / (self.t_step * p.devices)


# the schedules searched by default, with their stages a rank
DEFAULT_SCHEDULES = (("1F1B", 1), ("Interleaved1F1B", 2))


def pipeline_options(
    pp: int,
    layers: int,
    *,
    schedules: tuple[tuple[str, int], ...] = DEFAULT_SCHEDULES,
    max_microbatches: int = 32,
    microbatches: list[int] | None = None,
    rows: int | None = None,
) -> list[tuple[str, int, int]]:
    """``(schedule, stages a rank, micro-batches)`` a pipeline of ``pp`` ranks can run over
    ``layers`` decoder layers (``pp·stages_per_rank`` stages, each a layer at least):
    ``microbatches``, or the powers of two from the least the schedule takes (``pp``; ``2·pp``
    for the V schedules; 1 for GPipe) up to ``max_microbatches``, each dividing ``rows`` (the
    rows a dp replica holds a step) where it is given; ``[("", 1, 1)]`` for ``pp = 1``."""
    from hyper_parallel.models.pipeline.schedules import check_schedule

    if pp == 1:
        return [("", 1, 1)]
    out = []
    for name, v in schedules:
        if pp * v > layers:
            continue
        least = 1 if name == "GPipe" else (2 * pp if name in ("ZBVZeroBubble", "DualPipeV") else pp)
        if microbatches:
            options = list(microbatches)
        else:
            options = []
            m = 1
            while m <= max_microbatches:
                if m >= least:
                    options.append(m)
                m *= 2
        for m in options:
            if rows is not None and rows % m:
                continue
            try:
                check_schedule(name, pp, v, m)
                rank_actions(name, pp, m, v)  # a torch that cannot list its order: left out
            except ValueError:
                continue
            out.append((name, v, m))
    return out


def _progress(total: int) -> Callable[[int], None]:
    start = time.perf_counter()
    shown = [False]

    def update(done: int) -> None:
        elapsed = time.perf_counter() - start
        if not shown[0] and elapsed < 2.0 and done < total:
            return
        shown[0] = True
        width = 30
        filled = width * done // max(total, 1)
        eta = elapsed / max(done, 1) * (total - done)
        sys.stderr.write(
            f"\r[{'#' * filled}{' ' * (width - filled)}] {done}/{total} meshes, "
            f"{elapsed:.0f} s, about {eta:.0f} s left "
        )
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return update


def _each(items: list[Any], progress: bool) -> Iterator[Any]:
    update = _progress(len(items)) if progress else None
    for i, item in enumerate(items):
        yield item
        if update is not None:
            update(i + 1)


def rank_meshes(
    config: Any,
    devices: int,
    seq_len: int,
    *,
    memory: int,
    flops: float,
    mfu: float,
    link_bytes_per_s: float,
    rows: int = 1,
    batch: int | None = None,
    checkpointing: tuple[bool, ...] = (False, True),
    progress: bool = False,
    tp_max: int = 8,
    eps: list[int] | None = None,
    pps: list[int] | None = None,
    pp_max: int | None = None,
    schedules: tuple[tuple[str, int], ...] = DEFAULT_SCHEDULES,
    microbatches: list[int] | None = None,
    max_microbatches: int = 32,
    **plan_kw: Any,
) -> list[Candidate]:
    """Plan every mesh of :func:`meshes` for each ``pp`` (``pps``; default: 1 and every
    divisor of ``devices`` up to ``pp_max`` whose stages the layers fill) and each pipeline
    option (:func:`pipeline_options`), with and without activation checkpointing, and rank
    them (module docstring). ``rows``: sequences per dp replica and micro-batch; ``batch``:
    a fixed global batch instead (a mesh whose ``dp·m`` does not divide it is left out)."""
    layers = int(config.num_hidden_layers)
    if pps is None:
        pps = [p for p in _divisors(devices) if p <= (pp_max or devices) and p <= layers]
    todo = []
    for pp in pps:
        if devices % pp:
            continue
        for dims, ep in meshes(config, devices // pp, seq_len, tp_max=tp_max, eps=eps):
            dp = dims[0]
            if batch is not None and batch % dp:
                continue
            per_replica = None if batch is None else batch // dp
            options = pipeline_options(
                pp, layers, schedules=schedules, max_microbatches=max_microbatches,
                microbatches=microbatches, rows=per_replica,
            )  # fmt: skip
            todo += [(pp, dims, ep, opt) for opt in options]
    out = []
    for pp, dims, ep, (schedule, v, m) in _each(todo, progress):
        global_batch = batch if batch is not None else rows * dims[0] * m
        kw: dict[str, Any] = dict(dims=dims, ep=ep, seq_len=seq_len, batch=global_batch)
        if pp > 1:
            kw.update(pp=pp, microbatches=m, schedule=schedule, stages_per_rank=v)
        for ac in checkpointing:
            plan = plan_memory(config, activation_checkpointing=ac, **kw, **plan_kw)
            # activation checkpointing recomputes the forward: one more forward's FLOPs
            factor = 4 / 3 if ac else 1.0
            compute = factor * plan.flops / (flops * mfu) / (1.0 - plan.bubble)
            out.append(
                Candidate(
                    plan,
                    ac,
                    plan.total <= memory,
                    compute,
                    plan.rank_comm_bytes / link_bytes_per_s,
                )
            )
    out.sort(key=lambda c: (not c.fits, -c.tokens_per_s, c.plan.total))
    return out
