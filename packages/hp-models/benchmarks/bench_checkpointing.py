"""A stock Kimi-Linear model parallelised by hp-models (cp=2 × tp=2 on 4 ranks), one training
step (forward, backward, gradient reduction) with Hugging Face's activation checkpointing
(``model.gradient_checkpointing_enable()``, its defaults) on and off, interleaved; the same
shapes as bench_models.py:

- ``checkpointing``: every decoder layer's activations recomputed during backward (ours);
- ``no_checkpointing``: the activations kept from the forward (the baseline).

Reported: step time (median, slowest rank) and peak tensor memory per rank: the trade the
user chooses (less memory for about one more forward).

    python packages/hp-models/benchmarks/bench_checkpointing.py --out bench-results/c.json [--quick]
"""

from __future__ import annotations

from typing import Any

import _kimi  # the shared setup, beside this script
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


def _body(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    env = _kimi.setup(cfg)

    def build(checkpointing: bool) -> nn.Module:
        model = env.build()
        model.train()  # HF checkpoints only in training mode
        if checkpointing:
            model.gradient_checkpointing_enable()
        return parallelize_model(model, env.mesh)

    models = {"checkpointing": build(True), "no_checkpointing": build(False)}

    def step(model: nn.Module) -> Any:
        def run() -> None:
            model.zero_grad(set_to_none=True)
            model(**env.local).loss.backward()
            sync_gradients(model)

        return run

    cases = {name: step(model) for name, model in models.items()}
    times = interleaved_timing(cases, repeats=cfg["repeats"], warmup=1, device=env.device)
    mem = {name: peak_memory_bytes(fn, env.device) for name, fn in cases.items()}
    return [
        bench_record(
            "models_kimi_checkpointing/hf_checkpointing_vs_off",
            times["checkpointing"],
            times["no_checkpointing"],
            peak_mem_ours=mem["checkpointing"],
            peak_mem_baseline=mem["no_checkpointing"],
            device=env.device.type,
            ours="gradient_checkpointing_enable()",
            baseline="no checkpointing",
            **env.extra(),
        )
    ]


def main(argv: list[str] | None = None) -> None:
    cfg, out = _kimi.config(__doc__, argv, quick=(512, 128, 2), full=(2048, 256, 3))
    records = run_ranks(_body, cfg, world_size=4, timeout=1800.0)
    if records is not None:
        write_records(out, records)
        for record in records:
            print(summary_line(record))


if __name__ == "__main__":
    main()
