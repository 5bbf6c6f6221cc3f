"""``python -m hyper_parallel.models.plan --model deepseek-v3 --devices 256 --seq-len 32k``:
every valid mesh of N devices, pipeline parallelism included, planned from the real placement
and ranked (fits or not, the busiest rank's bytes, the bytes per collective a step, a modeled
step time and tokens a second per device); see :mod:`hyper_parallel.models.plan.search` and
:mod:`hyper_parallel.models.plan.devices`."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

import torch

from hyper_parallel.models.plan.activations import ATTN_IMPLEMENTATIONS, KDA_KERNELS
from hyper_parallel.models.plan.devices import DEVICES, link_bandwidth
from hyper_parallel.models.plan.schedule import SCHEDULES
from hyper_parallel.models.plan.search import DEFAULT_SCHEDULES, Candidate, rank_meshes, real_config

GIB = 2**30
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BIN = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _count(text: str) -> int:
    """``32k`` -> 32768, ``128K`` -> 131072, ``4096`` -> 4096 (tokens: k = 1024)."""
    m = re.fullmatch(r"(\d+)([kK]?)", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r}")
    return int(m.group(1)) * (1024 if m.group(2) else 1)


def _bytes(text: str) -> int:
    """``64GiB`` -> 64·2^30, ``64GB`` / ``64G`` -> 64·10^9."""
    m = re.fullmatch(r"([\d.]+)\s*([a-zA-Z]*)", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}")
    unit = m.group(2).lower()
    if unit in _BIN:
        return int(float(m.group(1)) * _BIN[unit])
    unit = unit.removesuffix("b")
    if unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"unknown unit in {text!r}")
    return int(float(m.group(1)) * _UNITS[unit])


def _link(text: str) -> float:
    """``npu`` / ``cuda`` / ``cpu`` (the layers' cost-model figures) or ``200GB/s``."""
    if text in ("npu", "cuda", "cpu"):
        return link_bandwidth(text)[0]
    return float(_bytes(text.removesuffix("/s")))


def _gib(n: float) -> str:
    return f"{n / GIB:.1f}"


def _schedule(p: Any) -> str:
    if not p.pipelined:
        return "-"
    v = f" ×{p.stages_per_rank}" if p.stages_per_rank > 1 else ""
    return f"{p.schedule}{v}, {p.microbatches}"


def _row(i: int, c: Candidate) -> str:
    p = c.plan
    top = max(p.collectives.items(), key=lambda kv: kv[1], default=("-", 0))
    return (
        f"| {i} | {', '.join(map(str, p.mesh_dims))} | {p.ep} | {_schedule(p)} "
        f"| {p.bubble:.2f} | {'on' if c.checkpointing else 'off'} "
        f"| {'yes' if c.fits else 'no'} | {_gib(p.parameters)} | {_gib(p.gradients)} "
        f"| {_gib(p.optimizer)} | {_gib(p.activations + p.pipeline_buffers)} "
        f"| {_gib(p.gathered)} | {_gib(p.total)} | {_gib(p.rank_comm_bytes)} "
        f"| {top[0]} {_gib(top[1])} | {c.t_compute:.2f} | {c.t_comm:.2f} | {c.t_step:.2f} "
        f"| {c.tokens_per_s:,.0f} |"
    )


HEADER = (
    "| # | pp, dp, cp, tp | ep | schedule, m | bubble | AC | fits | params | grads | optimizer "
    "| activations | gathered | total (GiB) | comm/step (GiB) | largest collective (GiB) "
    "| compute (s) | comm (s) | step (s) | tokens/s/device |"
)


def table(cands: list[Candidate], top: int) -> str:
    lines = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    lines += [_row(i + 1, c) for i, c in enumerate(cands[:top])]
    return "\n".join(lines)


def breakdown(c: Candidate) -> str:
    """The bytes per collective a step of one mesh, largest first."""
    lines = ["| collective | GiB/step/rank |", "|---|---:|"]
    for name, n in sorted(c.plan.collectives.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {name} | {n / GIB:.3f} |")
    return "\n".join(lines)


def stages(c: Candidate) -> str:
    """Each pipeline stage of one mesh: its layers, rank, held and gathered bytes, FSDP2's
    bytes a step."""
    lines = [
        "| stage | layers | pp rank | params (GiB) | gathered (GiB) | activations a micro-batch "
        "(GiB) | fsdp.all_gather (GiB) | fsdp.reduce_scatter (GiB) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for sp in c.plan.stage_plans:
        col = sp.collectives
        lines.append(
            f"| {sp.index} | {sp.layers.start}-{sp.layers.stop - 1} | {sp.pp_rank} "
            f"| {_gib(sp.parameters)} | {_gib(sp.gathered)} | {_gib(sp.saved)} "
            f"| {col.get('fsdp.all_gather', 0) / GIB:.2f} "
            f"| {col.get('fsdp.reduce_scatter', 0) / GIB:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hyper_parallel.models.plan", description=__doc__)
    ap.add_argument(
        "--model", required=True, help="deepseek-v3, kimi-linear, qwen3-next or a config path"
    )
    ap.add_argument("--devices", type=int, required=True, help="N: pp·dp·cp·tp")
    ap.add_argument("--seq-len", type=_count, required=True, help="tokens a sequence (32k = 32768)")
    ap.add_argument("--rows", type=int, default=1, help="sequences per dp replica and micro-batch")
    ap.add_argument(
        "--batch", type=int, help="a fixed global batch (sequences a step) instead of --rows"
    )
    ap.add_argument("--pp", type=int, action="append", help="only this pp (repeatable)")
    ap.add_argument("--pp-max", type=int, help="search pp up to this (default: every divisor)")
    ap.add_argument(
        "--schedule",
        action="append",
        choices=SCHEDULES,
        help="pipeline schedules to search (repeatable; default: 1F1B and Interleaved1F1B)",
    )
    ap.add_argument(
        "--stages-per-rank", type=int, default=2, help="stages a rank for Interleaved* (2)"
    )
    ap.add_argument(
        "--microbatches", type=int, action="append", help="only these micro-batches (repeatable)"
    )
    ap.add_argument("--max-microbatches", type=int, default=32, help="search m up to this")
    ap.add_argument("--device", choices=sorted(DEVICES), default="910B", help="the preset")
    ap.add_argument("--device-memory", type=_bytes, help="e.g. 64GiB (default: the preset's)")
    ap.add_argument("--link", type=_link, help="npu, cuda, cpu or e.g. 100GB/s a rank")
    ap.add_argument("--mfu", type=float, default=0.4, help="achieved share of peak FLOP/s")
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    ap.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    ap.add_argument("--checkpointing", choices=("off", "on", "both"), default="both")
    ap.add_argument("--attn-implementation", choices=ATTN_IMPLEMENTATIONS, default="flash")
    ap.add_argument("--kda-kernel", choices=KDA_KERNELS, default="torch")
    ap.add_argument("--tp-max", type=int, default=8)
    ap.add_argument("--ep", type=int, action="append", help="only this ep (repeatable)")
    ap.add_argument("--top", type=int, default=12, help="rows to print")
    ap.add_argument("--json", help="also write every candidate to this file")
    a = ap.parse_args(argv)
    os.environ.setdefault("HP_CHECK_CONSISTENCY", "0")
    device = DEVICES[a.device]
    memory = a.device_memory or device.memory
    link = a.link or link_bandwidth(device.device_type)[0]
    config = real_config(a.model)
    ac = {"off": (False,), "on": (True,), "both": (False, True)}[a.checkpointing]
    schedules: tuple[tuple[str, int], ...] = DEFAULT_SCHEDULES
    if a.schedule:
        multi = {"Interleaved1F1B": a.stages_per_rank, "InterleavedZeroBubble": a.stages_per_rank}
        fixed = {"ZBVZeroBubble": 2, "DualPipeV": 2}
        schedules = tuple((n, multi.get(n, fixed.get(n, 1))) for n in dict.fromkeys(a.schedule))
    cands = rank_meshes(
        config,
        a.devices,
        a.seq_len,
        memory=memory,
        flops=device.flops,
        mfu=a.mfu,
        link_bytes_per_s=link,
        rows=a.rows,
        batch=a.batch,
        checkpointing=ac,
        progress=sys.stderr.isatty() or bool(os.environ.get("HP_PLAN_PROGRESS")),
        tp_max=a.tp_max,
        eps=a.ep,
        pps=a.pp,
        pp_max=a.pp_max,
        schedules=schedules,
        microbatches=a.microbatches,
        max_microbatches=a.max_microbatches,
        dtype=_DTYPES[a.dtype],
        optimizer=a.optimizer,
        attn_implementation=a.attn_implementation,
        kda_kernel=a.kda_kernel,
        device_type=device.device_type,
    )
    fits = sum(c.fits for c in cands)
    batch = (
        f"a global batch of {a.batch}"
        if a.batch
        else f"{a.rows} row(s) per dp replica and micro-batch"
    )
    print(
        f"{a.model}: {a.devices} x {a.device} ({memory / GIB:.0f} GiB, {device.flops / 1e12:.0f} "
        f"TFLOPS x mfu {a.mfu}, link {link / 1e9:.0f} GB/s), {a.seq_len} tokens x {batch}, "
        f"{a.dtype}, {a.optimizer}: {len(cands)} candidates, {fits} fit"
    )
    print()
    print(table(cands, a.top))
    if cands:
        print()
        best = cands[0].plan
        print(f"bytes per collective, #1 ({best.mesh_dims}, ep={best.ep}):")
        print(breakdown(cands[0]))
        if best.pipelined:
            print()
            print(f"stages of #1 ({best.schedule}, {best.microbatches} micro-batches):")
            print(stages(cands[0]))
    if a.json:
        rows: list[dict[str, Any]] = [
            {
                "dims": c.plan.dims,
                "pp": c.plan.pp,
                "microbatches": c.plan.microbatches,
                "schedule": c.plan.schedule,
                "stages_per_rank": c.plan.stages_per_rank,
                "stage_layers": c.plan.stage_layers,
                "bubble": c.plan.bubble,
                "pipeline_buffers": c.plan.pipeline_buffers,
                "gathered_stage": c.plan.gathered_stage,
                "batch": c.plan.batch,
                "tokens_per_s_per_device": c.tokens_per_s,
                "ep": c.plan.ep,
                "checkpointing": c.checkpointing,
                "fits": c.fits,
                "parameters": c.plan.parameters,
                "gradients": c.plan.gradients,
                "optimizer": c.plan.optimizer,
                "activations": c.plan.activations,
                "gathered_layer": c.plan.gathered_layer,
                "total": c.plan.total,
                "collectives": c.plan.collectives,
                "t_compute": c.t_compute,
                "t_comm": c.t_comm,
            }
            for c in cands
        ]
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
