"""One stock Hugging Face MoE experts module (``DeepseekV3Experts``: E = 16 experts, top-4,
float32; 1024 tokens per rank, hidden 256, expert intermediate 512; ``--quick``: 512 tokens,
intermediate 256), forward + backward, on ``min(4, available cores)`` ranks (one core per rank:
2 on a 2-core host; ``--world N`` to choose; more ranks than cores run oversubscribed, and the
records say so: ``world``, ``cores_per_rank``, ``load``, ``oversubscribed``), every case of a
part in one run, interleaved, median of the repetitions. The intermediate size is above the
hidden size on purpose: the bytes exchanged grow with H and the expert work with H·I, and on a
CPU gloo's real copies of those bytes run on the same cores as the GEMMs, so a larger I keeps
them a smaller part of the step (under the modeled link below they still slow ours' overlapped
step, not the blocking twin's, whose waits cover them):

1. **ep = P (the ranks) vs the experts whole on every rank** (``ep = 1``: the stock module,
   all E experts on every rank, each rank on its own tokens; what a user without expert
   parallelism runs):
   ours (``parallelize_experts(experts, ep_mesh)``, every option ``"auto"``), and ours with
   ``impl="grouped_mm"`` (the local kernel transformers' grouped_mm forward uses, so that the
   parallelism and the local kernel can be read apart).
2. **ours vs transformers' own expert parallelism**: transformers 5.23's ``AllToAllEP`` (what
   ``from_pretrained(..., distributed_config=DistributedConfig(ep_size=4,
   ep_implementation="all_to_all"))`` applies to each experts module; ``_hf_ep.py``) on the
   same stock module, the same tokens and dtype.

   The stock module runs the experts implementation transformers picks for a model on this
   CPU: ``"grouped_mm"`` (``PreTrainedModel`` resolves ``None`` to ``grouped_mm``, and
   ``_can_use_grouped_mm`` holds on CPU with torch >= 2.11), for the ep = 1 baseline and inside
   ``AllToAllEP``. Ours reads only the weights and ``act_fn`` and runs its own local backend.

   Per case: the time of a step (slowest rank), the expert parameter bytes each rank holds, the
   peak tensor memory of a step beyond what was live before it (hp-dtensor's
   ``peak_memory_bytes``: on CPU its dispatch-level tracker; gradients included, parameters
   not), and the bytes this rank moves over its link per step, counted at the dispatcher for
   every c10d and functional collective (ours' all-to-alls go through c10d, transformers' row
   exchanges through ``_c10d_functional``) by hp-dtensor's one rule (``comm.link_bytes``: the
   rows an all-to-all sends to the other ranks, ``(P-1)/P`` of a gathered buffer); for ours
   also cross-checked against ``simulated_link``'s count.

3. **Under a modeled link** (hp-dtensor's ``simulated_link``, a simulation: every collective
   completes no earlier than launch + latency + bytes / bandwidth, one transfer at a time, the
   wait sleeping for what compute has not hidden): ours with ``chunks="auto"`` and with
   chunks = 1, 2, 4, 8, 16 (``overlap=True``), each against its blocking twin
   (``overlap=False``, the same chunks: the same operations, every exchange waited at once),
   all interleaved under one link whose bandwidth is chosen (``calibrate_link``) so that the
   blocking one-chunk step's bytes take as long as its compute; latency 20 µs. ``--repeat R``
   runs the whole part R times (each run interleaving every case) and records, per record, the
   median run's figures with ``hidden_fraction_runs`` (the R values); ``--split`` adds how
   each step splits (hp-dtensor's ``link_time_split``: ``split_unhidden_link``,
   ``split_chunking_overhead`` against the blocking one-chunk step, ``split_copies_cpu``).
   ``--link-chunks ''`` runs ``auto`` alone. Records
   ``moe_experts_fwd_bwd/link/ours_<auto|chunksC>_vs_blocking``:
   ``hidden_fraction = (T_blocking − T_overlap) / T_link``, ``T_link`` the blocking twin's
   modeled link seconds per step; ``ceiling = 1 − 1/C``, the schedule's own (the first
   dispatch and the last combine of a step's forward and backward have nothing to run under);
   for ``auto`` the C it picked and its reason (``experts_info``). Beside it:
   ``hidden_fraction_paired`` (the same from each repetition's pair, median),
   ``schedule_hidden_share`` (``1 − slept / T_link`` of ours: the share of ours' own link its
   waits did not sleep for), ``bound_any_schedule`` (``1 − max(0, 1/2 − forward share)``: half
   the bytes move in the forward, under the forward's share of the compute) and
   ``link_over_compute`` (the calibration's check, 1 when the link took as long as the
   blocking compute in the run itself).

    python packages/hp-moe/benchmarks/bench_moe.py --out bench-results/hp-moe.json [--quick]
        [--no-link | --link-only] [--world N] [--repeat R] [--split] [--link-chunks LIST]
    torchrun --nproc-per-node 4 packages/hp-moe/benchmarks/bench_moe.py --device cuda --out ...

Without torchrun it starts min(4, cores) gloo ranks on this machine (one intra-op thread each);
under torchrun it uses the launched ranks and the device's own backend. Rank 0 writes the records.
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from typing import Any

import _hf_ep  # transformers' AllToAllEP on one experts module, beside this script
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from hyper_parallel.dtensor import init_device_mesh
from hyper_parallel.dtensor.benchmarking import (
    bench_arguments,
    bench_record,
    bytes_per_call,
    interleaved_timing,
    link_time_split,
    link_world,
    max_over_ranks,
    measure_under_link,
    median_of_runs,
    peak_memory_bytes,
    run_facts,
    run_ranks,
    summary_line,
    write_records,
)
from hyper_parallel.dtensor.comm import all_to_all_v_bytes, link_bytes
from hyper_parallel.moe import __version__, experts_info, parallelize_experts

PREFIX = "moe_experts_fwd_bwd"
WORLD = 4  # the ranks the benchmark was written for; by default at most one per core
LINK_CHUNKS = (1, 2, 4, 8, 16)  # the chunk counts of the modeled-link table (+ auto)
HF_IMPL = "grouped_mm"  # what transformers resolves for a model on CPU (see the docstring)


# ---- bytes over the link, counted at the dispatcher --------------------------------------------
def _group(pg_or_name: Any) -> tuple[int, int]:
    """(size, this rank's index) of a c10d ProcessGroup object or a functional group name."""
    if isinstance(pg_or_name, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        pg_or_name = _resolve_process_group(pg_or_name)
    elif not isinstance(pg_or_name, dist.ProcessGroup):  # the op's boxed ScriptObject
        pg_or_name = dist.ProcessGroup.unbox(pg_or_name)
    return int(pg_or_name.size()), int(pg_or_name.rank())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _row_bytes(t: torch.Tensor) -> int:
    return (_nbytes(t) // t.shape[0]) if t.dim() and t.shape[0] else 0


class LinkBytes(TorchDispatchMode):
    """Bytes this rank moves over its link, by ``comm.link_bytes`` / ``all_to_all_v_bytes``,
    for every c10d (``dist.*``) and functional (``funcol.*``, DTensor) collective reaching
    the dispatcher while active, forward and backward; per op in ``by_op``."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.by_op: dict[str, int] = {}

    def _a2a(self, inp: torch.Tensor, splits: Any, group: Any) -> int:
        size, rank = _group(group)
        if splits and size > 1:
            return all_to_all_v_bytes(_row_bytes(inp), [int(n) for n in splits], rank)
        return link_bytes("all_to_all", _nbytes(inp), size)

    def _count(self, name: str, args: tuple[Any, ...]) -> int:
        if name == "c10d.alltoall_base_":  # (output, input, pg, out_splits, in_splits, ...)
            return self._a2a(args[1], args[4], args[2])
        if name in ("_c10d_functional.all_to_all_single", "_c10d_functional_autograd."
                    "all_to_all_single"):  # fmt: skip
            return self._a2a(args[0], args[2], args[3])
        if name == "c10d._allgather_base_":  # (output, input, pg, ...)
            return link_bytes("all_gather", _nbytes(args[0]), _group(args[2])[0])
        if name == "c10d.allgather_":  # ([[outputs]], [inputs], pg, ...)
            return link_bytes("all_gather", sum(map(_nbytes, args[0][0])), _group(args[2])[0])
        if name == "_c10d_functional.all_gather_into_tensor":  # (input, group_size, name)
            return link_bytes("all_gather", _nbytes(args[0]) * int(args[1]), int(args[1]))
        if name == "c10d.allreduce_":  # ([tensors], pg, ...)
            return link_bytes("all_reduce", sum(map(_nbytes, args[0])), _group(args[1])[0])
        if name == "_c10d_functional.all_reduce":  # (input, op, name)
            return link_bytes("all_reduce", _nbytes(args[0]), _group(args[2])[0])
        if name in ("c10d.reduce_scatter_tensor_coll_", "c10d._reduce_scatter_base_"):
            return link_bytes("reduce_scatter", _nbytes(args[1]), _group(args[2])[0])
        if name == "_c10d_functional.reduce_scatter_tensor":  # (input, op, size, name)
            return link_bytes("reduce_scatter", _nbytes(args[0]), int(args[2]))
        return 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = str(func.overloadpacket)
        if "c10d" in name:
            n = self._count(name, tuple(args))
            if n:
                self.bytes += n
                self.by_op[name] = self.by_op.get(name, 0) + n
        return func(*args, **(kwargs or {}))


# ---- the module, the tokens, the step ----------------------------------------------------------
def _tokens(cfg: dict[str, Any], rank: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """This rank's tokens: hidden [N, H] and routing weights [N, K] (both requiring grad, as
    they do after a router), top_k_index [N, K] (K distinct experts, uniform), dY [N, H]."""
    n, h, e, k = cfg["tokens"], cfg["hidden"], cfg["experts"], cfg["top_k"]
    g = torch.Generator().manual_seed(1000 + rank)
    hidden = torch.randn(n, h, generator=g)
    index = torch.rand(n, e, generator=g).topk(k, dim=-1).indices
    weights = torch.randn(n, k, generator=g).softmax(-1)
    dy = torch.randn(n, h, generator=g)
    hidden, weights, dy = (t.to(device) for t in (hidden, weights, dy))
    return hidden.requires_grad_(), index.to(device), weights.requires_grad_(), dy


def _expert_param_bytes(module: nn.Module) -> int:
    """Bytes of expert weights this rank holds (a DTensor's local shard)."""
    total = 0
    for p in module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += _nbytes(local)
    return total


class _Bench:
    """The models of one run and their step (every case a closure over the same tokens)."""

    def __init__(self, cfg: dict[str, Any], device: torch.device) -> None:
        self.cfg, self.device = cfg, device
        self.rank = dist.get_rank()
        self.mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("ep",))
        self.base = _hf_ep.tiny_experts(
            torch.float32,
            HF_IMPL,
            hidden=cfg["hidden"],
            intermediate=cfg["intermediate"],
            num_experts=cfg["experts"],
            top_k=cfg["top_k"],
            seed=0,
        ).to(device)
        self.x, self.index, self.w, self.dy = _tokens(cfg, self.rank, device)

    def ours(self, **options: Any) -> nn.Module:
        return parallelize_experts(copy.deepcopy(self.base), self.mesh, **options)

    def hf(self) -> nn.Module:
        return _hf_ep.hf_all_to_all_ep(copy.deepcopy(self.base), self.mesh)

    def stock(self) -> nn.Module:
        return copy.deepcopy(self.base)

    def step(self, model: nn.Module) -> None:
        for p in model.parameters():
            p.grad = None
        self.x.grad = self.w.grad = None
        model(self.x, self.index, self.w).backward(self.dy)

    def case(self, model: nn.Module) -> Any:
        return lambda: self.step(model)


def _shapes(cfg: dict[str, Any]) -> dict[str, Any]:
    keys = ("experts", "hidden", "intermediate", "top_k", "tokens", "dtype")
    return {
        **{k: cfg[k] for k in keys},
        "experts_implementation_hf": HF_IMPL,
        "hp_moe_version": __version__,
        "load_avg_start": cfg["load_avg_start"],
    }


def _auto_choice(model: nn.Module) -> dict[str, Any]:
    info = experts_info(model)
    return {k: info.get(k) for k in ("impl", "impl_reason", "chunks", "chunks_reason")}


# ---- parts 1 and 2: plain gloo -----------------------------------------------------------------
def _plain(b: _Bench) -> list[dict[str, Any]]:
    cfg, device = b.cfg, b.device
    ep = f"ep{dist.get_world_size()}"
    models = {
        f"ours_auto_{ep}": b.ours(),
        f"ours_grouped_mm_{ep}": b.ours(impl="grouped_mm"),
        f"hf_all_to_all_{ep}": b.hf(),
        "stock_ep1": b.stock(),
    }
    cases = {name: b.case(m) for name, m in models.items()}
    times = interleaved_timing(cases, repeats=cfg["repeats"], warmup=cfg["warmup"], device=device)
    peak, moved, by_op, params = {}, {}, {}, {}
    for name, fn in cases.items():
        peak[name] = max_over_ranks(float(peak_memory_bytes(fn, device)))
        with LinkBytes() as counter:
            fn()
        moved[name] = max_over_ranks(float(counter.bytes))
        by_op[name] = counter.by_op
        params[name] = max_over_ranks(float(_expert_param_bytes(models[name])))
    # the cross-check of ours' count
    sim_bytes = max_over_ranks(float(bytes_per_call(cases[f"ours_auto_{ep}"])))
    auto = {f"auto_{k}": v for k, v in _auto_choice(models[f"ours_auto_{ep}"]).items()}
    gm = _auto_choice(models[f"ours_grouped_mm_{ep}"])
    pairs = [
        (f"ours_auto_{ep}_vs_stock_ep1", f"ours_auto_{ep}", "stock_ep1"),
        (f"ours_grouped_mm_{ep}_vs_stock_ep1", f"ours_grouped_mm_{ep}", "stock_ep1"),
        (f"ours_auto_vs_hf_all_to_all_{ep}", f"ours_auto_{ep}", f"hf_all_to_all_{ep}"),
        (f"ours_grouped_mm_vs_hf_all_to_all_{ep}", f"ours_grouped_mm_{ep}", f"hf_all_to_all_{ep}"),
    ]
    return [
        bench_record(
            f"{PREFIX}/{name}",
            times[a],
            times[bl],
            peak_mem_ours=int(peak[a]),
            peak_mem_baseline=int(peak[bl]),
            device=device.type,
            ours=a,
            baseline=bl,
            expert_param_bytes_ours=int(params[a]),
            expert_param_bytes_baseline=int(params[bl]),
            bytes_per_step_ours=int(moved[a]),
            bytes_per_step_baseline=int(moved[bl]),
            bytes_by_op_ours=by_op[a],
            bytes_by_op_baseline=by_op[bl],
            bytes_per_step_ours_simulated_link=int(sim_bytes) if a == f"ours_auto_{ep}" else None,
            ours_chunks=gm["chunks"] if a == f"ours_grouped_mm_{ep}" else auto["auto_chunks"],
            ours_impl=gm["impl"] if a == f"ours_grouped_mm_{ep}" else auto["auto_impl"],
            repeats=cfg["repeats"],
            load_avg_end=_loadavg(),
            **auto,
            **_shapes(cfg),
        )
        for name, a, bl in pairs
    ]


# ---- part 3: under the modeled link ------------------------------------------------------------
def _link(b: _Bench) -> list[dict[str, Any]]:
    cfg, device = b.cfg, b.device
    latency = cfg["link_latency"]
    auto_model = b.ours()  # chunks="auto", overlap=True
    b.step(auto_model)
    choice = _auto_choice(auto_model)
    c_auto = int(choice["chunks"])
    overlap = {f"ours_chunks{c}": c for c in cfg["link_chunks"]}
    overlap["ours_auto"] = c_auto
    twin = {name: f"blocking_chunks{c}" for name, c in overlap.items()}
    models: dict[str, nn.Module] = {"blocking_chunks1": b.ours(chunks=1, overlap=False)}
    for name, c in overlap.items():  # each case beside its twin in the interleaved order
        models[name] = auto_model if name == "ours_auto" else b.ours(chunks=c)
        if twin[name] not in models:
            models[twin[name]] = b.ours(chunks=c, overlap=False)
    plain = {name: b.case(m) for name, m in models.items()}

    # every case under one link whose bandwidth the blocking one-chunk step calibrates; the
    # link figures are the timed steps' own
    m = measure_under_link(
        plain,
        "blocking_chunks1",
        latency_s=latency,
        repeats=cfg["link_repeats"],
        device=device,
        scale=cfg["link_scale"],
        runs=0,
    )
    t_fwd, t_bwd = _phase_times(b, models["blocking_chunks1"], cfg["link_repeats"])
    forward_share = t_fwd / (t_fwd + t_bwd)
    # Whatever the schedule: half the step's bytes (dispatch + combine) move in the forward,
    # under the forward's share of the compute (at link scale 1 the link's time per step is
    # the whole step's compute)
    t_rel = 1.0 / cfg["link_scale"]  # T_link / compute
    bound = 1.0 - max(0.0, 0.5 * t_rel - forward_share) / t_rel
    peak = {name: max_over_ranks(float(peak_memory_bytes(fn, device))) for name, fn in
            plain.items()}  # fmt: skip
    # --split: the plain gloo steps of the blocking twins, for how a short figure's step splits
    # (link_time_split: the link ours' schedule did not hide, the chunking overhead, the copies)
    blocking = sorted(set(twin.values()) | {"blocking_chunks1"})
    no_link = (
        interleaved_timing(
            {n: plain[n] for n in blocking}, repeats=cfg["link_repeats"], warmup=1, device=device
        )
        if cfg["split"]
        else {}
    )
    if dist.get_rank() == 0:
        print(
            f"link: blocking 1-chunk {m.calibration_line()}; auto: "
            f"{choice['chunks']} chunk(s) ({choice['chunks_reason']})"
        )
    records = []
    for name, base in twin.items():
        c = c_auto if name == "ours_auto" else int(name.removeprefix("ours_chunks"))
        hidden = m.hidden_fraction(name, base)
        ours_link = m.cases[name]
        ceiling = 1.0 - 1.0 / c
        records.append(
            m.record(
                f"{PREFIX}/link/{name}_vs_blocking",
                name,
                base,
                device=device.type,
                chunks=c,
                auto_chunks=c_auto,
                auto_chunks_reason=choice["chunks_reason"],
                impl=choice["impl"],
                impl_reason=choice["impl_reason"],
                peak_mem_ours=int(peak[name]),
                peak_mem_baseline=int(peak[base]),
                link_scale=cfg["link_scale"],
                ceiling=ceiling,
                forward_share=forward_share,
                t_forward_blocking_s=t_fwd,
                t_backward_blocking_s=t_bwd,
                bound_any_schedule=bound,
                # the goal: 0.8 hidden, or within 0.05 of the schedule's ceiling
                meets_goal=bool(hidden >= 0.8 or hidden >= ceiling - 0.05),
                **{
                    # what ours' own schedule hid of ours' link: 1 - (its waits' sleep) / T_link
                    "schedule_hidden_share": 1.0 - ours_link.added_s / ours_link.t_link_s,
                    **(
                        link_time_split(m, name, base, no_link, base, "blocking_chunks1")
                        if no_link
                        else {}
                    ),
                },
                repeats=cfg["link_repeats"],
                load_avg_end=_loadavg(),
                **_shapes(cfg),
            )
        )
    return records


def _phase_times(b: _Bench, model: nn.Module, repeats: int) -> tuple[float, float]:
    """Median seconds (slowest rank) of the forward alone and of the backward alone."""
    fwd, bwd = [], []
    for _ in range(repeats):
        for p in model.parameters():
            p.grad = None
        b.x.grad = b.w.grad = None
        dist.barrier()
        t0 = time.perf_counter()
        y = model(b.x, b.index, b.w)
        t1 = time.perf_counter()
        dist.barrier()
        t2 = time.perf_counter()
        y.backward(b.dy)
        t3 = time.perf_counter()
        fwd.append(max_over_ranks(t1 - t0))
        bwd.append(max_over_ranks(t3 - t2))
    return statistics.median(fwd), statistics.median(bwd)


def _body(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    device = torch.device(cfg["device"])
    b = _Bench(cfg, device)
    records = [] if cfg["link_only"] else _plain(b)
    if cfg["link"]:
        # --repeat R: R runs of the whole link part, each interleaving every case; per record
        # the median run's figures (hidden_fraction the median, hidden_fraction_runs the R)
        records += median_of_runs([_link(b) for _ in range(cfg["repeat"])])
    return records


def _loadavg() -> str | None:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return None


def _config(argv: list[str] | None = None) -> tuple[dict[str, Any], str]:
    p = bench_arguments(__doc__)
    p.add_argument("--tokens", type=int, default=None, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--intermediate", type=int, default=None)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument(
        "--world", type=int, default=None,
        help=f"ranks (default: min({WORLD}, the available cores): one core per rank)",
    )  # fmt: skip
    p.add_argument(
        "--repeat", type=int, default=1,
        help="runs of the modeled-link part, each interleaving every case; records the median",
    )  # fmt: skip
    p.add_argument(
        "--split", action="store_true",
        help="also the time split of each link record (unhidden link, chunking, copies)",
    )  # fmt: skip
    p.add_argument("--link-latency", type=float, default=20e-6, help="modeled link latency (s)")
    p.add_argument("--no-link", action="store_true", help="skip the modeled-link comparisons")
    p.add_argument("--link-only", action="store_true", help="only the modeled-link comparisons")
    p.add_argument(
        "--link-scale", type=float, default=1.0,
        help="the modeled link's bandwidth as a multiple of the calibrated one (1: the blocking "
        "step's bytes take as long as its compute)",
    )  # fmt: skip
    p.add_argument(
        "--link-chunks", default=",".join(map(str, LINK_CHUNKS)),
        help="comma-separated chunk counts of the modeled-link table (auto is always added; "
        "'' for auto alone)",
    )  # fmt: skip
    a = p.parse_args(argv)
    # tokens per rank, hidden, intermediate, repeats, link repeats
    dims = (512, 256, 256, 3, 3) if a.quick else (1024, 256, 512, 5, 9)
    cfg = {
        "device": a.device,
        "dtype": "fp32",
        "tokens": a.tokens or dims[0],
        "hidden": a.hidden or dims[1],
        "intermediate": a.intermediate or dims[2],
        "experts": a.experts,
        "top_k": a.top_k,
        "repeats": a.repeats or dims[3],
        "link_repeats": a.repeats or dims[4],
        "warmup": 1,
        "link": not a.no_link,
        "link_only": a.link_only and not a.no_link,
        "link_chunks": sorted({int(c) for c in a.link_chunks.split(",") if c.strip()}),
        "world": link_world(WORLD, a.world),
        "repeat": max(1, a.repeat),
        "split": a.split,
        "link_latency": a.link_latency,
        "link_scale": a.link_scale,
        "load_avg_start": _loadavg(),
    }
    return cfg, a.out


def main(argv: list[str] | None = None) -> None:
    cfg, out = _config(argv)
    facts = run_facts(cfg["world"])
    records = run_ranks(_body, cfg, world_size=cfg["world"], timeout=3600.0)
    if records is not None:  # rank 0 (or the launching process) reports
        records = [{**r, **facts} for r in records]
        write_records(out, records)
        print(f"load average: {cfg['load_avg_start']} at the start, {_loadavg()} at the end")
        for r in records:
            if r.get("simulated"):
                print(
                    f"{summary_line(r)}  [modeled link: C={r['chunks']}, T_link "
                    f"{r['t_link_s'] * 1e3:.1f} ms, hidden {r['hidden_fraction']:.2f} "
                    f"(paired {r['hidden_fraction_paired']:.2f}) "
                    f"(ceiling {r['ceiling']:.2f}, any schedule {r['bound_any_schedule']:.2f}), "
                    f"added to ours "
                    f"{r['link_added_ours_s'] * 1e3:.1f} ms, runs "
                    f"{[round(v, 2) for v in r.get('hidden_fraction_runs', [])]}]"
                    + (
                        f"  split: unhidden {r['split_unhidden_link']:.2f}, chunking "
                        f"{r['split_chunking_overhead']:.2f}, copies {r['split_copies_cpu']:.2f}"
                        if "split_unhidden_link" in r
                        else ""
                    )
                )
                continue
            print(
                f"{summary_line(r)}  expert params/rank "
                f"{r['expert_param_bytes_ours'] / 2**20:.1f} vs "
                f"{r['expert_param_bytes_baseline'] / 2**20:.1f} MiB, bytes/step "
                f"{r['bytes_per_step_ours'] / 2**20:.2f} vs "
                f"{r['bytes_per_step_baseline'] / 2**20:.2f} MiB"
            )


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
