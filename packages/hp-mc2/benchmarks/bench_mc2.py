"""Two blocks under sequence + tensor parallelism, forward + backward, each case side by side
in one run, interleaved, median of the repetitions:

- MLP block (up + down projection): ours (MC2 styles, ``torch`` implementation, default
  chunks) vs torch's own ColwiseParallel + RowwiseParallel SP pair, and ours with chunks=1 (no
  overlap) and chunks=4 (forced overlap);
- gated MLP block (``down(act(gate(x)) * up(x))``, shaped like Hugging Face's LlamaMLP):
  ``MC2GatedMLPParallel`` vs torch's SP plan on the same module (gate/up
  ``ColwiseParallel(input_layouts=Shard(1))``, down ``RowwiseParallel(output_layouts=
  Shard(1))``), vs torchtitan's variant of it (one ``PrepareModuleInput`` gather shared by
  gate/up) and vs the separate MC2 styles (two ``MC2ColwiseParallel`` + ``MC2RowwiseParallel``).

Reported per case: time, bytes this rank moves over the link per step (counted by
hp-dtensor's ``simulated_link`` at zero cost: ``(P-1)/P`` of every gathered/scattered buffer),
and peak memory. On CPU the peak is the CPU allocator's (profiler memory events, every
allocation and free on the calling thread, including those inside DTensor's dispatch and
gloo's staging copies); hp-dtensor's dispatch-level tracker is recorded beside it
(``tracker_peak_*``), see the README for why the two differ.

Under a modeled link (hp-dtensor's ``simulated_link``, a simulation: every collective
completes no earlier than launch + latency + bytes / bandwidth, one transfer at a time, the
wait sleeping for what compute has not hidden), records ``.../link/...``: ours at every chunk
count of ``LINK_CHUNKS`` and at ``auto`` (``chunks=None``: ``default_chunks`` for this
device), vs torch's blocking SP pair (all interleaved in one run), with the link's bandwidth
chosen so that the blocking pair's bytes per step take as long as its compute (its step
without the link, less gloo's real transfers); ``hidden_fraction = (T_blocking - T_ours) /
T_link``, ``T_link`` the blocking pair's modeled link seconds per step; the peak memory of one
step (without the link) beside each. The MLP block's link table also has the fused block
(``MC2MLPParallel``: one pipeline over up, GELU and down, ``fused_chunks{c}`` and
``fused_auto``) beside the separate column + row styles, against the same baseline.

    python packages/hp-mc2/benchmarks/bench_mc2.py --out bench-results/mc2.json [--quick]
        [--link-only] [--world N] [--repeat R] [--split] [--link-chunks LIST]
    torchrun --nproc-per-node 2 packages/hp-mc2/benchmarks/bench_mc2.py --device cuda --out ...

``--repeat R``: each modeled-link table R times (each run interleaving every case), per record
the median run's figures with ``hidden_fraction_runs``; ``--split``: how each step splits
(hp-dtensor's ``link_time_split``; the chunking overhead against the same style at one chunk);
``--link-chunks ''``: ``auto`` alone. Every record carries ``world``, ``cores_per_rank``,
``load`` and ``oversubscribed``.

Without torchrun it starts min(2, cores) gloo ranks on this machine (one core per rank;
``--world N`` to choose); under torchrun it uses the launched
ranks and the device's own backend (NCCL on CUDA, HCCL on NPU). Rank 0 writes the records.
"""

from __future__ import annotations

import copy
import ctypes
import gc
import statistics
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)

from hyper_parallel.dtensor import init_device_mesh
from hyper_parallel.dtensor.benchmarking import (
    bench_arguments,
    bench_record,
    bytes_per_call,
    interleaved_timing,
    link_time_split,
    link_world,
    measure_under_link,
    median_of_runs,
    peak_memory_bytes,
    run_facts,
    run_ranks,
    summary_line,
    synchronize,
    write_records,
)
from hyper_parallel.mc2 import (
    MC2ColwiseParallel,
    MC2GatedMLPParallel,
    MC2MLPParallel,
    MC2RowwiseParallel,
    default_chunks,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
LINK_CHUNKS = (1, 2, 4, 8, 16)  # the chunk counts the modeled-link table compares (+ auto)
WORLD = 2  # ranks (tensor parallel degree); by default at most one per core


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, ffn)
        self.down = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


class GatedMLP(nn.Module):
    """Shaped like Hugging Face's LlamaMLP (same children, same forward)."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


_RUNS = 3  # CPU memory figures: median over this many runs (see _allocator_trace)


def _settle() -> None:
    """Let every rank's collectives and their staging buffers be released before a
    measurement starts, so none is freed (or allocated) by gloo's threads inside it."""
    if dist.is_initialized():
        dist.barrier()
    gc.collect()


def _allocator_trace(fn: Any) -> tuple[int, int, Any]:
    """``(peak, live at the end, fn's result)`` in bytes allocated while ``fn`` runs on CPU,
    replaying the CPU allocator's alloc/free events (torch profiler, ``profile_memory``).
    Only this thread's events are seen: a buffer gloo happens to free (or allocate) on its own
    thread shifts the count, so callers take the median of a few runs."""
    _settle()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak, live, result


def allocator_peak_bytes(fn: Any, device: torch.device) -> int:
    """Peak bytes allocated while ``fn`` runs, beyond what was live before: the CPU
    allocator's events on CPU, the device allocator's own peak on accelerators."""
    if device.type != "cpu":
        return peak_memory_bytes(fn, device)
    return int(statistics.median(_allocator_trace(fn)[0] for _ in range(_RUNS)))


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def _malloc_in_use() -> int | None:
    """Bytes malloc has handed out and not got back, every thread and arena (glibc's
    ``mallinfo2``: in-use chunks + mmapped blocks); ``None`` off glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def held_bytes(forward: Any, device: torch.device) -> int:
    """Bytes a forward leaves allocated for its backward (saved activations + its output):
    what grows with the number of layers. ``forward()`` returns ``(output, backward)`` and
    frees nothing the previous step left (its gradients stay allocated, as in training).
    Accelerators: the device allocator; CPU: glibc's in-use count before and after (exact
    across threads), else the allocator trace; the median of a few runs on CPU."""
    runs = []
    for _ in range(_RUNS if device.type == "cpu" else 1):
        _settle()
        synchronize(device)
        if device.type != "cpu":
            module = getattr(torch, device.type)
            before = module.memory_allocated()
            _, backward = forward()
            synchronize(device)
            held = module.memory_allocated() - before
        elif _malloc_in_use() is not None:
            before = _malloc_in_use() or 0
            _, backward = forward()
            held = (_malloc_in_use() or 0) - before
        else:
            _, held, (_, backward) = _allocator_trace(forward)
        backward()
        runs.append(held)
    return int(statistics.median(runs))


def _measure(
    cases: dict[str, Any], forwards: dict[str, Any], cfg: dict[str, Any], device: torch.device
) -> dict[str, Any]:
    """Time (interleaved median), bytes moved per step, allocator/tracker peaks, held bytes."""
    times = interleaved_timing(cases, repeats=cfg["repeats"], warmup=cfg["warmup"], device=device)
    out: dict[str, Any] = {"time": times, "peak": {}, "tracker": {}, "bytes": {}, "held": {}}
    for name, fn in cases.items():
        out["peak"][name] = allocator_peak_bytes(fn, device)
        out["tracker"][name] = peak_memory_bytes(fn, device)
        fn()  # leaves this case's gradients allocated, as in training
        out["held"][name] = held_bytes(forwards[name], device)
        out["bytes"][name] = bytes_per_call(fn)
    return out


def _link_records(
    cases: dict[str, Any],
    ours: dict[str, str],
    baseline: str,
    cfg: dict[str, Any],
    device: torch.device,
    **extra: Any,
) -> list[dict[str, Any]]:
    """Each of ``ours`` (record name -> case) vs the blocking ``baseline``, interleaved under
    one modeled link whose bytes per step take as long as the baseline's step without it.
    ``cfg["repeat"]`` runs of it (each interleaving every case), the median run's figures per
    record; with ``cfg["split"]`` each record also carries how ours' step splits
    (``link_time_split``: the chunking overhead is ours' plain step at its chunks less the
    same style's at one chunk)."""
    run = {baseline: cases[baseline], **{a: cases[a] for a in ours.values()}}
    # the peak memory of one step without the link, beside each
    peaks = {case: allocator_peak_bytes(fn, device) for case, fn in run.items()}
    runs = []
    for _ in range(cfg["repeat"]):
        m = measure_under_link(
            run, baseline, latency_s=cfg["link_latency"], repeats=cfg["repeats"], device=device
        )
        plain = {}
        if cfg["split"]:
            plain = interleaved_timing(
                {**run, **{_unchunked(a): cases[_unchunked(a)] for a in ours.values()}},
                repeats=cfg["repeats"], warmup=1, device=device,
            )  # fmt: skip
        if dist.get_rank() == 0:
            print(f"link for {baseline}: {m.calibration_line()}")
        runs.append(
            [
                m.record(
                    name,
                    a,
                    device=device.type,
                    peak_mem_ours=peaks[a],
                    peak_mem_baseline=peaks[baseline],
                    **{
                        "repeats": cfg["repeats"],
                        **extra,
                        **(
                            link_time_split(m, a, baseline, plain, a, _unchunked(a))
                            if plain
                            else {}
                        ),
                    },
                )
                for name, a in ours.items()
            ]
        )
    return median_of_runs(runs)


def _unchunked(case: str) -> str:
    """The same style's one-chunk case (the chunking overhead's reference)."""
    if case.startswith("gated_ours"):
        return "gated_ours_chunks1"
    return "fused_chunks1" if case.startswith("fused") else "ours_chunks1"


def _records(
    m: dict[str, Any], pairs: list[tuple[str, str, str]], device: torch.device, **shapes: Any
) -> list[dict[str, Any]]:
    return [
        bench_record(
            name,
            m["time"][a],
            m["time"][b],
            peak_mem_ours=m["peak"][a],
            peak_mem_baseline=m["peak"][b],
            device=device.type,
            ours=a,
            baseline=b,
            bytes_per_step_ours=m["bytes"][a],
            bytes_per_step_baseline=m["bytes"][b],
            tracker_peak_ours=m["tracker"][a],
            tracker_peak_baseline=m["tracker"][b],
            held_bytes_ours=m["held"][a],
            held_bytes_baseline=m["held"][b],
            **shapes,
        )
        for name, a, b in pairs
    ]


def _gated_body(cfg: dict[str, Any], mesh: Any, device: torch.device) -> list[dict[str, Any]]:
    rank, ws = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[cfg["dtype"]]
    tokens, hidden, ffn = cfg["gated_tokens"], cfg["gated_hidden"], cfg["gated_ffn"]
    torch.manual_seed(0)
    base = GatedMLP(hidden, ffn).to(device=device, dtype=dtype)
    seq = 1
    auto = default_chunks(tokens // ws, hidden, 2 * ffn // ws, ws, device.type)
    link_chunks = cfg["link_chunks"]

    def build(styles: Any) -> nn.Module:
        return parallelize_module(copy.deepcopy(base), mesh, styles)

    def torch_sp(shared_gather: bool) -> nn.Module:
        col = ColwiseParallel() if shared_gather else ColwiseParallel(input_layouts=Shard(seq))
        model = build(
            {
                "gate_proj": col,
                "up_proj": col,
                "down_proj": RowwiseParallel(output_layouts=Shard(seq)),
            }
        )
        if shared_gather:
            prepare = PrepareModuleInput(
                input_layouts=(Shard(seq),), desired_input_layouts=(Replicate(),)
            )
            parallelize_module(model, mesh, prepare)
        return model

    models = {
        "gated_ours": build(MC2GatedMLPParallel(sequence_dim=seq, impl="torch")),
        **{
            f"gated_ours_chunks{c}": build(
                MC2GatedMLPParallel(sequence_dim=seq, impl="torch", chunks=c)
            )
            for c in link_chunks
        },
        "gated_torch_tp_sp": torch_sp(shared_gather=False),
        "gated_torch_shared_gather": torch_sp(shared_gather=True),
        "gated_mc2_separate": build(
            {
                "gate_proj": MC2ColwiseParallel(seq, impl="torch"),
                "up_proj": MC2ColwiseParallel(seq, impl="torch"),
                "down_proj": MC2RowwiseParallel(seq, impl="torch"),
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

    def forward(model: nn.Module) -> tuple[torch.Tensor, Any]:
        y = model(x)
        return y, (lambda: y.backward(dy))

    cases = {name: (lambda m=m: step(m)) for name, m in models.items()}
    link_cases = {f"gated_ours_chunks{c}": cases.pop(f"gated_ours_chunks{c}") for c in link_chunks}
    shapes = {"tokens": tokens, "hidden": hidden, "ffn": ffn, "dtype": cfg["dtype"]}
    records = []
    if not cfg["link_only"]:
        m = _measure(
            cases,
            {name: (lambda m=m: forward(m)) for name, m in models.items()},
            cfg,
            device,
        )
        pairs = [
            (f"mc2_gated_mlp_fwd_bwd/gated_ours_vs_{b[6:]}", "gated_ours", b)
            for b in ("gated_torch_tp_sp", "gated_torch_shared_gather", "gated_mc2_separate")
        ]
        records += _records(m, pairs, device, repeats=cfg["repeats"], **shapes)
    if cfg["link"]:
        cases.update(link_cases)
        ours = {f"mc2_gated_mlp_fwd_bwd/link/{n}_vs_torch_tp_sp": n for n in link_cases}
        ours["mc2_gated_mlp_fwd_bwd/link/gated_ours_auto_vs_torch_tp_sp"] = "gated_ours"
        records += _link_records(
            cases, ours, "gated_torch_tp_sp", cfg, device, default_chunks=auto, **shapes
        )
    return records


def _body(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    rank, ws = dist.get_rank(), dist.get_world_size()
    device = torch.device(cfg["device"])
    dtype = DTYPES[cfg["dtype"]]
    tokens, hidden, ffn = cfg["tokens"], cfg["hidden"], cfg["ffn"]
    mesh = init_device_mesh(device.type, (ws,))
    records = _gated_body(cfg, mesh, device) if cfg["block"] in ("gated", "both") else []
    if cfg["block"] == "gated":
        return records
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
                "up": MC2ColwiseParallel(seq, impl="torch"),
                "down": MC2RowwiseParallel(seq, impl="torch"),
            }
        ),
        "ours_chunks4": build(
            {
                "up": MC2ColwiseParallel(seq, impl="torch", chunks=4),
                "down": MC2RowwiseParallel(seq, impl="torch", chunks=4),
            }
        ),
        "ours_chunks1": build(
            {
                "up": MC2ColwiseParallel(seq, impl="torch", chunks=1),
                "down": MC2RowwiseParallel(seq, impl="torch", chunks=1),
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

    def forward(model: nn.Module) -> tuple[torch.Tensor, Any]:
        y = model(x)
        return y, (lambda: y.backward(dy))

    cases = {name: (lambda m=m: step(m)) for name, m in models.items()}
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
    if not cfg["link_only"]:
        m = _measure(
            cases,
            {name: (lambda m=m: forward(m)) for name, m in models.items()},
            cfg,
            device,
        )
        records += _records(m, pairs, device, **shapes)
    if cfg["link"]:
        ours = {}
        for c in cfg["link_chunks"]:
            name = f"ours_chunks{c}"
            if name not in cases:
                cases[name] = _mlp_case(base, mesh, c, step)
            ours[f"mc2_mlp_fwd_bwd/link/{name}_vs_torch_tp_sp"] = name
        ours["mc2_mlp_fwd_bwd/link/ours_auto_vs_torch_tp_sp"] = "ours_default"
        # the fused block (MC2MLPParallel: one pipeline over up, GELU and down), same baseline
        for c in [*cfg["link_chunks"], None]:
            name = f"fused_chunks{c}" if c is not None else "fused_auto"
            cases[name] = _fused_mlp_case(base, mesh, c, step)
            ours[f"mc2_mlp_fwd_bwd/link/{name}_vs_torch_tp_sp"] = name
        records += _link_records(cases, ours, "torch_tp_sp", cfg, device, **shapes)
    return records


def _mlp_case(base: nn.Module, mesh: Any, chunks: int, step: Any) -> Any:
    model = parallelize_module(
        copy.deepcopy(base),
        mesh,
        {
            "up": MC2ColwiseParallel(1, impl="torch", chunks=chunks),
            "down": MC2RowwiseParallel(1, impl="torch", chunks=chunks),
        },
    )
    return lambda: step(model)


def _fused_mlp_case(base: nn.Module, mesh: Any, chunks: int | None, step: Any) -> Any:
    style = MC2MLPParallel(
        up="up", down="down", act=torch.nn.functional.gelu, sequence_dim=1, impl="torch",
        chunks=chunks,
    )  # fmt: skip
    model = parallelize_module(copy.deepcopy(base), mesh, style)
    return lambda: step(model)


def _config(argv: list[str] | None = None) -> tuple[dict[str, Any], str]:
    p = bench_arguments(__doc__)
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--ffn", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--block", default="both", choices=["mlp", "gated", "both"])
    p.add_argument(
        "--world", type=int, default=None,
        help=f"ranks (default: min({WORLD}, the available cores): one core per rank)",
    )  # fmt: skip
    p.add_argument(
        "--repeat", type=int, default=1,
        help="runs of each modeled-link table, each interleaving every case; records the median",
    )  # fmt: skip
    p.add_argument(
        "--split", action="store_true",
        help="also the time split of each link record (unhidden link, chunking, copies)",
    )  # fmt: skip
    p.add_argument("--link-latency", type=float, default=20e-6, help="modeled link latency (s)")
    p.add_argument("--no-link", action="store_true", help="skip the modeled-link comparisons")
    p.add_argument("--link-only", action="store_true", help="only the modeled-link comparisons")
    p.add_argument(
        "--link-chunks", default=",".join(map(str, LINK_CHUNKS)),
        help="comma-separated chunk counts of the modeled-link table (auto is always added; "
        "'' for auto alone)",
    )  # fmt: skip
    a = p.parse_args(argv)
    link_chunks = {int(c) for c in a.link_chunks.split(",") if c.strip()}
    if a.split:
        link_chunks.add(1)  # the split's reference: each style at one chunk
    quick = (1024, 512, 2048, 3) if a.quick else (4096, 1024, 4096, 5)
    gated = (1024, 512, 1408) if a.quick else (4096, 1024, 2816)
    cfg = {
        "block": a.block,
        "gated_tokens": a.tokens or gated[0],
        "gated_hidden": a.hidden or gated[1],
        "gated_ffn": a.ffn or gated[2],
        "device": a.device,
        "dtype": a.dtype,
        "tokens": a.tokens or quick[0],
        "hidden": a.hidden or quick[1],
        "ffn": a.ffn or quick[2],
        "repeats": a.repeats or quick[3],
        "warmup": 1,
        "link": not a.no_link,
        "link_only": a.link_only and not a.no_link,
        "link_chunks": sorted(link_chunks),
        "link_latency": a.link_latency,
        "world": link_world(WORLD, a.world),
        "repeat": max(1, a.repeat),
        "split": a.split,
    }
    return cfg, a.out


def main(argv: list[str] | None = None) -> None:
    cfg, out = _config(argv)
    facts = run_facts(cfg["world"])
    records = run_ranks(_body, cfg, world_size=cfg["world"], timeout=3600.0)
    if records is not None:  # rank 0 (or the launching process) reports
        records = [{**r, **facts} for r in records]
        write_records(out, records)
        for record in records:
            if record.get("simulated"):
                print(
                    f"{summary_line(record)}  [modeled link: latency "
                    f"{record['link_latency_s'] * 1e6:.0f} us, "
                    f"{record['link_bytes_per_s'] / 1e6:.1f} MB/s, T_link "
                    f"{record['t_link_s'] * 1e3:.1f} ms, hidden {record['hidden_fraction']:.2f}, "
                    f"runs {[round(v, 2) for v in record.get('hidden_fraction_runs', [])]}]"
                    + (
                        f"  split: unhidden {record['split_unhidden_link']:.2f}, chunking "
                        f"{record['split_chunking_overhead']:.2f}, copies "
                        f"{record['split_copies_cpu']:.2f}"
                        if "split_unhidden_link" in record
                        else ""
                    )
                )
                continue
            print(
                f"{summary_line(record)}  bytes/step "
                f"{record['bytes_per_step_ours'] / 2**20:.1f} MiB vs "
                f"{record['bytes_per_step_baseline'] / 2**20:.1f} MiB  held for backward "
                f"{record['held_bytes_ours'] / 2**20:.1f} MiB vs "
                f"{record['held_bytes_baseline'] / 2**20:.1f} MiB"
            )


if __name__ == "__main__":
    main()
