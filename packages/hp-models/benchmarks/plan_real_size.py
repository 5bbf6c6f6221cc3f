"""The mesh planner on the real models at their real size, pipeline parallelism in the search:
the tables of hp-models' README ("The real models at their real size").

For each case (model, devices, tokens a sequence) every mesh ``(pp, dp, cp, tp)`` with ``ep``,
schedule and micro-batch count of ``python -m hyper_parallel.models.plan``'s search is planned
(its defaults: ``--device 910B --device-memory 64GiB``, mfu 0.4, the 910B's link, bf16 AdamW,
flash attention, hp-kda-kernels' lean chunk path, one sequence per dp replica and
micro-batch, ``1F1B`` and ``Interleaved1F1B`` with 2 stages a rank, up to 32 micro-batches,
with and without activation checkpointing), then two tables are printed:

1. the best mesh that fits (the most modeled tokens a second per device), what its busiest
   rank holds and moves;
2. the best mesh without a pipeline (``pp = 1``) and the best with one (``pp > 1``): FSDP2's
   all-gather bytes a rank a step, the busiest rank's bytes, the modeled step time and
   tokens a second per device.

Run (about 12 minutes on 2 CPU cores)::

    python packages/hp-models/benchmarks/plan_real_size.py [--case deepseek-v3,256,32k ...]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

GIB = 2**30
CASES = [
    ("deepseek-v3", 256, "32k"),
    ("deepseek-v3", 1024, "32k"),
    ("kimi-linear", 16, "32k"),
    ("kimi-linear", 16, "128k"),
    ("kimi-linear", 64, "128k"),
    ("qwen3-next", 64, "128k"),
]
NAMES = {
    "deepseek-v3": "DeepSeek-V3 671B",
    "kimi-linear": "Kimi-Linear-48B-A3B",
    "qwen3-next": "Qwen3-Next-80B-A3B",
}


def plan_case(model: str, devices: int, seq: str) -> tuple[list[Any], float]:
    """Every candidate of the CLI's search for one case, ranked, and the seconds it took."""
    from hyper_parallel.models.plan.__main__ import _count
    from hyper_parallel.models.plan.devices import DEVICES, link_bandwidth
    from hyper_parallel.models.plan.search import rank_meshes, real_config

    device = DEVICES["910B"]
    start = time.perf_counter()
    cands = rank_meshes(
        real_config(model),
        devices,
        _count(seq),
        memory=64 * GIB,
        flops=device.flops,
        mfu=0.4,
        link_bytes_per_s=link_bandwidth(device.device_type)[0],
        device_type=device.device_type,
    )
    return cands, time.perf_counter() - start


def _g(n: float) -> str:
    return f"{n / GIB:.1f}"


def _mesh(c: Any) -> str:
    p = c.plan
    text = f"{', '.join(map(str, p.mesh_dims))}, ep {p.ep}"
    if p.pipelined:
        v = f" ×{p.stages_per_rank}" if p.stages_per_rank > 1 else ""
        text += f", {p.schedule}{v}, m {p.microbatches}"
    return text + f", {'on' if c.checkpointing else 'off'}"


def best_row(model: str, devices: int, seq: str, cands: list[Any], took: float) -> str:
    fits = [c for c in cands if c.fits]
    head = f"| {NAMES[model]}, {devices}, {seq} | {len(cands)} ({len(fits)}) "
    if not fits:
        return head + "| none fits |" + " |" * 12
    c = fits[0]
    p = c.plan
    return (
        head + f"| {_mesh(c)} | {_g(p.parameters)} | {_g(p.gradients)} | {_g(p.optimizer)} "
        f"| {_g(p.activations + p.pipeline_buffers)} | {_g(p.gathered)} | {_g(p.total)} "
        f"| {_g(p.rank_comm_bytes)} | {c.t_step:.2f} | {p.batch} | {c.tokens_per_s:.0f} "
        f"| {took:.0f} s |"
    )


def versus_rows(model: str, devices: int, seq: str, cands: list[Any]) -> list[str]:
    """The best mesh that fits without a pipeline and the best with one."""
    out = []
    fits = [c for c in cands if c.fits]
    for label, pick in (("pp = 1", [c for c in fits if c.plan.pp == 1]),
                        ("pp > 1", [c for c in fits if c.plan.pp > 1])):  # fmt: skip
        if not pick:
            out.append(f"| {NAMES[model]}, {devices}, {seq} | {label} | none fits |" + " |" * 7)
            continue
        c = pick[0]
        p = c.plan
        out.append(
            f"| {NAMES[model]}, {devices}, {seq} | {label} | {_mesh(c)} "
            f"| {_g(p.collectives.get('fsdp.all_gather', 0))} | {_g(p.total)} | {p.bubble:.2f} "
            f"| {c.t_compute:.2f} | {c.t_comm:.2f} | {c.t_step:.2f} | {c.tokens_per_s:.0f} |"
        )
    return out


BEST_HEADER = (
    "| model, devices, tokens | candidates (fit) | best: pp, dp, cp, tp, ep, schedule, AC "
    "| params | grads | optimizer | activations | gathered | total | comm / step | step (s) "
    "| global batch | tokens/s/device | planned in |\n"
    "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)
VERSUS_HEADER = (
    "| model, devices, tokens | best with | pp, dp, cp, tp, ep, schedule, AC "
    "| fsdp.all_gather (GiB/rank/step) | total (GiB) | bubble | compute (s) | comm (s) "
    "| step (s) | tokens/s/device |\n|---|---|---|---:|---:|---:|---:|---:|---:|---:|"
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--case", action="append", help="model,devices,tokens (default: the README's cases)"
    )
    a = ap.parse_args(argv)
    cases = CASES
    if a.case:
        cases = [(m, int(d), s) for m, d, s in (c.split(",") for c in a.case)]
    best, versus = [], []
    for model, devices, seq in cases:
        cands, took = plan_case(model, devices, seq)
        best.append(best_row(model, devices, seq, cands, took))
        versus += versus_rows(model, devices, seq, cands)
        print(best[-1], file=sys.stderr, flush=True)
    print(BEST_HEADER)
    print("\n".join(best))
    print()
    print(VERSUS_HEADER)
    print("\n".join(versus))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HP_CHECK_CONSISTENCY", "0")
    sys.exit(main())
