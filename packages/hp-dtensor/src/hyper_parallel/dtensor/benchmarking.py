"""Shared benchmark plumbing: interleaved timing, peak memory, JSON records.

Every package's benchmark compares "ours" with the baseline a user would otherwise pick, in
one run, interleaved (each repetition runs every case once, in turn, so drift and noise hit
all cases alike), and reports the median. Records are plain dicts written as a JSON list::

    {"name": ..., "ours_s": ..., "baseline_s": ..., "ratio": ours_s / baseline_s,
     "peak_mem_ours": bytes, "peak_mem_baseline": bytes, "world_size": ..., "device": ...,
     "torch_version": ..., ...extra fields such as shapes}

Under a modeled link (:func:`simulated_link`), :func:`measure_under_link` times cases
against a blocking baseline and :meth:`LinkMeasurement.fields` gives the link fields every
such record carries (``link_latency_s``, ``t_link_s``, ``hidden_fraction``, ...).

Timing is never used in a pass/fail test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from hyper_parallel.dtensor.devices import BACKENDS, bind_device, process_group_backend
from hyper_parallel.dtensor.simlink import LinkStats, simulated_link

__all__ = [
    "LinkStats",
    "LinkedCase",
    "LinkMeasurement",
    "calibrate_link",
    "available_cores",
    "bench_arguments",
    "bench_record",
    "bytes_per_call",
    "interleaved_timing",
    "launched_by_torchrun",
    "link_time_split",
    "link_world",
    "max_over_ranks",
    "measure_under_link",
    "median_of_runs",
    "peak_memory_bytes",
    "run_facts",
    "run_ranks",
    "setup_torchrun_process",
    "simulated_link",
    "summary_line",
    "synchronize",
    "write_records",
]


def launched_by_torchrun() -> bool:
    """True when this process was started by torchrun (which sets TORCHELASTIC_RUN_ID)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


_BACKENDS = BACKENDS


def bench_arguments(description: str | None) -> argparse.ArgumentParser:
    """The command line every benchmark script shares (``nox -s bench`` relies on it):
    ``--out PATH`` (JSON records are appended), ``--quick`` (small shapes, under a minute)
    and ``--device cpu|cuda|npu``. Scripts add their own shape options."""
    p = argparse.ArgumentParser(description=(description or "").strip().splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file the records are appended to")
    p.add_argument("--quick", action="store_true", help="small shapes, few repeats (< 1 min)")
    p.add_argument("--device", default="cpu", choices=sorted(_BACKENDS))
    return p


def setup_torchrun_process(device: str) -> str:
    """In a torchrun worker: load torch_npu for ``"npu"``, bind this rank to its local card
    and initialise the process group with the device's backend (gloo / NCCL / HCCL).
    Returns the rank's device string (``"cuda:1"``, or ``"cpu"``)."""
    kind = torch.device(device).type
    backend = process_group_backend(kind)
    if kind != "cpu":
        device = str(bind_device(kind, int(os.environ.get("LOCAL_RANK", "0"))))
    dist.init_process_group(backend)
    return device


def run_ranks(
    body: Callable[[dict[str, Any]], list[dict[str, Any]]],
    cfg: dict[str, Any],
    *,
    world_size: int = 2,
    timeout: float = 600.0,
) -> list[dict[str, Any]] | None:
    """Run a benchmark ``body(cfg) -> records`` on every rank and return rank 0's records.

    Under torchrun the current process is one rank (``cfg["device"]`` becomes its card) and
    non-zero ranks get ``None``; started plainly, ``world_size`` local gloo ranks are spawned
    with :func:`hyper_parallel.dtensor.testing.run_distributed`."""
    if launched_by_torchrun():
        cfg = {**cfg, "device": setup_torchrun_process(str(cfg.get("device", "cpu")))}
        try:
            records = body(cfg)
            return records if dist.get_rank() == 0 else None
        finally:
            dist.destroy_process_group()
    from hyper_parallel.dtensor.testing import run_distributed

    return run_distributed(body, world_size, cfg, timeout=timeout)[0]


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for queued accelerator work (no-op on CPU)."""
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type != "cpu":
        module = getattr(torch, dev.type, None)
        if module is not None and hasattr(module, "synchronize"):
            module.synchronize()


def interleaved_timing(
    cases: dict[str, Callable[[], Any]],
    *,
    repeats: int = 7,
    warmup: int = 2,
    group: Any = None,
    device: torch.device | str | None = None,
) -> dict[str, float]:
    """Median wall seconds of each case. Each repetition runs every case once, in turn.

    When torch.distributed is initialised, ranks meet at a barrier before each case and the
    time of a case is the slowest rank's (a step is as slow as its slowest rank)."""
    distributed = dist.is_available() and dist.is_initialized()
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for rep in range(warmup + repeats):
        for name, fn in cases.items():
            if distributed:
                dist.barrier(group=group)
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            elapsed = time.perf_counter() - start
            if distributed:
                t = torch.tensor([elapsed], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
                elapsed = float(t.item())
            if rep >= warmup:
                samples[name].append(elapsed)
    return {name: statistics.median(v) for name, v in samples.items()}


class _StorageTracker(TorchDispatchMode):
    """Counts bytes of tensor storages created by torch ops while active, live at once."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._seen or storage.nbytes() == 0:
            return
        self._seen.add(key)
        nbytes = storage.nbytes()
        self.live += nbytes
        self.peak = max(self.peak, self.live)

        def _release(key: int = key, nbytes: int = nbytes) -> None:
            self._seen.discard(key)
            self.live -= nbytes

        weakref.finalize(t, _release)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for leaf in torch.utils._pytree.tree_leaves(out):
            for t in _plain_tensors(leaf):
                if not t._is_view():
                    self._track(t)
        return out


def _plain_tensors(t: Any) -> list[torch.Tensor]:
    """The storage-owning tensors behind ``t``: itself, or a wrapper subclass's (DTensor's)
    inner tensors. Temporaries made and freed inside a subclass's own dispatch are not seen."""
    if type(t) is torch.Tensor:
        return [t]
    if isinstance(t, torch.Tensor) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [p for n in names for p in _plain_tensors(getattr(t, n))]
    return []


def peak_memory_bytes(fn: Callable[[], Any], device: torch.device | str = "cpu") -> int:
    """Peak bytes of tensor memory allocated while ``fn`` runs, beyond what was alive before.

    On CUDA/NPU this is the allocator's peak; on CPU, tensor storages created by torch ops
    inside ``fn`` are tracked (memory freed by a tensor's last reference going away counts
    as freed). Collectives that write into preallocated buffers add nothing beyond those
    buffers, as on an accelerator."""
    dev = torch.device(device)
    if dev.type != "cpu":
        module = getattr(torch, dev.type)
        synchronize(dev)
        module.reset_peak_memory_stats()
        before = module.memory_allocated()
        fn()
        synchronize(dev)
        return int(module.max_memory_allocated() - before)
    tracker = _StorageTracker()
    with tracker:
        fn()
    return tracker.peak


def bench_record(
    name: str,
    ours_s: float,
    baseline_s: float,
    *,
    peak_mem_ours: int | None = None,
    peak_mem_baseline: int | None = None,
    device: str = "cpu",
    **extra: Any,
) -> dict[str, Any]:
    """One comparison as a JSON-ready dict (``ratio = ours_s / baseline_s``, < 1 is faster)."""
    return {
        "name": name,
        "ours_s": ours_s,
        "baseline_s": baseline_s,
        "ratio": ours_s / baseline_s if baseline_s > 0 else float("nan"),
        "peak_mem_ours": peak_mem_ours,
        "peak_mem_baseline": peak_mem_baseline,
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "torch_version": torch.__version__,
        "device": device,
        **extra,
    }


def summary_line(record: dict[str, Any]) -> str:
    """One human line per comparison."""
    mem = ""
    if record.get("peak_mem_ours") is not None and record.get("peak_mem_baseline") is not None:
        mem = (
            f"  peak mem {record['peak_mem_ours'] / 2**20:.1f} MiB"
            f" vs {record['peak_mem_baseline'] / 2**20:.1f} MiB"
        )
    return (
        f"{record['name']}: ours {record['ours_s'] * 1e3:.2f} ms vs baseline "
        f"{record['baseline_s'] * 1e3:.2f} ms -> ratio {record['ratio']:.3f}x{mem}"
    )


def available_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one, else
    ``os.cpu_count()``; at least 1)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def link_world(needed: int, requested: int | None = None, *, minimum: int = 2) -> int:
    """The number of local ranks a modeled-link benchmark starts: ``requested`` when given,
    else at most one rank per available core (``min(needed, cores)``), never below
    ``minimum`` (a benchmark that cannot run on fewer ranks runs oversubscribed and says so in
    its records, :func:`run_facts`)."""
    if requested is not None:
        return int(requested)
    return max(minimum, min(needed, available_cores()))


def run_facts(world: int, load: float | None = None) -> dict[str, Any]:
    """The fields every modeled-link record carries: ``world`` (ranks), ``cores_per_rank``
    (available cores / ranks), ``load`` (the 1-minute load average at the run's start, ``load``
    if given) and ``oversubscribed`` (more ranks than cores: each rank's compute, its gloo
    copies and the other ranks' work then time-share the cores)."""
    cores = available_cores()
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):
            load = None
    return {
        "world": int(world),
        "cores": cores,
        "cores_per_rank": cores / world,
        "load": load,
        "oversubscribed": world > cores,
    }


def median_of_runs(
    runs: list[list[dict[str, Any]]], key: str = "hidden_fraction"
) -> list[dict[str, Any]]:
    """Records of R repeated runs (each a list of the same record names, each run interleaving
    every case) as one list: per name, the record of the run whose ``key`` is the median (the
    lower median for an even R) with ``key`` set to the median, ``<key>_runs`` the R values in
    run order and ``runs`` = R. Records without ``key`` come from the first run (with their
    ``ours_s`` / ``baseline_s`` medians over the runs)."""
    if len(runs) == 1:
        return [{**r, "runs": 1} for r in runs[0]]
    out = []
    for i, first in enumerate(runs[0]):
        same = [run[i] for run in runs if i < len(run) and run[i]["name"] == first["name"]]
        values = [r.get(key) for r in same]
        if all(isinstance(v, int | float) for v in values):
            order = sorted(range(len(same)), key=lambda j: values[j])  # type: ignore[arg-type, return-value]
            pick = dict(same[order[(len(same) - 1) // 2]])
            pick[key] = statistics.median(values)  # type: ignore[type-var]
            pick[f"{key}_runs"] = values
        else:
            pick = dict(first)
            for k in ("ours_s", "baseline_s"):
                pick[k] = statistics.median(r[k] for r in same)
            pick["ratio"] = pick["ours_s"] / pick["baseline_s"] if pick["baseline_s"] else None
        pick["runs"] = len(same)
        out.append(pick)
    return out


def link_time_split(
    m: LinkMeasurement,
    ours: str,
    baseline: str,
    plain: dict[str, float],
    chunked: str,
    unchunked: str,
) -> dict[str, float]:
    """How the step of ``ours`` under the link splits, for a hidden fraction short of its
    target, each part a share of the baseline's modeled link time ``T_link`` (they sum to
    ``1 - hidden_fraction``): ``split_unhidden_link`` (what ours' own waits slept: the link
    its schedule did not hide), ``split_chunking_overhead`` (the plain gloo step of
    ``chunked`` less that of ``unchunked``, both from ``plain``: the cost of the extra, smaller
    operations) and ``split_copies_cpu`` (the rest: ours' step beyond the baseline's compute,
    its own sleep and the chunking overhead, mostly gloo's real copies running on the cores
    ours' compute needs). Beside them ``schedule_hidden_share`` (``1 - slept / T_link`` of
    ours' own link) and ``copies_blocking_s`` (the baseline's plain step less its compute
    when the bandwidth was calibrated: the copies' time in a blocking step)."""
    b, o = m.cases[baseline], m.cases[ours]
    compute = b.time_s - b.t_link_s  # the baseline's compute under the link (copies hidden)
    overhead = plain[chunked] - plain[unchunked]
    out = {
        "schedule_hidden_share": 1.0 - o.added_s / o.t_link_s if o.t_link_s else float("nan"),
        "split_unhidden_link": o.added_s / b.t_link_s,
        "split_chunking_overhead": overhead / b.t_link_s,
        "split_copies_cpu": (o.time_s - o.added_s - compute - overhead) / b.t_link_s,
        "split_plain_chunked_s": plain[chunked],
        "split_plain_unchunked_s": plain[unchunked],
    }
    if m.t_step_s is not None and m.t_compute_s is not None:
        out["copies_blocking_s"] = m.t_step_s - m.t_compute_s
    return out


def write_records(path: str | os.PathLike[str], records: list[dict[str, Any]]) -> None:
    """Append ``records`` to the JSON list at ``path`` (created if missing)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    existing = json.loads(p.read_text()) if p.exists() else []
    p.write_text(json.dumps(existing + list(records), indent=2) + "\n")


def max_over_ranks(value: float, group: Any = None) -> float:
    """The largest ``value`` over the ranks of ``group`` (``value`` itself without a process
    group): a step is as slow, and a link as loaded, as its slowest rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def calibrate_link(fn: Callable[[], Any], repeats: int) -> tuple[float, float, float, float]:
    """``(bytes_per_s, t_step, t_compute, bytes)`` for a blocking step ``fn``: a bandwidth under
    which ``fn``'s bytes per step take as long as its compute (the regime where overlap
    matters), with its plain step time, that compute and its bytes per step.

    On a CPU the plain step also contains gloo's real transfers, so the compute is measured as
    the step under a zero-latency link of ``bytes / t_step`` minus that link's time (every
    blocking collective then completes at its modeled time, which covers its real one); it is
    floored at a quarter of the plain step."""
    t_step = interleaved_timing({"b": fn}, repeats=repeats, warmup=1)["b"]
    nbytes = max_over_ranks(bytes_per_call(fn))
    with simulated_link(0.0, nbytes / t_step):
        t_linked = interleaved_timing({"b": fn}, repeats=max(2, repeats // 2), warmup=0)["b"]
    t_compute = max(t_linked - t_step, 0.25 * t_step)
    return nbytes / t_compute, t_step, t_compute, nbytes


def bytes_per_call(fn: Callable[[], Any]) -> int:
    """Bytes this rank moves over its link in one call of ``fn``, counted by
    :func:`simulated_link` at zero latency and unbounded bandwidth (so the call costs nothing
    extra): by ``comm.link_bytes``, ``(P-1)/P`` of a gathered / scattered / exchanged buffer,
    ``2(P-1)/P`` of an all-reduced one, the whole tensor of a send or broadcast. Every rank
    that takes part in ``fn``'s collectives must call it (take :func:`max_over_ranks` of the
    result for the busiest rank's figure)."""
    with simulated_link(0.0, 1e18) as stats:
        fn()
    return stats.bytes


@dataclass
class LinkedCase:
    """One case's figures under the modeled link, each the slowest (or busiest) rank's."""

    time_s: float
    """Median over the timed repetitions of the step's wall seconds under the link."""
    times_s: list[float]
    """Each timed repetition's wall seconds, in order: repetition ``i`` of every case of one
    measurement ran in the same round, so ``times_s[i]`` of two cases form a pair."""
    t_link_s: float
    """Modeled link seconds per step (``LinkStats.modeled_s``: Σ latency + bytes / bandwidth
    over the step's collectives)."""
    added_s: float
    """Seconds per step the step's waits slept (``LinkStats.slept_s``): what the link added to
    this case's own step, the part of its link that compute did not hide."""


@dataclass
class LinkMeasurement:
    """What :func:`measure_under_link` measured: the link, the calibration (when the bandwidth
    was calibrated on the baseline) and every case's :class:`LinkedCase`."""

    latency_s: float
    bytes_per_s: float
    cases: dict[str, LinkedCase]
    baseline: str | None = None
    repeats: int = 0
    scale: float = 1.0
    """The bandwidth as a multiple of the calibrated one (1 when not calibrated)."""
    t_step_s: float | None = None
    """The baseline's step without the link (calibration only)."""
    t_compute_s: float | None = None
    """The baseline's compute per step: its step under a link, less that link's time
    (calibration only; see :func:`calibrate_link`)."""
    bytes_per_step: float | None = None
    """The baseline's bytes over the link per step, busiest rank (calibration only)."""
    calibrated: bool = False

    def _base(self, baseline: str | None) -> str:
        base = baseline if baseline is not None else self.baseline
        if base is None:
            raise ValueError("no baseline: pass one, or measure with baseline=")
        return base

    def hidden_fraction(self, ours: str, baseline: str | None = None) -> float:
        """``(T_baseline - T_ours) / T_link_baseline`` from the median times: the share of the
        baseline's modeled link time that ours' step does not pay (1: all of it hidden, 0:
        none; negative when ours is slower)."""
        b = self.cases[self._base(baseline)]
        return (b.time_s - self.cases[ours].time_s) / b.t_link_s

    def hidden_fraction_paired(self, ours: str, baseline: str | None = None) -> float:
        """The same from each repetition's pair (the two ran in the same round), median: drift
        on a shared host hits both sides of a pair alike."""
        b = self.cases[self._base(baseline)]
        pairs = zip(b.times_s, self.cases[ours].times_s, strict=True)
        return statistics.median((tb - to) / b.t_link_s for tb, to in pairs)

    def link_over_compute(self, baseline: str | None = None) -> float:
        """``T_link / (T_baseline - T_link)`` of the baseline: the calibration's check, 1 when
        the link took as long as the blocking compute in this run too (a blocking step under
        the link is its compute + T_link)."""
        b = self.cases[self._base(baseline)]
        rest = b.time_s - b.t_link_s
        return b.t_link_s / rest if rest > 0 else float("nan")

    def fields(self, ours: str, baseline: str | None = None) -> dict[str, Any]:
        """The link fields of the record comparing ``ours`` with ``baseline`` (default: the
        measurement's): ``simulated``, ``link_latency_s``, ``link_bytes_per_s``, ``t_link_s``
        (the baseline's modeled link seconds per step), ``t_link_ours_s``,
        ``link_added_ours_s``, ``link_added_baseline_s`` (the seconds each side's waits slept
        per step), ``hidden_fraction``, ``hidden_fraction_paired``, ``link_over_compute`` and,
        when the bandwidth was calibrated, ``t_step_blocking_s``, ``t_compute_blocking_s`` and
        ``link_bytes_per_step`` (the baseline's step without the link, its compute and its
        bytes per step)."""
        base = self._base(baseline)
        b, o = self.cases[base], self.cases[ours]
        out: dict[str, Any] = {
            "simulated": True,
            "link_latency_s": self.latency_s,
            "link_bytes_per_s": self.bytes_per_s,
            "t_link_s": b.t_link_s,
            "t_link_ours_s": o.t_link_s,
            "link_added_ours_s": o.added_s,
            "link_added_baseline_s": b.added_s,
        }
        if self.calibrated:
            out["t_step_blocking_s"] = self.t_step_s
            out["t_compute_blocking_s"] = self.t_compute_s
            out["link_bytes_per_step"] = self.bytes_per_step
        out["hidden_fraction"] = self.hidden_fraction(ours, base)
        out["hidden_fraction_paired"] = self.hidden_fraction_paired(ours, base)
        out["link_over_compute"] = self.link_over_compute(base)
        return out

    def record(
        self,
        name: str,
        ours: str,
        baseline: str | None = None,
        *,
        device: str = "cpu",
        **extra: Any,
    ) -> dict[str, Any]:
        """:func:`bench_record` of ``ours`` vs ``baseline`` under the link: their median times,
        ``ours`` / ``baseline`` (the case names), :meth:`fields`, then ``extra``."""
        base = self._base(baseline)
        return bench_record(
            name,
            self.cases[ours].time_s,
            self.cases[base].time_s,
            device=device,
            **{"ours": ours, "baseline": base, **self.fields(ours, base), **extra},
        )

    def calibration_line(self) -> str:
        """One human line: the calibration (when there was one) and the link."""
        scale = f" (x{self.scale:g} the calibrated)" if self.scale != 1.0 else ""
        link = (
            f"bandwidth {self.bytes_per_s / 1e6:.1f} MB/s{scale}, "
            f"latency {self.latency_s * 1e6:.0f} us"
        )
        if not self.calibrated:
            return link
        assert self.t_step_s is not None and self.t_compute_s is not None
        assert self.bytes_per_step is not None
        return (
            f"step {self.t_step_s * 1e3:.1f} ms without the link, compute "
            f"{self.t_compute_s * 1e3:.1f} ms, {self.bytes_per_step / 2**20:.2f} MiB/step -> "
            + link
        )


def _slowest(values: list[float], device: torch.device, group: Any) -> list[float]:
    """Each value's maximum over the ranks of ``group``, in one collective (on the device for
    an accelerator's backend)."""
    if not (dist.is_available() and dist.is_initialized()) or not values:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=None if device.type == "cpu" else device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [float(v) for v in t.tolist()]


def measure_under_link(
    cases: dict[str, Callable[[], Any]],
    baseline: str | None = None,
    *,
    latency_s: float,
    repeats: int,
    device: torch.device | str | None = None,
    bandwidth: float | None = None,
    scale: float = 1.0,
    runs: int = 3,
    warmup: int = 1,
    settle: int = 2,
    group: Any = None,
) -> LinkMeasurement:
    """Every case of ``cases`` (name -> one step, e.g. a forward + backward) timed interleaved
    under a modeled link (:func:`simulated_link`) of ``latency_s`` and ``bandwidth`` bytes/s.

    Call it on every rank of ``group`` (default: the world; each rank models its own link)
    with the same cases in the same order. Bandwidth ``None``: calibrated on the ``baseline``
    case (normally the blocking schedule) with :func:`calibrate_link` (``repeats`` steps, after
    ``settle`` steps that keep a module's slow first steps out of it), so that its bytes per
    step take as long as its compute, then multiplied by ``scale`` (a bandwidth given is used
    as it is).

    Timing: ``warmup + repeats`` rounds, each running every case once in the order given,
    ranks meeting at a barrier before each step, each step under a fresh link. Per case
    (:class:`LinkedCase`): the median step time and each repetition's step time, the slowest
    rank's; the modeled link seconds and the seconds its waits slept per step, each the
    slowest rank's, median over ``runs`` steps run after the timing (``runs=0``: over the
    timed repetitions themselves). Records compare two cases with
    :meth:`LinkMeasurement.record` / :meth:`LinkMeasurement.fields`."""
    if bandwidth is None and baseline is None:
        raise ValueError("measure_under_link needs a baseline to calibrate the bandwidth on")
    if baseline is not None and baseline not in cases:
        raise ValueError(f"baseline {baseline!r} is not one of the cases {sorted(cases)}")
    if repeats < 1:
        raise ValueError(f"measure_under_link needs repeats >= 1, got {repeats}")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    distributed = dist.is_available() and dist.is_initialized()
    t_step = t_compute = nbytes = None
    if bandwidth is None:
        assert baseline is not None
        for _ in range(settle):
            cases[baseline]()
        calibrated, t_step, t_compute, nbytes = calibrate_link(cases[baseline], repeats)
        bandwidth = calibrated * scale
    bytes_per_s: float = bandwidth
    names = list(cases)
    wall: dict[str, list[float]] = {n: [] for n in names}
    modeled: dict[str, list[float]] = {n: [] for n in names}
    slept: dict[str, list[float]] = {n: [] for n in names}

    def step(name: str) -> tuple[float, LinkStats]:
        """One step of case ``name`` under a fresh link: this rank's wall seconds, the link."""
        if distributed:
            dist.barrier(group=group)
        synchronize(dev)
        start = time.perf_counter()
        with simulated_link(latency_s, bytes_per_s) as stats:
            cases[name]()
        synchronize(dev)
        return time.perf_counter() - start, stats

    for rep in range(warmup + repeats):
        for name in names:
            elapsed, stats = step(name)
            if rep >= warmup:
                wall[name].append(elapsed)
                if not runs:  # the link figures of the timed steps themselves
                    modeled[name].append(stats.modeled_s)
                    slept[name].append(stats.slept_s)
    for name in names if runs else ():
        for _ in range(runs):
            _, stats = step(name)
            modeled[name].append(stats.modeled_s)
            slept[name].append(stats.slept_s)
    # every sample reduced to the slowest rank's in one collective, then read back in order
    flat = iter(
        _slowest([v for n in names for v in (*wall[n], *modeled[n], *slept[n])], dev, group)
    )

    def take(k: int) -> list[float]:
        return [next(flat) for _ in range(k)]

    measured: dict[str, LinkedCase] = {}
    for name in names:
        times, links = take(len(wall[name])), take(len(modeled[name]))
        sleeps = take(len(slept[name]))
        measured[name] = LinkedCase(
            time_s=statistics.median(times),
            times_s=times,
            t_link_s=statistics.median(links),
            added_s=statistics.median(sleeps),
        )
    return LinkMeasurement(
        latency_s=latency_s,
        bytes_per_s=bytes_per_s,
        cases=measured,
        baseline=baseline,
        repeats=repeats,
        scale=scale if t_step is not None else 1.0,
        t_step_s=t_step,
        t_compute_s=t_compute,
        bytes_per_step=nbytes,
        calibrated=t_step is not None,
    )
