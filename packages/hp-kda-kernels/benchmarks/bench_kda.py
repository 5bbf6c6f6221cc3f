"""KDA context parallelism benchmarks, side by side, interleaved, median.

1. ``state_summary`` (chunk-parallel WY/UT form) vs the token-by-token fold
   (``naive_state_summary``) on one process.
2. Each exchange protocol (forward + backward of one exchange) at 2 and 4 ranks for
   Kimi-Linear state shapes (H heads of K = V = 128, fp32): time, bytes received per rank
   (counted at the collectives), and what ``auto`` picked vs the measured best.
3. ``kda_context_parallel`` (forward + backward) at 2 ranks vs the serial chunked layer on the
   whole sequence on one rank (parallel efficiency = serial / (P · parallel)).
4. On CUDA only: the Triton merge kernel vs the torch fold kernel.
5. The stock Hugging Face ``KimiLinearDeltaAttention`` (hidden 1024, 8 heads of 128, T = 8192;
   T = 2048 for local CPU ranks; transformers needed) under ``parallelize_kda`` at 2 and 4
   ranks vs the stock serial layer on the whole sequence (and vs the rewritten layer on one
   rank): time, peak memory, bytes received per rank (state exchange + halo).
6. At 4 ranks, each exchange protocol under a modeled latency-bound link (``simulated_link``,
   a simulation: every collective completes no earlier than launch + latency + bytes /
   bandwidth; default 2 ms, 100 GB/s; one head, so the link, not the fold, dominates): p2p's
   P-1 serial hops vs one all-gather. Records
   ``kda_exchange_link/P4/<protocol>_vs_best``, and ``auto_vs_best`` with what ``auto`` picks
   on this device (its default cost parameters) and what its cost model picks when told the
   link's latency and bandwidth, both checked against the measured best.
7. At 2 and 4 ranks, ``kda_context_parallel`` (forward + backward of each rank's block) with the
   state exchange in flight while the block's own attention runs (the schedule) vs the earlier
   schedule (every local term, then the exchange), per protocol, under the same modeled link
   (``kda_layer_link/P<P>/<protocol>/overlapped_vs_serial``) and on the plain gloo link
   (``kda_layer_overlap/P<P>/...``), with the time each step spends inside the exchange's
   launches and waits (``exposed_exchange_s``: what compute did not hide) and between them
   (``compute_under_exchange_s``: the compute placed under the exchange). ``--link-only``
   runs sections 6 and 7 alone.
8. At 4 ranks (cp 4), the stock Hugging Face ``Qwen3NextGatedDeltaNet`` (transformers 5.23;
   hidden 1024, 8 key and 16 value heads of 128 on an accelerator, the section 5 sizes and T
   on CPU) under ``parallelize_gated_deltanet`` at each protocol (p2p, allgather, grouped,
   auto) vs the stock serial layer on the whole sequence, and auto vs each protocol
   (``kda_gdn_stock_layer_fwd_bwd/P4/*``); ``--no-gated-deltanet`` skips it,
   ``--gated-deltanet-only --worlds 4`` runs it alone.

    python packages/hp-kda-kernels/benchmarks/bench_kda.py --out bench-results/kda.json [--quick]
    torchrun --nproc-per-node 4 packages/hp-kda-kernels/benchmarks/bench_kda.py \
        --device cuda --out ...

Without torchrun it starts gloo ranks on this machine (2, then 4; ``--worlds``): section 6
needs 4 ranks, so on a 2-core host its records (and every other 4-rank record) are marked
``oversubscribed``; every record carries ``world``, ``cores_per_rank``, ``load`` and
``oversubscribed``. ``--repeat R``: sections 6 and 7 R times, the median run per record.
Under torchrun it uses the launched ranks and the device's backend. Rank 0 writes the records.
"""

from __future__ import annotations

import copy
import importlib
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from hyper_parallel.dtensor import init_device_mesh, unflatten
from hyper_parallel.dtensor.benchmarking import (
    available_cores,
    bench_arguments,
    bench_record,
    interleaved_timing,
    launched_by_torchrun,
    measure_under_link,
    median_of_runs,
    peak_memory_bytes,
    run_facts,
    run_ranks,
    simulated_link,
    summary_line,
    write_records,
)
from hyper_parallel.dtensor.recorder import record_events
from hyper_parallel.kda import (
    DEFAULT_COST_PARAMS,
    CostParams,
    build_state_exchange,
    choose_protocol,
    chunk_kda,
    kda_context_parallel,
    naive_state_summary,
    parallelize_kda,
    state_summary,
)
from hyper_parallel.kda import exchange as exchange_mod
from hyper_parallel.kda import layer as layer_mod
from hyper_parallel.kda.cost import grouped_widths


def _inputs(B: int, T: int, H: int, K: int, V: int, device: Any, seed: int = 0) -> list[Any]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = -torch.rand(B, T, H, K, generator=gen) * 0.1
    beta = torch.rand(B, T, H, generator=gen)
    return [x.to(device) for x in (q, k, v, g, beta)]


# ---- 1. chunked summary vs token-by-token ---------------------------------------------------
def bench_summary(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    B, T, H, K, V = 1, cfg["summary_T"], cfg["summary_H"], 128, 128
    _, k, v, g, beta = _inputs(B, T, H, K, V, "cpu")
    # One intra-op thread, like each CP rank: on a shared, loaded host OpenMP barriers make
    # multi-threaded small ops erratic, and the comparison is per core anyway.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _bench_summary(k, v, g, beta, cfg)
    finally:
        torch.set_num_threads(threads)


def _bench_summary(k: Any, v: Any, g: Any, beta: Any, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    B, T, H, K = k.shape
    V = v.shape[-1]
    with torch.no_grad():
        cases = {
            "chunked": lambda: state_summary(k, v, g, beta, chunk_size=64),
            "token_by_token": lambda: naive_state_summary(k, v, g, beta),
        }
        times = interleaved_timing(cases, repeats=cfg["repeats"], warmup=1)
        mem = {n: peak_memory_bytes(fn) for n, fn in cases.items()}
    return [
        bench_record(
            "kda_state_summary/chunked_vs_token_by_token",
            times["chunked"],
            times["token_by_token"],
            peak_mem_ours=mem["chunked"],
            peak_mem_baseline=mem["token_by_token"],
            speedup=times["token_by_token"] / times["chunked"],
            B=B,
            T=T,
            H=H,
            K=K,
            V=V,
            chunk_size=64,
            threads=torch.get_num_threads(),
        )
    ]


# ---- 2. exchange protocols -----------------------------------------------------------------
class _ByteCounter:
    """Bytes this rank receives while active, from hp-dtensor's recorder (every KDA collective
    starts through hp-dtensor's ``comm``): the state exchange's receives, gathers and
    broadcasts (``bytes``; ``comm.link_bytes``: ``(P−1)/P`` of a gathered buffer, the whole
    tensor of a receive or broadcast) and the short-convolution halo's receives
    (``halo_bytes``). Sends are not counted (their bytes are the peer's receives)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.halo_bytes = 0
        self._ctx: Any = None

    def __enter__(self) -> _ByteCounter:
        self._ctx = record_events()
        self._rec = self._ctx.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._ctx.__exit__(*exc)
        for e in self._rec.events:
            op, _, what = e.name.partition(":")
            if e.kind != "launch" or op == "send":
                continue
            if what in ("halo", "dhalo"):
                self.halo_bytes += e.nbytes
            else:
                self.bytes += e.nbytes


def bench_exchange(cfg: dict[str, Any], device: torch.device) -> list[dict[str, Any]]:
    P, r = dist.get_world_size(), dist.get_rank()
    B, H, K, V = 1, cfg["heads"], 128, 128
    mesh = init_device_mesh(device.type, (P,), mesh_dim_names=("cp",))
    gen = torch.Generator().manual_seed(r)
    S = torch.randn(B, H, K, V, generator=gen).to(device)
    M = (torch.randn(B, H, K, K, generator=gen) / K**0.5).to(device)
    G = torch.randn(B, H, K, V, generator=gen).to(device)
    variants: dict[str, Any] = {"p2p": ("p2p", None), "allgather": ("allgather", None)}
    for w in grouped_widths(P):
        variants[f"grouped:{w}"] = ("grouped", w)
    variants["auto"] = ("auto", None)
    executors = {
        n: build_state_exchange(mesh, p, w, kernel="torch") for n, (p, w) in variants.items()
    }

    def run(ex: Any) -> Callable[[], None]:
        def step() -> None:
            ex.forward(S, M)
            ex.backward(G, M)

        return step

    cases = {n: run(ex) for n, ex in executors.items()}
    # One exchange takes milliseconds: many repetitions keep the median steady.
    times = interleaved_timing(cases, repeats=cfg["repeats"] * 5, warmup=2, device=device)
    received: dict[str, list[int]] = {}
    for name, fn in cases.items():
        with _ByteCounter() as counter:
            fn()
        got = [0] * P
        dist.all_gather_object(got, counter.bytes)
        received[name] = got
    choice = choose_protocol(P, B, H, K, V, device_type=device.type)
    auto_name = choice.protocol + (f":{choice.group_size}" if choice.group_size else "")
    fixed = [n for n in cases if n != "auto"]
    best = min(fixed, key=times.__getitem__)
    shapes = {"B": B, "H": H, "K": K, "V": V, "dtype": "fp32", "P": P, "direction": "fwd+bwd"}
    records = [
        bench_record(
            f"kda_exchange/P{P}/{name}_vs_best",
            times[name],
            times[best],
            device=device.type,
            protocol=name,
            best=best,
            bytes_received_per_rank=received[name],
            bytes_received_max=max(received[name]),
            modelled_s=choice.costs.get(name),
            **shapes,
        )
        for name in fixed
    ]
    records.append(
        bench_record(
            f"kda_exchange/P{P}/auto_vs_best",
            times["auto"],
            times[best],
            device=device.type,
            auto_picked=auto_name,
            auto_picked_measured_s=times[auto_name],
            best=best,
            picked_vs_best=times[auto_name] / times[best],
            explanation=choice.explanation,
            bytes_received_per_rank=received["auto"],
            **shapes,
        )
    )
    return records


# ---- 6. exchange protocols under a modeled latency-bound link ------------------------------
def bench_exchange_link(cfg: dict[str, Any], device: torch.device) -> list[dict[str, Any]]:
    P, r = dist.get_world_size(), dist.get_rank()
    B, H, K, V = 1, cfg["link_heads"], 128, 128
    latency, bandwidth = cfg["link_latency"], cfg["link_bytes_per_s"]
    mesh = init_device_mesh(device.type, (P,), mesh_dim_names=("cp",))
    gen = torch.Generator().manual_seed(r)
    S = torch.randn(B, H, K, V, generator=gen).to(device)
    M = (torch.randn(B, H, K, K, generator=gen) / K**0.5).to(device)
    G = torch.randn(B, H, K, V, generator=gen).to(device)
    variants: dict[str, Any] = {"p2p": ("p2p", None), "allgather": ("allgather", None)}
    for w in grouped_widths(P):
        variants[f"grouped:{w}"] = ("grouped", w)
    executors = {
        n: build_state_exchange(mesh, p, w, kernel="torch") for n, (p, w) in variants.items()
    }

    def run(ex: Any) -> Callable[[], None]:
        def step() -> None:
            ex.forward(S, M)
            ex.backward(G, M)

        return step

    cases = {n: run(ex) for n, ex in executors.items()}
    m = measure_under_link(
        cases,
        latency_s=latency,
        bandwidth=bandwidth,
        repeats=cfg["repeats"] * 3,
        warmup=2,
        device=device,
        runs=0,
    )
    times = {name: c.time_s for name, c in m.cases.items()}
    t_link = {name: c.t_link_s for name, c in m.cases.items()}  # busiest rank's, per step
    best = min(times, key=times.__getitem__)
    cpu_flops = DEFAULT_COST_PARAMS["cpu"].flops_per_s
    told = choose_protocol(
        P, B, H, K, V, params=CostParams(latency, bandwidth, cpu_flops)
    )  # the cost model told this link's α and β
    default = choose_protocol(P, B, H, K, V, device_type=device.type)

    def label(c: Any) -> str:
        return c.protocol + (f":{c.group_size}" if c.group_size else "")

    told_name, default_name = label(told), label(default)
    link = {
        "simulated": True,
        "link_latency_s": latency,
        "link_bytes_per_s": bandwidth,
        "B": B, "H": H, "K": K, "V": V, "dtype": "fp32", "P": P, "direction": "fwd+bwd",
    }  # fmt: skip
    if r == 0:
        print(
            f"link (kda exchange, P={P}): latency {latency * 1e3:.1f} ms, "
            f"{bandwidth / 1e9:.0f} GB/s; measured "
            + ", ".join(f"{n} {t * 1e3:.2f} ms" for n, t in times.items())
            + f"; model told the link picks {told_name}, default picks {default_name}"
        )
    records = [
        bench_record(
            f"kda_exchange_link/P{P}/{name}_vs_best",
            times[name],
            times[best],
            device=device.type,
            protocol=name,
            best=best,
            t_link_s=t_link[name],
            modelled_s_told_link=told.costs.get(name),
            **link,
        )
        for name in cases
    ]
    records.append(
        bench_record(
            f"kda_exchange_link/P{P}/auto_vs_best",
            times[default_name],
            times[best],
            device=device.type,
            best=best,
            auto_picked=default_name,
            auto_picked_told_link=told_name,
            told_link_vs_best=times[told_name] / times[best],
            auto_matches_best=default_name == best,
            told_link_matches_best=told_name == best,
            explanation=told.explanation,
            t_link_s=t_link[default_name],
            **link,
        )
    )
    return records


# ---- 7. the exchange in flight under the block's own attention ------------------------------
def bench_layer_overlap(cfg: dict[str, Any], device: torch.device) -> list[dict[str, Any]]:
    P, r = dist.get_world_size(), dist.get_rank()
    B, T, H, K, V = 1, cfg["overlap_T"], cfg["overlap_heads"], 128, 128
    latency, bandwidth = cfg["link_latency"], cfg["link_bytes_per_s"]
    mesh = init_device_mesh(device.type, (P,), mesh_dim_names=("cp",))
    full = _inputs(B, T, H, K, V, device)
    lo, hi = T * r // P, T * (r + 1) // P
    local = [x[:, lo:hi].clone().requires_grad_() for x in full]
    variants: dict[str, Any] = {"p2p": ("p2p", None), "allgather": ("allgather", None)}
    for w in grouped_widths(P):
        variants[f"grouped:{w}"] = ("grouped", w)

    def run(protocol: str, width: int | None, overlap: bool) -> Callable[[], None]:
        def step() -> None:
            layer_mod._OVERLAP = overlap
            try:
                o, _ = kda_context_parallel(
                    *local, mesh, protocol=protocol, group_size=width, chunk_size=64,
                    kernel="torch",
                )  # fmt: skip
                o.sum().backward()
            finally:
                layer_mod._OVERLAP = True
            for x in local:
                x.grad = None

        return step

    cases = {
        f"{name}/{mode}": run(p, w, mode == "overlapped")
        for name, (p, w) in variants.items()
        for mode in ("overlapped", "serial")
    }
    repeats = cfg["repeats"] * 3
    m = measure_under_link(
        cases,
        latency_s=latency,
        bandwidth=bandwidth,
        repeats=repeats,
        warmup=2,
        device=device,
        runs=0,
    )
    linked = {name: c.time_s for name, c in m.cases.items()}
    plain = interleaved_timing(cases, repeats=repeats, warmup=2, device=device)
    # modeled link seconds of one overlapped step, busiest rank
    t_link = {name: m.cases[f"{name}/overlapped"].t_link_s for name in variants}
    with simulated_link(latency, bandwidth):
        exposed_link, under_link = _exposed_exchange(cases, repeats)
    exposed_plain, under_plain = _exposed_exchange(cases, repeats)
    shapes = {"B": B, "T": T, "H": H, "K": K, "V": V, "dtype": "fp32", "P": P, "chunk_size": 64}
    records = []
    for name in variants:
        records.append(
            bench_record(
                f"kda_layer_link/P{P}/{name}/overlapped_vs_serial",
                linked[f"{name}/overlapped"],
                linked[f"{name}/serial"],
                device=device.type,
                protocol=name,
                simulated=True,
                link_latency_s=latency,
                link_bytes_per_s=bandwidth,
                t_link_s=t_link[name],
                direction="fwd+bwd",
                exposed_exchange_s=exposed_link[f"{name}/overlapped"],
                exposed_exchange_serial_s=exposed_link[f"{name}/serial"],
                compute_under_exchange_s=under_link[f"{name}/overlapped"],
                **shapes,
            )
        )
        records.append(
            bench_record(
                f"kda_layer_overlap/P{P}/{name}/overlapped_vs_serial",
                plain[f"{name}/overlapped"],
                plain[f"{name}/serial"],
                device=device.type,
                protocol=name,
                direction="fwd+bwd",
                exposed_exchange_s=exposed_plain[f"{name}/overlapped"],
                exposed_exchange_serial_s=exposed_plain[f"{name}/serial"],
                compute_under_exchange_s=under_plain[f"{name}/overlapped"],
                **shapes,
            )
        )
    if r == 0:
        print(
            f"layer overlap (P={P}, T={T}, H={H}): "
            + ", ".join(f"{n} {t * 1e3:.1f} ms" for n, t in linked.items())
            + " under the modeled link; "
            + ", ".join(f"{n} {t * 1e3:.1f} ms" for n, t in plain.items())
            + " on gloo; exposed exchange (in start + wait, slowest rank) "
            + ", ".join(f"{n} {t * 1e3:.2f} ms" for n, t in exposed_link.items())
            + " under the link, "
            + ", ".join(f"{n} {t * 1e3:.2f} ms" for n, t in exposed_plain.items())
            + " on gloo; compute between launch and wait "
            + ", ".join(f"{n} {t * 1e3:.2f} ms" for n, t in under_link.items())
            + " under the link"
        )
    return records


def _exposed_exchange(
    cases: dict[str, Callable[[], None]], repeats: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Medians over steps, the slowest rank's: the time a step spends inside the state
    exchange's launches and waits, forward and backward (the communication compute did not
    hide), and the time between each launch and its wait (the compute placed under it)."""
    spent, under, launched = [0.0], [0.0], [None]
    saved = {
        (exchange_mod.StateExchange, "start_forward"): exchange_mod.StateExchange.start_forward,
        (exchange_mod.StateExchange, "start_backward"): exchange_mod.StateExchange.start_backward,
        (exchange_mod.PendingExchange, "wait"): exchange_mod.PendingExchange.wait,
    }

    def timed(original: Callable[..., Any], is_wait: bool) -> Callable[..., Any]:
        def wrapped(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            if is_wait and launched[0] is not None:
                under[0] += t0 - launched[0]
            try:
                return original(*a, **kw)
            finally:
                t1 = time.perf_counter()
                spent[0] += t1 - t0
                launched[0] = None if is_wait else t1

        return wrapped

    samples: dict[str, list[float]] = {name: [] for name in cases}
    hidden: dict[str, list[float]] = {name: [] for name in cases}
    for (owner, attr), original in saved.items():
        setattr(owner, attr, timed(original, attr == "wait"))
    try:
        for _ in range(repeats):
            for name, fn in cases.items():
                dist.barrier()
                spent[0], under[0], launched[0] = 0.0, 0.0, None
                fn()
                t = torch.tensor([spent[0], under[0]], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                samples[name].append(float(t[0]))
                hidden[name].append(float(t[1]))
    finally:
        for (owner, attr), original in saved.items():
            setattr(owner, attr, original)

    def median(v: list[float]) -> float:
        return sorted(v)[len(v) // 2]

    return (
        {name: median(v) for name, v in samples.items()},
        {name: median(v) for name, v in hidden.items()},
    )


# ---- 3. the layer vs the serial layer ------------------------------------------------------
def bench_layer(cfg: dict[str, Any], device: torch.device) -> list[dict[str, Any]]:
    P, r = dist.get_world_size(), dist.get_rank()
    B, T, H, K, V = 1, cfg["layer_T"], cfg["layer_H"], 128, 128
    mesh = init_device_mesh(device.type, (P,), mesh_dim_names=("cp",))
    full = _inputs(B, T, H, K, V, device)
    lo, hi = T * r // P, T * (r + 1) // P
    local = [x[:, lo:hi].clone().requires_grad_() for x in full]
    whole = [x.clone().requires_grad_() for x in full]

    def parallel() -> None:
        q, k, v, g, beta = local
        o, _ = kda_context_parallel(q, k, v, g, beta, mesh, protocol="auto", chunk_size=64)
        o.sum().backward()

    def serial() -> None:
        q, k, v, g, beta = whole
        o, _ = chunk_kda(q, k, v, g, beta, chunk_size=64)
        o.sum().backward()

    cases = {"context_parallel": parallel, "serial": serial}
    times = interleaved_timing(cases, repeats=cfg["repeats"], warmup=1, device=device)
    mem = {n: peak_memory_bytes(fn, device) for n, fn in cases.items()}
    return [
        bench_record(
            f"kda_layer_fwd_bwd/P{P}/context_parallel_vs_serial",
            times["context_parallel"],
            times["serial"],
            peak_mem_ours=mem["context_parallel"],
            peak_mem_baseline=mem["serial"],
            device=device.type,
            parallel_efficiency=times["serial"] / (P * times["context_parallel"]),
            B=B,
            T=T,
            H=H,
            K=K,
            V=V,
            chunk_size=64,
        )
    ]


# ---- 5. the stock Hugging Face KDA layer, parallelized ---------------------------------------
def _stock_layer(cfg: dict[str, Any], device: torch.device) -> torch.nn.Module:
    """A stock ``KimiLinearDeltaAttention`` on its PyTorch path, HF's initialisation."""
    from transformers import KimiLinearConfig

    from hyper_parallel.kda.testing import import_torch_path

    name = "transformers.models.kimi_linear.modeling_kimi_linear"
    # on CPU the PyTorch path (fla's Triton kernels do not run there); on an accelerator the
    # serial layer may use flash-linear-attention's kernels where they are installed
    kimi = import_torch_path(name) if device.type == "cpu" else importlib.import_module(name)
    H, K = cfg["stock_heads"], 128
    config = KimiLinearConfig(
        hidden_size=cfg["stock_hidden"], num_hidden_layers=1,
        linear_attn_config={"head_dim": K, "num_heads": H, "short_conv_kernel_size": 4},
    )  # fmt: skip
    torch.manual_seed(0)
    layer = kimi.KimiLinearDeltaAttention(config, layer_idx=0)
    with torch.no_grad():  # the bare layer leaves the gate's A_log and dt_bias uninitialised
        layer.forget_gate.A_log.uniform_(1.0, 16.0).log_()
        layer.forget_gate.dt_bias.uniform_(-7.0, -2.3)
    return layer.to(device)


def bench_stock_layer(cfg: dict[str, Any], device: torch.device) -> list[dict[str, Any]]:
    """``parallelize_kda`` on the stock layer (forward + backward of the rank's block) vs the
    stock serial layer on the whole sequence (rank 0 only: one serial copy in memory)."""
    P, r = dist.get_world_size(), dist.get_rank()
    T, D = cfg["stock_T"], cfg["stock_hidden"]
    mesh = init_device_mesh(device.type, (P,), mesh_dim_names=("cp",))
    serial = _stock_layer(cfg, device)
    parallel = parallelize_kda(copy.deepcopy(serial), mesh, protocol="auto")
    # the same rewritten layer on a one-rank mesh: our math, serial (no communication)
    solo = unflatten(mesh, "cp", (P, 1), ("cp_ranks", "cp_solo"))["cp_solo"]
    ours_serial = parallelize_kda(copy.deepcopy(serial), solo, protocol="p2p")
    x = torch.randn(1, T, D, generator=torch.Generator().manual_seed(1)).to(device)
    block = x[:, T * r // P : T * (r + 1) // P].contiguous()

    def step(layer: torch.nn.Module, inp: torch.Tensor) -> Callable[[], None]:
        def run() -> None:
            layer.zero_grad(set_to_none=True)
            layer(inp.detach().requires_grad_()).sum().backward()

        return run

    cases = {"parallel": step(parallel, block)}
    cases["serial"] = step(serial, x) if r == 0 else (lambda: None)
    cases["ours_serial"] = step(ours_serial, x) if r == 0 else (lambda: None)
    times = interleaved_timing(cases, repeats=cfg["stock_repeats"], warmup=1, device=device)
    mem = {n: peak_memory_bytes(fn, device) for n, fn in cases.items()}
    with _ByteCounter() as counter:
        cases["parallel"]()
    got = [[0, 0]] * P
    dist.all_gather_object(got, [counter.bytes, counter.halo_bytes])
    H = cfg["stock_heads"]
    return [
        bench_record(
            f"kda_stock_layer_fwd_bwd/P{P}/parallelize_kda_vs_serial",
            times["parallel"],
            times["serial"],
            peak_mem_ours=mem["parallel"],
            peak_mem_baseline=mem["serial"] if r == 0 else None,
            device=device.type,
            parallel_efficiency=times["serial"] / (P * times["parallel"]),
            ours_serial_s=times["ours_serial"],
            ours_serial_peak_mem=mem["ours_serial"] if r == 0 else None,
            parallel_efficiency_vs_ours_serial=times["ours_serial"] / (P * times["parallel"]),
            state_bytes_received_per_rank=[g[0] for g in got],
            halo_bytes_received_per_rank=[g[1] for g in got],
            bytes_received_max=max(g[0] + g[1] for g in got),
            protocol="auto",
            auto_choice=choose_protocol(P, 1, H, 128, 128, device_type=device.type).protocol,
            hidden=D,
            heads=H,
            head_dim=128,
            T=T,
            dtype="fp32",
            serial="stock KimiLinearDeltaAttention (on CPU its PyTorch path); "
            "ours_serial: the rewritten layer on a one-rank mesh",
        )
    ]


# ---- 8. the stock Gated DeltaNet layer (Qwen3-Next), parallelized ----------------------------
GDN_PROTOCOLS = ("p2p", "allgather", "grouped", "auto")


def _stock_gdn_layer(cfg: dict[str, Any], device: torch.device) -> torch.nn.Module:
    """A stock ``Qwen3NextGatedDeltaNet`` on its PyTorch path (hidden ``stock_hidden``,
    ``stock_heads`` key heads and twice as many value heads of 128, convolution 4), HF's
    initialisation with a slow decay (the state carries across blocks)."""
    from transformers import Qwen3NextConfig

    from hyper_parallel.kda.testing import import_torch_path

    name = "transformers.models.qwen3_next.modeling_qwen3_next"
    qwen = import_torch_path(name) if device.type == "cpu" else importlib.import_module(name)
    H = cfg["stock_heads"]
    config = Qwen3NextConfig(
        hidden_size=cfg["stock_hidden"], num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, linear_num_key_heads=H, linear_num_value_heads=2 * H,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        layer_types=["linear_attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    layer = qwen.Qwen3NextGatedDeltaNet(config, layer_idx=0)
    with torch.no_grad():
        layer.A_log.uniform_(1.0, 16.0).log_()
        layer.dt_bias.uniform_(-7.0, -2.3)
    return layer.to(device)


def bench_gated_deltanet(cfg: dict[str, Any], device: torch.device) -> list[dict[str, Any]]:
    """``parallelize_gated_deltanet`` on the stock Qwen3-Next Gated DeltaNet layer at each
    protocol (forward + backward of the rank's block) vs the stock serial layer on the whole
    sequence (rank 0 only), all interleaved; records ``kda_gdn_stock_layer_fwd_bwd/P<P>/
    <protocol>_vs_serial`` and, per protocol, ``.../<protocol>_vs_auto``."""
    from hyper_parallel.kda import parallelize_gated_deltanet

    P, r = dist.get_world_size(), dist.get_rank()
    T, D = cfg["stock_T"], cfg["stock_hidden"]
    mesh = init_device_mesh(device.type, (P,), mesh_dim_names=("cp",))
    serial = _stock_gdn_layer(cfg, device)
    layers = {
        proto: parallelize_gated_deltanet(copy.deepcopy(serial), mesh, protocol=proto)
        for proto in GDN_PROTOCOLS
    }
    x = torch.randn(1, T, D, generator=torch.Generator().manual_seed(1)).to(device)
    block = x[:, T * r // P : T * (r + 1) // P].contiguous()

    def step(layer: torch.nn.Module, inp: torch.Tensor) -> Callable[[], None]:
        def run() -> None:
            layer.zero_grad(set_to_none=True)
            layer(inp.detach().requires_grad_()).sum().backward()

        return run

    cases = {proto: step(layer, block) for proto, layer in layers.items()}
    cases["serial"] = step(serial, x) if r == 0 else (lambda: None)
    times = interleaved_timing(cases, repeats=cfg["stock_repeats"], warmup=1, device=device)
    mem = {n: peak_memory_bytes(fn, device) for n, fn in cases.items()}
    shapes = dict(hidden=D, key_heads=cfg["stock_heads"], value_heads=2 * cfg["stock_heads"],
                  head_dim=128, T=T, dtype="fp32")  # fmt: skip
    serial_what = "stock Qwen3NextGatedDeltaNet (on CPU its PyTorch path), whole sequence"
    records = []
    for proto in GDN_PROTOCOLS:
        records.append(
            bench_record(
                f"kda_gdn_stock_layer_fwd_bwd/P{P}/{proto}_vs_serial",
                times[proto],
                times["serial"],
                peak_mem_ours=mem[proto],
                peak_mem_baseline=mem["serial"] if r == 0 else None,
                device=device.type,
                protocol=proto,
                parallel_efficiency=times["serial"] / (P * times[proto]),
                serial=serial_what,
                **shapes,
            )
        )
    for proto in GDN_PROTOCOLS[:-1]:
        records.append(
            bench_record(
                f"kda_gdn_stock_layer_fwd_bwd/P{P}/auto_vs_{proto}",
                times["auto"],
                times[proto],
                peak_mem_ours=mem["auto"],
                peak_mem_baseline=mem[proto],
                device=device.type,
                protocol="auto",
                baseline_protocol=proto,
                **shapes,
            )
        )
    return records


# ---- 4. Triton kernels (CUDA only) ---------------------------------------------------------
def bench_kernels(cfg: dict[str, Any], device: torch.device) -> list[dict[str, Any]]:
    from hyper_parallel.kda import affine_merge

    P, B, H, K, V = 8, 1, cfg["heads"], 128, 128
    S = torch.randn(P, B, H, K, V, device=device)
    M = torch.randn(P, B, H, K, K, device=device) / K**0.5
    cases = {
        "triton": lambda: affine_merge(S, M, P - 1, kernel="triton"),
        "torch": lambda: affine_merge(S, M, P - 1, kernel="torch"),
    }
    times = interleaved_timing(cases, repeats=cfg["repeats"] * 4, warmup=3, device=device)
    return [
        bench_record(
            "kda_affine_merge/triton_vs_torch",
            times["triton"],
            times["torch"],
            device=device.type,
            P=P,
            B=B,
            H=H,
            K=K,
            V=V,
        )
    ]


def _ranks_body(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    device = torch.device(cfg["device"])
    P = dist.get_world_size()

    # --repeat R: the modeled-link sections R times, each run interleaving its cases; per
    # record the median run's figures
    def exchange_link() -> list[dict[str, Any]]:
        return median_of_runs([bench_exchange_link(cfg, device) for _ in range(cfg["repeat"])])

    def layer_overlap() -> list[dict[str, Any]]:
        return median_of_runs([bench_layer_overlap(cfg, device) for _ in range(cfg["repeat"])])

    if cfg["gated_deltanet_only"]:
        return bench_gated_deltanet(cfg, device)
    if cfg["link_only"]:
        records = exchange_link() if P == 4 else []
        return records + layer_overlap()
    records = bench_exchange(cfg, device)
    if P == 4 and cfg["link"]:
        records += exchange_link()
    if P == 2:
        records += bench_layer(cfg, device)
    if cfg["link"]:
        records += layer_overlap()
    records += bench_stock_layer(cfg, device)
    if P == 4 and cfg["gated_deltanet"]:  # cp 4 (oversubscribed on a 2-core host)
        records += bench_gated_deltanet(cfg, device)
    return records


def _config(argv: list[str] | None = None) -> tuple[dict[str, Any], str]:
    p = bench_arguments(__doc__)
    p.add_argument("--link-latency", type=float, default=2e-3, help="modeled link latency (s)")
    p.add_argument("--link-bandwidth", type=float, default=1e11, help="modeled link bytes/s")
    p.add_argument("--link-heads", type=int, default=1, help="heads H of the link comparison")
    p.add_argument("--no-link", action="store_true", help="skip the modeled-link comparison")
    p.add_argument("--link-only", action="store_true", help="only sections 6 and 7")
    p.add_argument(
        "--no-gated-deltanet", action="store_true",
        help="skip section 8 (the stock Qwen3-Next Gated DeltaNet layer at 4 ranks)",
    )  # fmt: skip
    p.add_argument(
        "--gated-deltanet-only", action="store_true",
        help="only section 8, at each of --worlds (e.g. --worlds 4)",
    )  # fmt: skip
    p.add_argument(
        "--worlds", default="2,4",
        help="comma-separated rank counts (sections 2, 5-7; section 6 needs 4): more ranks than "
        "cores run oversubscribed, and their records say so",
    )  # fmt: skip
    p.add_argument(
        "--repeat", type=int, default=1,
        help="runs of the modeled-link sections, each interleaving its cases; records the median",
    )  # fmt: skip
    a = p.parse_args(argv)
    if a.quick:
        cfg = dict(summary_T=256, summary_H=2, heads=8, layer_T=512, layer_H=1, repeats=3)
        cfg.update(overlap_T=256, overlap_heads=1)
        cfg.update(stock_T=512, stock_hidden=256, stock_heads=2, stock_repeats=2)
    else:
        cfg = dict(summary_T=1024, summary_H=4, heads=32, layer_T=4096, layer_H=4, repeats=5)
        cfg.update(overlap_T=1024, overlap_heads=2)
        cfg.update(stock_T=8192, stock_hidden=1024, stock_heads=8, stock_repeats=3)
        if a.device == "cpu" and not launched_by_torchrun():
            # the stock serial layer's PyTorch path needs > 13 GB and minutes per step at
            # T = 8192 on a CPU; its time and memory grow linearly in T
            cfg.update(stock_T=2048, stock_repeats=2)
    cfg["device"] = a.device
    cfg.update(
        link_heads=a.link_heads,
        link=not a.no_link,
        link_only=a.link_only,
        link_latency=a.link_latency,
        link_bytes_per_s=a.link_bandwidth,
        worlds=[int(w) for w in a.worlds.split(",") if w.strip()],
        gated_deltanet=not a.no_gated_deltanet,
        gated_deltanet_only=a.gated_deltanet_only,
        repeat=max(1, a.repeat),
    )
    return cfg, a.out


def _torchrun_body(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """One torchrun rank: the exchange and layer comparisons, kernel timings on CUDA, and the
    single-process summary comparison on rank 0."""
    records = _ranks_body(cfg)
    device = torch.device(cfg["device"])
    if device.type == "cuda":
        records += bench_kernels(cfg, device)
    if dist.get_rank() == 0:
        records += bench_summary(cfg)
    return records


def main(argv: list[str] | None = None) -> None:
    cfg, out = _config(argv)
    records: list[dict[str, Any]] | None
    if launched_by_torchrun():
        records = run_ranks(_torchrun_body, cfg)
    else:
        only = cfg["link_only"] or cfg["gated_deltanet_only"]
        records = [] if only else bench_summary(cfg)
        if cfg["worlds"] and max(cfg["worlds"]) > available_cores():
            print(f"note: {max(cfg['worlds'])} ranks on {available_cores()} cores: oversubscribed")
        for P in cfg["worlds"]:
            facts = run_facts(P)
            ranks = run_ranks(_ranks_body, cfg, world_size=P, timeout=900.0) or []
            records += [{**r, **facts} for r in ranks]
    if records is not None:
        write_records(out, records)
        for record in records:
            line = summary_line(record)
            if "bytes_received_max" in record:
                line += f"  recv/rank {record['bytes_received_max'] / 2**20:.2f} MiB"
            if "halo_bytes_received_per_rank" in record:
                line += f" (halo max {max(record['halo_bytes_received_per_rank']) / 2**10:.1f} KiB)"
            if "auto_picked" in record:
                line += f"  auto picked {record['auto_picked']} (best {record['best']})"
            if "auto_picked_told_link" in record:
                line += f"; told the link: {record['auto_picked_told_link']}"
            if record.get("simulated"):
                line += (
                    f"  [modeled link {record['link_latency_s'] * 1e3:.1f} ms, "
                    f"{record['link_bytes_per_s'] / 1e9:.0f} GB/s, T_link "
                    f"{record['t_link_s'] * 1e3:.2f} ms]"
                )
            if "parallel_efficiency" in record:
                line += f"  efficiency {record['parallel_efficiency']:.2f}"
            if "ours_serial_s" in record:
                line += (
                    f" (ours on 1 rank {record['ours_serial_s'] * 1e3:.1f} ms, efficiency "
                    f"{record['parallel_efficiency_vs_ours_serial']:.2f})"
                )
            if "speedup" in record:
                line += f"  speedup {record['speedup']:.1f}x"
            print(line)


if __name__ == "__main__":
    main()
