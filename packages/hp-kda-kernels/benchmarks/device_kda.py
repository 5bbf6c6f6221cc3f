"""One real-size delta-rule layer on a device: ``local_kernel="stock"`` at cp = 1, 2, 4 vs the
serial stock layer running flash-linear-attention (fla).

What it measures, for each layer (``--layers``, default both):

- ``kda``: Kimi-Linear-48B's ``KimiLinearDeltaAttention`` (hidden 2304, 32 heads of 128,
  short convolution 4), whose chunk function transformers binds to fla's ``chunk_kda``;
- ``gdn``: Qwen3-Next-80B's ``Qwen3NextGatedDeltaNet`` (hidden 2048, 16 key and 32 value
  heads of 128, short convolution 4), bound to fla's ``chunk_gated_delta_rule``;

one sequence (B = 1) of ``--tokens`` tokens (default 32768) in ``--dtype`` (default bf16):

- ``serial`` (the cp = 1 baseline): the plain stock layer on the whole sequence, on one rank;
- ``stock`` at each cp of ``--cp`` (default 1, 2, 4): the same weights rewritten by
  ``parallelize_kda`` / ``parallelize_gated_deltanet`` with ``local_kernel="stock"``; rank
  ``r`` of the cp group takes block ``r`` of the sequence and calls the stock layer's own
  chunk function twice (the block's summary, then its outputs from the incoming state). cp = 1
  is that path on a one-rank mesh: the price of the second call without any communication.

Per row: the median forward + backward step time over ``--repeats`` steps after ``--warmup``
(the device synchronised around each step, the slowest rank's time), its ratio to the serial
step (< 1 is faster), tokens per second (the sequence's tokens over the step time), the peak
device memory of one step above the memory before it (``max_memory_allocated`` of
``torch.cuda`` / ``torch.npu``; the largest rank's, every rank's in the JSON) and that peak
per token of the rank's block. The first step of every row is also a correctness check: the
cp group's output blocks, put together, and the input gradient are compared row for row with
the serial layer's (max |difference| over max |serial|, the largest over the ranks), within
``--tol`` (5e-2 for bf16 / fp16, 1e-4 for fp32); a miss is reported (``ok`` = no), never
raised.

Ranks: one world of ``W`` ranks runs every cp that divides ``W``; a cp smaller than ``W``
runs ``W / cp`` identical groups side by side (so the serial row runs on every rank, each on
its own card). ``W`` is torchrun's world, or ``max(--cp)`` processes started here with
``--spawn``. Backends: nccl on CUDA, hccl on Ascend NPU (``torch_npu`` is imported only when the
device is npu), gloo on CPU. Launch (from the repository root)::

    # CUDA, one node with 4 GPUs (cp 1, 2 and 4 in one launch)
    torchrun --nproc-per-node 4 packages/hp-kda-kernels/benchmarks/device_kda.py
    python packages/hp-kda-kernels/benchmarks/device_kda.py --spawn   # the same, no torchrun

    # Ascend NPU: the same commands (found when torch_npu is installed and CUDA is not; or
    # --device npu); torchrun --nproc-per-node 2 measures cp 1 and 2 only
    torchrun --nproc-per-node 4 packages/hp-kda-kernels/benchmarks/device_kda.py \\
        --device npu --tokens 65536 --out bench-results/kda_device_npu.json

    # CPU dry run (tiny sizes, fp32, 4 gloo processes, transformers' torch reference kernels)
    OMP_NUM_THREADS=1 python packages/hp-kda-kernels/benchmarks/device_kda.py --dry-run

On CPU (``--dry-run``, or ``--device cpu``) the modeling modules are imported on their PyTorch
path (fla's Triton kernels do not run there): the numbers only prove the script works. Rank 0
prints a markdown table and appends the records to ``--out`` (default
``bench-results/kda_device.json``). Not run in CI.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib
import importlib.util
import os
import socket
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hyper_parallel.dtensor import init_device_mesh, unflatten
from hyper_parallel.dtensor.benchmarking import (
    available_cores,
    bench_record,
    launched_by_torchrun,
    peak_memory_bytes,
    synchronize,
    write_records,
)
from hyper_parallel.dtensor.devices import bind_device, process_group_backend
from hyper_parallel.kda import parallelize_gated_deltanet, parallelize_kda, stock_kernel

MB = 2**20
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOLERANCE = {"bf16": 5e-2, "fp16": 5e-2, "fp32": 1e-4}


@dataclass(frozen=True)
class LayerSpec:
    """One stock layer: where transformers defines it, the chunk function its forward calls
    and its sizes (``k_heads`` = ``v_heads`` for KDA)."""

    name: str
    title: str
    module: str
    cls: str
    kernel: str
    hidden: int
    k_heads: int
    v_heads: int
    head_dim: int
    conv: int


REAL = {
    "kda": LayerSpec("kda", "Kimi-Linear-48B KDA",
                     "transformers.models.kimi_linear.modeling_kimi_linear",
                     "KimiLinearDeltaAttention", "chunk_kimi_delta_attention",
                     hidden=2304, k_heads=32, v_heads=32, head_dim=128, conv=4),
    "gdn": LayerSpec("gdn", "Qwen3-Next-80B Gated DeltaNet",
                     "transformers.models.qwen3_next.modeling_qwen3_next",
                     "Qwen3NextGatedDeltaNet", "torch_chunk_gated_delta_rule",
                     hidden=2048, k_heads=16, v_heads=32, head_dim=128, conv=4),
}  # fmt: skip
TINY = {
    "kda": dataclasses.replace(REAL["kda"], hidden=64, k_heads=2, v_heads=2, head_dim=16),
    "gdn": dataclasses.replace(REAL["gdn"], hidden=64, k_heads=2, v_heads=4, head_dim=16),
}


@dataclass(frozen=True)
class Settings:
    """What every rank runs (plain values: it crosses ``torch.multiprocessing.spawn``)."""

    device: str  # "cuda", "npu" or "cpu"
    dtype: str
    tokens: int
    cps: tuple[int, ...]
    layers: tuple[str, ...]
    warmup: int
    repeats: int
    tol: float
    protocol: str
    seed: int
    dry_run: bool
    out: str

    @property
    def torch_path(self) -> bool:
        """fla's Triton kernels do not run on CPU: take transformers' torch reference there."""
        return self.device == "cpu"

    def spec(self, name: str) -> LayerSpec:
        return (TINY if self.dry_run else REAL)[name]


@dataclass
class Case:
    """One row: a layer on this rank's block ``[lo, hi)`` of the sequence."""

    run: str  # "serial" or "stock"
    cp: int
    layer: nn.Module
    x: torch.Tensor
    dy: torch.Tensor
    lo: int
    hi: int

    @property
    def key(self) -> str:
        return "serial" if self.run == "serial" else f"stock_cp{self.cp}"


# ---- devices and processes -----------------------------------------------------------------
def detect_device() -> str:
    """cuda where it is available, else npu where ``torch_npu`` is installed and sees a card
    (imported only then), else cpu."""
    if torch.cuda.is_available():
        return "cuda"
    if importlib.util.find_spec("torch_npu") is not None:
        import torch_npu  # noqa: F401  (registers torch.npu; NPU images only)

        if torch.npu.is_available():  # type: ignore[attr-defined]
            return "npu"
    return "cpu"


def init_rank(settings: Settings) -> torch.device:
    """Bind this rank to its card (``LOCAL_RANK``) and start the process group with the
    device's backend; ``torch_npu`` is imported by :func:`bind_device` for npu only."""
    device = bind_device(settings.device, int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(process_group_backend(settings.device))
    if device.type == "cpu":
        torch.set_num_threads(max(1, available_cores() // dist.get_world_size()))
    return device


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawned(rank: int, world: int, port: int, settings: Settings) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # fmt: skip
    run_rank(settings)


def spawn(settings: Settings) -> None:
    """``max(cps)`` local ranks, one per card (or CPU process), through torch.multiprocessing."""
    world = max(settings.cps)
    if settings.device != "cpu":
        cards = getattr(torch, settings.device).device_count()
        if cards < world:
            raise SystemExit(f"--spawn needs {world} {settings.device} cards, found {cards}")
    import torch.multiprocessing as mp

    mp.spawn(_spawned, args=(world, free_port(), settings), nprocs=world, join=True)


# ---- the layers ----------------------------------------------------------------------------
def modeling(spec: LayerSpec, torch_path: bool) -> Any:
    """The layer's modeling module: as transformers imports it (chunk functions bound to fla
    where it imports), or on its PyTorch path."""
    if torch_path:
        from hyper_parallel.kda.testing import import_torch_path

        return import_torch_path(spec.module)
    return importlib.import_module(spec.module)


def layer_config(spec: LayerSpec) -> Any:
    import transformers

    if spec.name == "kda":
        return transformers.KimiLinearConfig(
            hidden_size=spec.hidden, num_hidden_layers=1,
            linear_attn_config={"head_dim": spec.head_dim, "num_heads": spec.k_heads,
                                "short_conv_kernel_size": spec.conv},
        )  # fmt: skip
    return transformers.Qwen3NextConfig(
        hidden_size=spec.hidden, num_hidden_layers=1, linear_num_key_heads=spec.k_heads,
        linear_num_value_heads=spec.v_heads, linear_key_head_dim=spec.head_dim,
        linear_value_head_dim=spec.head_dim, linear_conv_kernel_dim=spec.conv,
        layer_types=["linear_attention"],
    )  # fmt: skip


def build_layer(spec: LayerSpec, settings: Settings, device: torch.device) -> nn.Module:
    """The stock layer, the same weights on every rank (seeded, built on CPU), with slowly
    decaying gates (the bare layer leaves Kimi's ``A_log`` and ``dt_bias`` uninitialised) so
    the state carries across the ranks' blocks."""
    home = modeling(spec, settings.torch_path)
    torch.manual_seed(settings.seed)
    layer = getattr(home, spec.cls)(layer_config(spec), layer_idx=0)
    gates = layer.forget_gate if spec.name == "kda" else layer
    with torch.no_grad():
        gates.A_log.uniform_(1.0, 16.0).log_()
        gates.dt_bias.uniform_(-7.0, -2.3)
    return layer.to(device=device, dtype=DTYPES[settings.dtype])


def cp_mesh(device_type: str, cp: int) -> Any:
    """A 1-D mesh ``("cp",)`` of ``cp`` consecutive ranks: the whole world, or one of the
    ``world / cp`` side-by-side groups (built on every rank, in the same order)."""
    world = dist.get_world_size()
    if cp == world:
        return init_device_mesh(device_type, (cp,), mesh_dim_names=("cp",))
    root = init_device_mesh(device_type, (world,), mesh_dim_names=("world",))
    return unflatten(root, "world", (world // cp, cp), ("rep", "cp"))["cp"]


def stock_cp_layer(spec: LayerSpec, serial: nn.Module, mesh: Any, protocol: str) -> nn.Module:
    rewrite = parallelize_kda if spec.name == "kda" else parallelize_gated_deltanet
    return rewrite(copy.deepcopy(serial), mesh, protocol=protocol, local_kernel="stock")


def make_cases(
    spec: LayerSpec, settings: Settings, device: torch.device, cps: list[int]
) -> list[Case]:
    """The serial row and one stock row per cp, each with this rank's block of one input and
    of one upstream gradient (the same on every rank)."""
    T, dtype = settings.tokens, DTYPES[settings.dtype]
    gen = torch.Generator().manual_seed(settings.seed + 1)
    x = torch.randn(1, T, spec.hidden, generator=gen).to(device=device, dtype=dtype)
    dy = torch.randn(1, T, spec.hidden, generator=gen).to(device=device, dtype=dtype)
    serial = build_layer(spec, settings, device)
    cases = [Case("serial", 1, serial, x, dy, 0, T)]
    for cp in cps:
        mesh = cp_mesh(device.type, cp)
        pos = mesh.get_local_rank()
        lo, hi = T * pos // cp, T * (pos + 1) // cp
        layer = stock_cp_layer(spec, serial, mesh, settings.protocol)
        block = (x[:, lo:hi].contiguous(), dy[:, lo:hi].contiguous())
        cases.append(Case("stock", cp, layer, *block, lo, hi))
    return cases


# ---- measuring ----------------------------------------------------------------------------
def step(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward + backward of the case's block: ``(output, input gradient)``."""
    case.layer.zero_grad(set_to_none=True)
    x = case.x.detach().requires_grad_()
    out = case.layer(x)
    out.backward(case.dy)
    assert x.grad is not None
    return out.detach(), x.grad


def max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    """Each value's largest over the ranks (small values on the device itself: nccl and hccl
    take no CPU tensors)."""
    t = torch.tensor(values, dtype=torch.float32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(v) for v in t.tolist()]


def per_rank(value: float, device: torch.device) -> list[float]:
    t = torch.tensor([value], dtype=torch.float32, device=device)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [float(o.item()) for o in out]


def max_rel_errors(
    case: Case, got: tuple[torch.Tensor, torch.Tensor], ref: tuple[torch.Tensor, torch.Tensor],
    device: torch.device,
) -> list[float]:  # fmt: skip
    """Max |cp − serial| over max |serial| of the output and of the input gradient, over the
    whole sequence: each rank compares its block with the serial rows, the largest wins."""
    diffs = [(g.float() - r[:, case.lo : case.hi].float()).abs().max().item()
             for g, r in zip(got, ref)]  # fmt: skip
    scales = [r.abs().max().float().item() for r in ref]
    diffs = max_over_ranks(diffs, device)
    return [d / max(s, 1e-30) for d, s in zip(diffs, scales)]


def peak_mb(case: Case, device: torch.device) -> list[float]:
    """Every rank's peak memory of one step above the memory before it, in MB."""
    case.layer.zero_grad(set_to_none=True)  # the last step's gradients count as before
    dist.barrier()
    return per_rank(peak_memory_bytes(lambda: step(case), device) / MB, device)


def median_step_s(cases: list[Case], settings: Settings, device: torch.device) -> dict[str, float]:
    """Median seconds of each case's step, interleaved (every repetition runs every case in
    turn, so drift hits all alike); each repetition's time is the slowest rank's."""
    samples: dict[str, list[float]] = {c.key: [] for c in cases}
    for rep in range(settings.warmup + settings.repeats):
        for case in cases:
            dist.barrier()
            synchronize(device)
            start = time.perf_counter()
            step(case)
            synchronize(device)
            if rep >= settings.warmup:
                samples[case.key].append(time.perf_counter() - start)
    return {k: statistics.median(max_over_ranks(v, device)) for k, v in samples.items()}


def kernel_label(spec: LayerSpec, layer: nn.Module) -> str:
    """What the stock layer's chunk function is bound to (the serial baseline's kernel and
    the stock path's local one)."""
    fused = stock_kernel(layer, spec.kernel).fused
    return f"{spec.kernel} -> {'fla (fused)' if fused else 'transformers torch reference'}"


def bench_layer(
    spec: LayerSpec, settings: Settings, device: torch.device, cps: list[int]
) -> list[dict[str, Any]]:
    """Records of one layer: the correctness check on the first step, peak memory, time."""
    cases = make_cases(spec, settings, device, cps)
    kernel = kernel_label(spec, cases[0].layer)
    ref = step(cases[0])
    errors = {c.key: max_rel_errors(c, step(c), ref, device) for c in cases[1:]}
    errors["serial"] = [0.0, 0.0]
    del ref
    peaks = {c.key: peak_mb(c, device) for c in cases}
    times = median_step_s(cases, settings, device)
    return [record(spec, settings, c, kernel, times, peaks, errors[c.key])
            for c in cases]  # fmt: skip


def record(
    spec: LayerSpec, settings: Settings, case: Case, kernel: str, times: dict[str, float],
    peaks: dict[str, list[float]], errors: list[float],
) -> dict[str, Any]:  # fmt: skip
    t, base = times[case.key], times["serial"]
    tokens_per_rank = -(-settings.tokens // case.cp)
    peak, base_peak = max(peaks[case.key]), max(peaks["serial"])
    return bench_record(
        f"kda_device/{spec.name}/{case.key}_vs_serial", t, base,
        peak_mem_ours=int(peak * MB), peak_mem_baseline=int(base_peak * MB),
        device=settings.device, layer=spec.name, title=spec.title, run=case.run, cp=case.cp,
        kernel=kernel, dtype=settings.dtype, tokens=settings.tokens,
        tokens_per_rank=tokens_per_rank, tokens_per_s=settings.tokens / t, peak_mb=peak,
        peak_mb_per_rank=peaks[case.key], mb_per_token=peak / tokens_per_rank,
        parallel_efficiency=base / (case.cp * t), max_rel_err_out=errors[0],
        max_rel_err_dx=errors[1], tol=settings.tol, ok=max(errors) < settings.tol,
        protocol=settings.protocol if case.run == "stock" else None,
        sizes=dataclasses.asdict(spec), warmup=settings.warmup, repeats=settings.repeats,
        dry_run=settings.dry_run,
    )  # fmt: skip


# ---- reporting -----------------------------------------------------------------------------
def table(records: list[dict[str, Any]], settings: Settings) -> str:
    lines = [
        f"device {settings.device}, world {records[0]['world_size']}, {settings.dtype}, "
        f"B = 1, T = {settings.tokens}, median of {settings.repeats} steps (fwd + bwd)",
        "",
        "| layer | run | cp | step ms | vs serial | tokens/s | peak MB/rank | MB/token "
        "| max rel err out | max rel err dx | ok |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in records:
        lines.append(
            f"| {r['layer']} | {r['run']} | {r['cp']} | {r['ours_s'] * 1e3:.2f} "
            f"| {r['ratio']:.3f} | {r['tokens_per_s']:,.0f} | {r['peak_mb']:.1f} "
            f"| {r['mb_per_token']:.4f} | {r['max_rel_err_out']:.2e} "
            f"| {r['max_rel_err_dx']:.2e} | {'yes' if r['ok'] else 'NO'} |"
        )
    kernels = sorted({f"{r['layer']}: {r['kernel']}" for r in records})
    return "\n".join([*lines, "", *kernels])


def run_rank(settings: Settings) -> None:
    """Every rank: each layer's rows at every cp dividing the world; rank 0 reports."""
    device = init_rank(settings)
    try:
        world = dist.get_world_size()
        cps = [cp for cp in settings.cps if world % cp == 0]
        records: list[dict[str, Any]] = []
        for name in settings.layers:
            records += bench_layer(settings.spec(name), settings, device, cps)
            if device.type != "cpu":
                getattr(torch, device.type).empty_cache()
        if dist.get_rank() == 0:
            report(records, settings, [cp for cp in settings.cps if cp not in cps])
    finally:
        dist.destroy_process_group()


def report(records: list[dict[str, Any]], settings: Settings, skipped: list[int]) -> None:
    print(table(records, settings), flush=True)
    if skipped:
        print(f"skipped cp {skipped}: they do not divide the world size", flush=True)
    if any(not r["ok"] for r in records):
        print(f"WARNING: a row's error exceeds tol {settings.tol}", flush=True)
    write_records(settings.out, records)
    print(f"records appended to {settings.out}", flush=True)


# ---- command line --------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").strip().splitlines()[0])
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "npu", "cpu"])
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--tokens", type=int, default=None, help="the sequence's tokens (32768)")
    p.add_argument("--cp", default="1,2,4", help="context-parallel sizes, comma-separated")
    p.add_argument("--layers", default="kda,gdn", help="kda, gdn or both, comma-separated")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--tol", type=float, default=None, help="max relative error (by dtype)")
    p.add_argument("--protocol", default="auto", help="the state exchange's protocol")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results/kda_device.json")
    p.add_argument("--spawn", action="store_true", help="start max(--cp) ranks here")
    p.add_argument(
        "--dry-run", action="store_true", help="tiny sizes, fp32, CPU gloo ranks, torch kernels"
    )
    return p.parse_args(argv)


def settings_from(args: argparse.Namespace) -> Settings:
    dry = args.dry_run
    layers = tuple(n.strip() for n in args.layers.split(",") if n.strip())
    unknown = [n for n in layers if n not in REAL]
    if unknown:
        raise SystemExit(f"--layers: unknown {unknown}; expected kda, gdn")
    dtype = "fp32" if dry else args.dtype
    return Settings(
        device="cpu" if dry else (detect_device() if args.device == "auto" else args.device),
        dtype=dtype, tokens=args.tokens or (128 if dry else 32768),
        cps=tuple(sorted({int(c) for c in args.cp.split(",")})), layers=layers,
        warmup=1 if dry else args.warmup, repeats=3 if dry else args.repeats,
        tol=TOLERANCE[dtype] if args.tol is None else args.tol, protocol=args.protocol,
        seed=args.seed, dry_run=dry, out=args.out,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    settings = settings_from(args)
    if launched_by_torchrun():
        run_rank(settings)
    elif args.spawn or settings.dry_run:
        spawn(settings)
    else:
        raise SystemExit("launch under torchrun --nproc-per-node P, or pass --spawn or --dry-run")


if __name__ == "__main__":
    main()
