"""A stock Kimi-Linear model parallelised by hp-models (cp=2 × tp=2 on 4 ranks), one training
step (forward, backward, gradient reduction) in three precisions, side by side, interleaved:

- ``fp32``: float32 weights and compute (the baseline);
- ``autocast_bf16``: float32 weights, the forward under ``torch.autocast(dtype=bfloat16)``;
- ``fsdp_bf16``: float32 weights, FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16,
  reduce_dtype=float32)`` passed as ``parallelize_model(..., mp_policy=)`` (where FSDP2 can
  be made to sum gradients: every torch from 2.7.1).

Reported per case: step time (median, slowest rank) and peak tensor memory per rank, against
``fp32``. On CPU, bf16 matmuls are often slower than float32 ones (no bf16 units on many CPUs,
conversions on top): the numbers say what this machine does, not what an accelerator does.

    python packages/hp-models/benchmarks/bench_precision.py --out bench-results/p.json [--quick]
"""

from __future__ import annotations

import contextlib
from typing import Any

import _kimi  # the shared setup, beside this script
import torch
from torch import nn

from hyper_parallel.dtensor.benchmarking import (
    bench_record,
    interleaved_timing,
    peak_memory_bytes,
    run_ranks,
    summary_line,
    write_records,
)
from hyper_parallel.models import parallelize_model, sync_gradients
from hyper_parallel.models.fsdp import fsdp_available


def _body(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    env = _kimi.setup(cfg)
    device, mesh, local = env.device, env.mesh, env.local

    def build(**options: Any) -> nn.Module:
        return parallelize_model(env.build(), mesh, **options)

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    models = {"fp32": build(), "autocast_bf16": build()}
    if fsdp_available():
        models["fsdp_bf16"] = build(mp_policy=policy)

    def step(name: str) -> Any:
        model = models[name]
        amp = name == "autocast_bf16"

        def run() -> None:
            model.zero_grad(set_to_none=True)
            ctx = torch.autocast(device.type, dtype=torch.bfloat16) if amp else None
            with ctx or contextlib.nullcontext():
                loss = model(**local).loss
            loss.backward()
            sync_gradients(model)

        return run

    cases = {name: step(name) for name in models}
    times = interleaved_timing(cases, repeats=cfg["repeats"], warmup=1, device=device)
    mem = {name: peak_memory_bytes(fn, device) for name, fn in cases.items()}
    extra = {**env.extra(), "threads_per_rank": torch.get_num_threads()}
    return [
        bench_record(
            f"models_kimi_precision/{name}_vs_fp32",
            times[name],
            times["fp32"],
            peak_mem_ours=mem[name],
            peak_mem_baseline=mem["fp32"],
            device=device.type,
            ours=name,
            baseline="fp32",
            **extra,
        )
        for name in models
        if name != "fp32"
    ]


def main(argv: list[str] | None = None) -> None:
    cfg, out = _kimi.config(__doc__, argv, quick=(256, 128, 2), full=(1024, 256, 3))
    records = run_ranks(_body, cfg, world_size=4, timeout=1800.0)
    if records is not None:
        write_records(out, records)
        for record in records:
            print(summary_line(record))


if __name__ == "__main__":
    main()
