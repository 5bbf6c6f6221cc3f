"""Shared benchmark plumbing: interleaved timing, peak memory, JSON records.

Every package's benchmark compares "ours" with the baseline a user would otherwise pick, in
one run, interleaved (each repetition runs every case once, in turn, so drift and noise hit
all cases alike), and reports the median. Records are plain dicts written as a JSON list::

    {"name": ..., "ours_s": ..., "baseline_s": ..., "ratio": ours_s / baseline_s,
     "peak_mem_ours": bytes, "peak_mem_baseline": bytes, "world_size": ..., "device": ...,
     "torch_version": ..., ...extra fields such as shapes}

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
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from hyper_parallel.dtensor.devices import BACKENDS, bind_device, process_group_backend
from hyper_parallel.dtensor.simlink import LinkStats, simulated_link

__all__ = [
    "LinkStats",
    "calibrate_link",
    "bench_arguments",
    "bench_record",
    "interleaved_timing",
    "launched_by_torchrun",
    "max_over_ranks",
    "peak_memory_bytes",
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
    with simulated_link(0.0, 1e18) as count:
        fn()
    nbytes = max_over_ranks(count.bytes)
    with simulated_link(0.0, nbytes / t_step):
        t_linked = interleaved_timing({"b": fn}, repeats=max(2, repeats // 2), warmup=0)["b"]
    t_compute = max(t_linked - t_step, 0.25 * t_step)
    return nbytes / t_compute, t_step, t_compute, nbytes
