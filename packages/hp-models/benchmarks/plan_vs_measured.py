"""The mesh planner's prediction against real steps: for every case the tests validate
(tiny float32 DeepSeek-V3, Kimi-Linear and Qwen3-Next on 4 gloo ranks, seq 64), each
quantity's plan, the busiest rank's measurement and plan / measured: parameters, gradients,
optimizer states (FSDP2), the activations' peak (all-reduce: no FSDP2 buffers among the
tensors) and the bytes of every collective a step (hp-dtensor's recorder and FSDP2's
collectives); then the tests' pipelines (``pipeline_model`` at (pp, cp, tp) = (2, 2, 1)), each
pp rank's plan against the busiest of its ranks.

    python packages/hp-models/benchmarks/plan_vs_measured.py [--out table.md]

About 40 s on 2 CPU cores. The markdown table it prints is the one in docs/benchmarks.md
(run notes).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from hyper_parallel.dtensor.testing import run_distributed

TESTS = Path(__file__).resolve().parents[1] / "tests" / "test_models_plan.py"


def _tests() -> Any:
    """The tests' module, imported by its own name from a path the ranks inherit (spawned
    ranks unpickle its functions by module name)."""
    if str(TESTS.parent) not in sys.path:
        sys.path.insert(0, str(TESTS.parent))
    return importlib.import_module(TESTS.stem)


def rows() -> list[str]:
    t = _tests()
    out = [
        "| case (kind, dp·cp·tp, ep, reduction, AC) | quantity | plan (B) | measured (B) "
        "| plan / measured |",
        "|---|---|---:|---:|---:|",
    ]
    for cases, quantities in ((t.HELD, ("parameters", "gradients", "optimizer")),
                              (t.ACTS, ("activations",))):  # fmt: skip
        real = run_distributed(t._step, 4, cases, timeout=600)
        for i, case in enumerate(cases):
            plan = t._plan(*case)
            label = f"{case[0]} {case[1]} ep={case[2]} {case[3]}{' AC' if case[4] else ''}"
            got = {q: max(real[r][i][q] for r in range(4)) for q in quantities}
            if "parameters" in quantities:
                busiest: dict[str, int] = {}
                for r in range(4):
                    for name, n in t._merged(real[r][i]["collectives"]).items():
                        busiest[name] = max(busiest.get(name, 0), n)
                got.update(busiest)
            planned = {q: getattr(plan, q) for q in quantities}
            if "parameters" in quantities:
                planned.update(plan.collectives)
            for q in planned:
                m = got.get(q, 0)
                ratio = f"{planned[q] / m:.3f}" if m else "-"
                out.append(f"| {label} | {q} | {planned[q]:,} | {m:,} | {ratio} |")
    # pipelines: each pp rank against its ranks' busiest (the activations under all-reduce)
    real = run_distributed(t._pipe_step, 4, t.PIPES, timeout=600)
    for i, case in enumerate(t.PIPES):
        plan = t._pipe_plan(*case)
        kind, dims, ep, reduction, m, schedule, v = case
        per_rank = 4 // dims[0]
        for pr in plan.ranks:
            got_ranks = [
                real[r][i] for r in range(pr.pp_rank * per_rank, (pr.pp_rank + 1) * per_rank)
            ]
            label = (
                f"{kind} pp, cp, tp = {dims} ep={ep} {reduction} {schedule} m={m}"
                f"{f' v={v}' if v > 1 else ''}, pp rank {pr.pp_rank} (stages {list(pr.stages)})"
            )
            planned = {q: getattr(pr, q) for q in ("parameters", "gradients", "optimizer")}
            got = {q: max(g[q] for g in got_ranks) for q in planned}
            if reduction == "allreduce":
                planned["activations"] = pr.activations
                got["activations"] = max(g["activations"] for g in got_ranks)
            for g in got_ranks:
                for name, n in t._merged(g["collectives"]).items():
                    got[name] = max(got.get(name, 0), n)
            planned.update(pr.collectives)
            for q in planned:
                n = got.get(q, 0)
                ratio = f"{planned[q] / n:.3f}" if n else "-"
                out.append(f"| {label} | {q} | {planned[q]:,} | {n:,} | {ratio} |")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="also write the table here")
    a = ap.parse_args(argv)
    text = "\n".join(rows())
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HP_CHECK_CONSISTENCY", "0")
    sys.exit(main())
