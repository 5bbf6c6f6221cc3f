"""Every mesh of N devices a model can use, each planned and ranked.

A mesh is ``(dp, cp, tp)`` with ``dp·cp·tp = N`` and ``ep``: ``cp·tp`` divides the MLA heads
(each rank computes ``H/(cp·tp)`` heads) and the sequence length, ``tp <= tp_max`` (tp's
all-gathers run every layer: kept inside a node), ``ep`` divides the routed experts and
``N``. Ranked: the meshes that fit first, then by modeled step time, then by memory.

Modeled step time (no overlap of compute and communication: an upper bound):
``flops / (peak · mfu) + bytes / link``, with the busiest rank's model FLOPs and its
bytes over its link per step (:class:`~hyper_parallel.models.plan.MemoryPlan`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from hyper_parallel.models.plan import MemoryPlan, plan_memory

__all__ = ["Candidate", "meshes", "rank_meshes", "real_config"]

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
    """One planned mesh: the plan, whether it fits ``memory``, its modeled times (s)."""

    plan: MemoryPlan
    checkpointing: bool
    fits: bool
    t_compute: float
    t_comm: float

    @property
    def t_step(self) -> float:
        return self.t_compute + self.t_comm


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
    checkpointing: tuple[bool, ...] = (False, True),
    progress: bool = False,
    tp_max: int = 8,
    eps: list[int] | None = None,
    **plan_kw: Any,
) -> list[Candidate]:
    """Plan every mesh of :func:`meshes` (``rows`` rows of ``seq_len`` tokens per dp replica),
    with and without activation checkpointing, and rank them (module docstring)."""
    out = []
    todo = meshes(config, devices, seq_len, tp_max=tp_max, eps=eps)
    for dims, ep in _each(todo, progress):
        base = plan_memory(
            config, dims=dims, ep=ep, seq_len=seq_len, batch=rows * dims[0], **plan_kw
        )
        for ac in checkpointing:
            plan = base
            if ac:
                plan = plan_memory(
                    config,
                    dims=dims,
                    ep=ep,
                    seq_len=seq_len,
                    batch=rows * dims[0],
                    activation_checkpointing=True,
                    **plan_kw,
                )
            # activation checkpointing recomputes the forward: one more forward's FLOPs
            factor = 4 / 3 if ac else 1.0
            out.append(
                Candidate(
                    plan,
                    ac,
                    plan.total <= memory,
                    factor * plan.flops / (flops * mfu),
                    plan.comm_bytes / link_bytes_per_s,
                )
            )
    out.sort(key=lambda c: (not c.fits, c.t_step, c.plan.total))
    return out
