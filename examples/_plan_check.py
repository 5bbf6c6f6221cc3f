"""The planner's prediction beside what the ranks of the main job measured (train_hybrid.py).

On every rank, one step (:class:`PlanMeter`): the peak of the tensors its forward and backward
create (parameter gradients and FSDP2's buffers left out, up to the optimizer step), the bytes
of every collective (hp-dtensor's recorder and FSDP2's), and at the optimizer step the bytes of
the parameters, gradients and optimizer states it holds. In the launcher (no process group),
``hyper_parallel.models.plan_memory`` plans the same model, mesh and batch
(:func:`plan_lines`): each quantity's plan, the busiest rank's measurement and their ratio.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from hyper_parallel.models.plan.measure import count_collectives, held_bytes, track_activations

QUANTITIES = ("parameters", "gradients", "optimizer", "activations")


class PlanMeter:
    """Measures one step (``step``) of this rank for :func:`plan_lines`."""

    def __init__(self, model: torch.nn.Module, step: int) -> None:
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        self.model, self.step = model, step
        self.measured: dict[str, Any] = {}
        self._trace: Any = None
        self._cut: int | None = None
        register_optimizer_step_pre_hook(self._before_step)
        register_optimizer_step_post_hook(self._after_step)

    def _before_step(self, opt: Any, args: Any, kwargs: Any) -> None:
        if self._trace is not None and self._cut is None:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            self._trace.exclude_tensors(grads)
            self._cut = len(self._trace.events)
            self.measured.update(held_bytes(self.model, None))  # gradients still held

    def _after_step(self, opt: Any, args: Any, kwargs: Any) -> None:
        if self._trace is not None and "optimizer" not in self.measured:
            self.measured["optimizer"] = held_bytes(self.model, opt)["optimizer"]

    @contextlib.contextmanager
    def around(self, step: int) -> Iterator[None]:
        if step != self.step:
            yield
            return
        with track_activations() as trace, count_collectives(trace) as moved:
            self._trace = trace
            yield
        self.measured["activations"] = trace.peak(self._cut)
        self.measured["collectives"] = moved
        self._trace = None


def plan_step(trace_step: int, steps: int) -> int:
    """The measured step: the one after the traced step (whose recorder would nest), past the
    first (FSDP2's lazy set-up, AdamW's states made) where the run is long enough."""
    return (trace_step + 1) % steps


def job_config(t: Any) -> Any:
    """The config of the job's model: the folder's, or the built-in tiny model's."""
    if getattr(t, "folder", None):
        import transformers

        return transformers.AutoConfig.from_pretrained(t.folder)
    import train

    return train.build_model(t).config


def plan_lines(
    config: Any,
    t: Any,
    step: int,
    grad_reduction: str,
    per_rank: list[dict[str, Any]],
    stages: list[list[int]] | None = None,
) -> str:
    """The plan of ``config`` on the job's mesh and batch beside the busiest rank's
    measurement, per quantity and per collective (bytes, and plan / measured). A pipeline
    (``stages``: each rank's stages): the quantities beside the ranks holding the stages of the
    plan's busiest pp rank, the collectives beside their busiest rank."""
    from hyper_parallel.models import plan_memory
    from hyper_parallel.models.plan.traffic import collective_name

    dims = t.mesh if len(t.mesh) == 3 else (1, *t.mesh)
    pipe: dict[str, Any] = {}
    if getattr(t, "pp", 1) > 1:  # the pipeline as pipeline_model runs it: the busiest pp rank
        pipe = dict(pp=t.pp, microbatches=t.microbatches, schedule=t.schedule,
                    stages_per_rank=t.stages_per_rank, layer_split=t.layer_split)  # fmt: skip
    plan = plan_memory(
        config,
        dims=dims,
        ep=t.ep,
        seq_len=t.seq,
        batch=t.batch,
        dtype=getattr(torch, t.dtype),
        grad_reduction=grad_reduction,
        device_type=t.device,
        **pipe,
    )
    which = "busiest rank"
    held = per_rank
    if pipe and stages is not None:  # the same pp rank on both sides
        mine = [r for r, s in enumerate(stages) if tuple(s) == tuple(plan.stages)]
        held = [per_rank[r] for r in mine] or per_rank
        which = (f"busiest pp rank (stages {', '.join(map(str, plan.stages))}: ranks "
                 f"{', '.join(map(str, mine))}; collectives: busiest rank)")  # fmt: skip
    lines = [
        f"plan (hyper_parallel.models.plan_memory) vs measured, step {step}, {which}:",
        f"  {'quantity':28s} {'plan':>12s} {'measured':>12s} {'ratio':>7s}",
    ]

    def row(name: str, planned: int, got: int) -> None:
        ratio = f"{planned / got:.2f}" if got else "-"
        lines.append(f"  {name:28s} {planned:12,d} {got:12,d} {ratio:>7s}")

    for q in QUANTITIES:
        row(q, getattr(plan, q), max(int(r.get(q, 0)) for r in held))
    busiest: dict[str, int] = {}
    for r in per_rank:
        merged: dict[str, int] = {}  # chunks (moe:dispatch0, 1, ...) added up
        for name, n in r.get("collectives", {}).items():
            merged[collective_name(name)] = merged.get(collective_name(name), 0) + n
        for name, n in merged.items():
            busiest[name] = max(busiest.get(name, 0), n)
    for name in sorted(set(busiest) | set(plan.collectives)):
        row(name, plan.collectives.get(name, 0), busiest.get(name, 0))
    return "\n".join(lines)
