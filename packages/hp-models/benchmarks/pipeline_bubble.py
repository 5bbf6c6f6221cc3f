"""The pipeline bubble of ``pipeline_model`` at pp = 2 on 2 gloo ranks, one core each: 1F1B at 2,
4 and 8 micro-batches, the measured idle fraction of each stage against the schedule's
``(p − 1)/(m + p − 1)``.

A stage's busy time is the wall time of its forward and backward computations (torch's
``PipelineStage.forward_one_chunk`` / ``backward_one_chunk``, timed around each call); its idle
fraction is ``1 − busy / step`` where ``step`` is the whole step's wall time (the median of
``--steps`` steps after one warm-up). The model is a stock Kimi-Linear of 4 layers (KDA, KDA,
KDA, MLA) with hidden size 256, float32, the global batch fixed (8 rows of 256 tokens), so more
micro-batches means smaller ones.

    python packages/hp-models/benchmarks/pipeline_bubble.py [--steps 3] [--out FILE.json]

Not a ``bench_*.py``: ``nox -s bench`` does not run it; its numbers are in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from hyper_parallel.dtensor import init_device_mesh, unflatten
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.models import pipeline_model
from hyper_parallel.models.testing import kimi_config


def _model() -> Any:
    from transformers import KimiLinearForCausalLM

    cfg = kimi_config(hidden_size=256, num_attention_heads=4, intermediate_size=512, vocab_size=512)
    torch.manual_seed(0)
    return KimiLinearForCausalLM(cfg).float()


def _timed(stage: Any, busy: list[float]) -> None:
    for name in ("forward_one_chunk", "backward_one_chunk"):
        original = getattr(stage, name)

        def wrapped(*args: Any, _f: Any = original, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _f(*args, **kwargs)
            finally:
                busy.append(time.perf_counter() - t0)

        setattr(stage, name, wrapped)


def _body(steps: int) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    world = init_device_mesh("cpu", (2,), mesh_dim_names=("world",))
    mesh = unflatten(world, "world", (2, 1, 1), ("pp", "cp", "tp"))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 512, (8, 256), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    out = []
    for m in (2, 4, 8):
        pm = pipeline_model(_model(), mesh, microbatches=m, schedule="1F1B", layer_split=[2, 2])
        pm.step(**batch)  # warm-up; builds torch's stage and schedule
        busy: list[float] = []
        _timed(pm._runner._stage, busy)
        walls, fracs = [], []
        for _ in range(steps):
            busy.clear()
            pm.zero_grad()
            torch.distributed.barrier()
            t0 = time.perf_counter()
            pm.step(**batch)
            wall = time.perf_counter() - t0
            walls.append(wall)
            fracs.append(1.0 - sum(busy) / wall)
        out.append(
            {
                "microbatches": m,
                "stage": pm.stages[0],
                "step_s": statistics.median(walls),
                "idle": statistics.median(fracs),
                "schedule_bubble": (2 - 1) / (m + 2 - 1),
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    results = run_distributed(_body, 2, args.steps, timeout=900)
    rows = [r for rank in results for r in rank]
    print("| micro-batches | stage | step (s) | idle fraction | (p-1)/(m+p-1) |")
    print("|---:|---:|---:|---:|---:|")
    for r in sorted(rows, key=lambda r: (r["microbatches"], r["stage"])):
        print(
            f"| {r['microbatches']} | {r['stage']} | {r['step_s']:.3f} | {r['idle']:.3f} | "
            f"{r['schedule_bubble']:.3f} |"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
