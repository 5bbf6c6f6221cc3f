"""A stock Kimi-Linear model parallelised by hp-models (cp=2 × tp=2 on 4 ranks), one training
step (forward, backward, gradient reduction) in three precisions, side by side, interleaved:

- ``fp32``: float32 weights and compute (the baseline);
- ``autocast_bf16``: float32 weights, the forward under ``torch.autocast(dtype=bfloat16)``;
- ``fsdp_bf16``: float32 weights, FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16,
  reduce_dtype=float32)`` passed as ``parallelize_model(..., mp_policy=)`` (where FSDP2 can
  sum gradients: torch 2.13).

Reported per case: step time (median, slowest rank) and peak tensor memory per rank, against
``fp32``. On CPU, bf16 matmuls are often slower than float32 ones (no bf16 units on many CPUs,
conversions on top): the numbers say what this machine does, not what an accelerator does.

    python packages/hp-models/benchmarks/bench_precision.py --out bench-results/p.json [--quick]
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hyper_parallel.dtensor import init_device_mesh, unflatten
from hyper_parallel.dtensor.benchmarking import (
    bench_arguments,
    bench_record,
    interleaved_timing,
    peak_memory_bytes,
    run_ranks,
    summary_line,
    write_records,
)
from hyper_parallel.models import parallelize_model, shard_batch, sync_gradients
from hyper_parallel.models.fsdp import fsdp_available
from hyper_parallel.models.testing import random_batch, tiny_model


def _body(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    device = torch.device(cfg["device"])
    ws = dist.get_world_size()
    world = init_device_mesh(device.type, (ws,), mesh_dim_names=("world",))
    mesh = unflatten(world, "world", (2, ws // 2), ("cp", "tp"))
    shape = {
        "hidden_size": cfg["hidden"],
        "intermediate_size": 2 * cfg["hidden"],
        "num_attention_heads": cfg["heads"],
        "num_key_value_heads": cfg["heads"],
        "linear_num_heads": cfg["heads"],
        "linear_head_dim": cfg["head_dim"],
        "kv_lora_rank": cfg["head_dim"],
        "qk_nope_head_dim": cfg["head_dim"],
        "v_head_dim": cfg["head_dim"],
        "qk_rope_head_dim": 16,
        "vocab_size": 512,
        "mlp_layer_types": ["dense"] * 4,
    }

    def build(**options: Any) -> nn.Module:
        model = tiny_model("kimi", seed=0, dtype=torch.float32, **shape).to(device)
        return parallelize_model(model, mesh, **options)

    batch = random_batch(vocab=512, bsz=1, seq=cfg["seq"], seed=1)
    local = {k: v.to(device) for k, v in shard_batch(batch, mesh).items()}
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
    extra = {
        "seq": cfg["seq"],
        "hidden": cfg["hidden"],
        "heads": cfg["heads"],
        "head_dim": cfg["head_dim"],
        "mesh": f"cp=2 x tp={ws // 2}",
        "repeats": cfg["repeats"],
        "threads_per_rank": torch.get_num_threads(),
    }
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


def _config(argv: list[str] | None = None) -> tuple[dict[str, Any], str]:
    p = bench_arguments(__doc__)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    a = p.parse_args(argv)
    seq, hidden, repeats = (256, 128, 2) if a.quick else (1024, 256, 3)
    cfg = {
        "device": a.device,
        "seq": a.seq or seq,
        "hidden": a.hidden or hidden,
        "heads": 8,
        "head_dim": 32 if a.quick else 64,
        "repeats": a.repeats or repeats,
    }
    return cfg, a.out


def main(argv: list[str] | None = None) -> None:
    cfg, out = _config(argv)
    records = run_ranks(_body, cfg, world_size=4, timeout=1800.0)
    if records is not None:
        write_records(out, records)
        for record in records:
            print(summary_line(record))


if __name__ == "__main__":
    main()
