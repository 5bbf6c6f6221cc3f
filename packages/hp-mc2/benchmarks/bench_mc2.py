"""MLP block (up + down projection, forward + backward) under sequence + tensor parallelism:
ours (MC2 styles, ``torch`` backend, default chunks) vs torch's own ColwiseParallel +
RowwiseParallel SP pair, and ours with chunks=1 (no overlap) and chunks=4 (forced overlap),
side by side in one run, interleaved, median of the repetitions.

    python packages/hp-mc2/benchmarks/bench_mc2.py --out bench-results/mc2.json [--quick]
    torchrun --nproc-per-node 2 packages/hp-mc2/benchmarks/bench_mc2.py --device cuda --out ...

Without torchrun it starts 2 gloo ranks on this machine; under torchrun it uses the launched
ranks and the device's own backend (NCCL on CUDA, HCCL on NPU). Rank 0 writes the records.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from hyper_parallel.dtensor import init_device_mesh
from hyper_parallel.dtensor.benchmarking import (
    bench_arguments,
    bench_record,
    interleaved_timing,
    peak_memory_bytes,
    run_ranks,
    summary_line,
    write_records,
)
from hyper_parallel.mc2 import MC2ColwiseParallel, MC2RowwiseParallel, default_chunks

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, ffn)
        self.down = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


def _body(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    rank, ws = dist.get_rank(), dist.get_world_size()
    device = torch.device(cfg["device"])
    dtype = DTYPES[cfg["dtype"]]
    tokens, hidden, ffn = cfg["tokens"], cfg["hidden"], cfg["ffn"]
    mesh = init_device_mesh(device.type, (ws,))
    torch.manual_seed(0)
    base = MLP(hidden, ffn).to(device=device, dtype=dtype)

    def build(styles: dict[str, Any]) -> nn.Module:
        return parallelize_module(copy.deepcopy(base), mesh, styles)

    seq = 1  # batch-first [B, S, H], one sequence of `tokens` tokens, sequence-sharded
    models = {
        "torch_tp_sp": build(
            {
                "up": ColwiseParallel(input_layouts=Shard(seq)),
                "down": RowwiseParallel(output_layouts=Shard(seq)),
            }
        ),
        "ours_default": build(
            {
                "up": MC2ColwiseParallel(seq, backend="torch"),
                "down": MC2RowwiseParallel(seq, backend="torch"),
            }
        ),
        "ours_chunks4": build(
            {
                "up": MC2ColwiseParallel(seq, backend="torch", chunks=4),
                "down": MC2RowwiseParallel(seq, backend="torch", chunks=4),
            }
        ),
        "ours_chunks1": build(
            {
                "up": MC2ColwiseParallel(seq, backend="torch", chunks=1),
                "down": MC2RowwiseParallel(seq, backend="torch", chunks=1),
            }
        ),
    }
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(1, tokens // ws, hidden, generator=g).to(device=device, dtype=dtype)
    dy = torch.randn(1, tokens // ws, hidden, generator=g).to(device=device, dtype=dtype)
    x.requires_grad_()

    def step(model: nn.Module) -> None:
        for p in model.parameters():
            p.grad = None
        x.grad = None
        model(x).backward(dy)

    cases = {name: (lambda m=m: step(m)) for name, m in models.items()}
    times = interleaved_timing(cases, repeats=cfg["repeats"], warmup=cfg["warmup"], device=device)
    mem = {name: peak_memory_bytes(fn, device) for name, fn in cases.items()}
    shapes = {
        "tokens": tokens,
        "hidden": hidden,
        "ffn": ffn,
        "dtype": cfg["dtype"],
        "default_chunks_up": default_chunks(tokens // ws, hidden, ffn // ws, ws, device.type),
        "default_chunks_down": default_chunks(tokens // ws, ffn // ws, hidden, ws, device.type),
        "repeats": cfg["repeats"],
    }
    pairs = [
        ("mc2_mlp_fwd_bwd/ours_default_vs_torch_tp_sp", "ours_default", "torch_tp_sp"),
        ("mc2_mlp_fwd_bwd/ours_chunks1_vs_torch_tp_sp", "ours_chunks1", "torch_tp_sp"),
        ("mc2_mlp_fwd_bwd/ours_chunks4_vs_torch_tp_sp", "ours_chunks4", "torch_tp_sp"),
        ("mc2_mlp_fwd_bwd/ours_chunks4_vs_ours_chunks1", "ours_chunks4", "ours_chunks1"),
    ]
    return [
        bench_record(
            name,
            times[a],
            times[b],
            peak_mem_ours=mem[a],
            peak_mem_baseline=mem[b],
            device=device.type,
            ours=a,
            baseline=b,
            **shapes,
        )
        for name, a, b in pairs
    ]


def _config(argv: list[str] | None = None) -> tuple[dict[str, Any], str]:
    p = bench_arguments(__doc__)
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--ffn", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    a = p.parse_args(argv)
    quick = (1024, 512, 2048, 3) if a.quick else (4096, 1024, 4096, 5)
    cfg = {
        "device": a.device,
        "dtype": a.dtype,
        "tokens": a.tokens or quick[0],
        "hidden": a.hidden or quick[1],
        "ffn": a.ffn or quick[2],
        "repeats": a.repeats or quick[3],
        "warmup": 1,
    }
    return cfg, a.out


def main(argv: list[str] | None = None) -> None:
    cfg, out = _config(argv)
    records = run_ranks(_body, cfg, world_size=2, timeout=600.0)
    if records is not None:  # rank 0 (or the launching process) reports
        write_records(out, records)
        for record in records:
            print(summary_line(record))


if __name__ == "__main__":
    main()
