"""A modeled interconnect for benchmarks: every collective completes no earlier than
``launch + latency + bytes / bandwidth``.

On a CPU machine gloo's collectives run on the same cores as the matmuls, so a schedule that
overlaps communication with compute cannot show it: there is nothing to hide behind. Under
:func:`simulated_link` each collective still runs for real (same data, same results), and its
completion is then held back to the modeled time by sleeping in the thread that waits for it,
the way a DMA engine on a real link would finish in the background:

- an async collective (``async_op=True``, ``isend``/``irecv``) returns a handle whose
  ``wait()`` sleeps only for what is left of the modeled time, so compute issued between launch
  and wait hides the link;
- a blocking collective pays the whole modeled time before returning; a blocking ``recv``
  pays it from when the real receive returned (about when the sender launched its send), so a
  chain of hops costs one modeled time per hop;
- the link carries one transfer at a time: a collective launched while earlier ones are still
  being transferred starts its ``bytes / bandwidth`` when they are done (first launched, first
  carried; latencies overlap), so chunks in flight together share the bandwidth instead of
  each getting all of it;
- torch's functional collectives (what DTensor redistribution uses) are treated as blocking,
  which is what they are in eager mode when their result is used at once.

Bytes are those this rank moves over the link, by the one rule the recorder also uses
(``comm.link_bytes``): ``(P-1)/P`` of the gathered / scattered / exchanged buffer, ``2(P-1)/P``
of an all-reduced one, the whole tensor of a send, receive or broadcast. A group of one rank
costs nothing. Nothing numerical changes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from hyper_parallel.dtensor.comm import all_to_all_v_bytes, link_bytes

__all__ = ["LinkStats", "simulated_link"]


@dataclass
class LinkStats:
    """What the link carried inside one :func:`simulated_link` block (this rank)."""

    latency_s: float
    bytes_per_s: float
    collectives: int = 0
    bytes: int = 0
    modeled_s: float = 0.0  # Σ latency + bytes / bandwidth
    slept_s: float = 0.0  # time added on top of the real collectives (not hidden by compute)
    by_op: dict[str, int] = field(default_factory=dict)

    link_free_at: float = 0.0  # perf_counter time the link finishes its queued transfers

    def cost(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bytes_per_s

    def completion(self, launch: float, nbytes: int) -> float:
        """Modeled completion of a transfer launched at ``launch``: it waits for the link to
        finish the transfers launched before it, then ``bytes / bandwidth``, then latency."""
        start = max(launch, self.link_free_at)
        self.link_free_at = start + nbytes / self.bytes_per_s
        return self.link_free_at + self.latency_s


class _LinkWork:
    """A work handle whose ``wait()`` also waits out the modeled completion time."""

    def __init__(self, work: Any, deadline: float, stats: LinkStats) -> None:
        self._work, self._deadline, self._stats = work, deadline, stats

    def wait(self, timeout: Any = None) -> bool:
        if self._work is not None:
            self._work.wait() if timeout is None else self._work.wait(timeout)
        _sleep_until(self._deadline, self._stats)
        return True

    def is_completed(self) -> bool:
        done = self._work is None or self._work.is_completed()
        return done and time.perf_counter() >= self._deadline

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _sleep_until(deadline: float, stats: LinkStats) -> None:
    left = deadline - time.perf_counter()
    if left > 0:
        time.sleep(left)
        stats.slept_s += left


def _size(group: Any) -> int:
    return dist.get_world_size(group) if group is not None else dist.get_world_size()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, name: str) -> Any:
    return args[i] if len(args) > i else kwargs.get(name)


# bytes each c10d call moves over this rank's link: (args, kwargs) -> bytes
def _gather_bytes(a: tuple[Any, ...], k: dict[str, Any]) -> int:
    p = _size(k.get("group", a[2] if len(a) > 2 else None))
    return link_bytes("all_gather", _nbytes(_arg(a, k, 0, "output_tensor")), p)


def _scatter_bytes(a: tuple[Any, ...], k: dict[str, Any]) -> int:
    p = _size(k.get("group", a[3] if len(a) > 3 else None))
    return link_bytes("reduce_scatter", _nbytes(_arg(a, k, 1, "input")), p)


def _a2a_bytes(a: tuple[Any, ...], k: dict[str, Any]) -> int:
    group = k.get("group", a[4] if len(a) > 4 else None)
    p = _size(group)
    inp, splits = _arg(a, k, 1, "input"), _arg(a, k, 3, "input_split_sizes")
    if splits and p > 1:  # uneven: the rows this rank sends to the others
        rows = inp.shape[0] if inp.dim() else 1
        row = _nbytes(inp) // rows if rows else 0
        return all_to_all_v_bytes(row, [int(n) for n in splits], dist.get_rank(group))
    return link_bytes("all_to_all", _nbytes(inp), p)


def _list_gather_bytes(a: tuple[Any, ...], k: dict[str, Any]) -> int:
    p = _size(k.get("group", a[2] if len(a) > 2 else None))
    return link_bytes("all_gather", _nbytes(_arg(a, k, 1, "tensor")) * p, p)


def _reduce_bytes(a: tuple[Any, ...], k: dict[str, Any]) -> int:
    p = _size(k.get("group", a[2] if len(a) > 2 else None))
    return link_bytes("all_reduce", _nbytes(_arg(a, k, 0, "tensor")), p)


def _whole_bytes(a: tuple[Any, ...], k: dict[str, Any]) -> int:
    p = _size(k.get("group", a[2] if len(a) > 2 else None))
    return link_bytes("send", _nbytes(_arg(a, k, 0, "tensor")), p)


_C10D: dict[str, tuple[Callable[..., int], bool]] = {
    # name: (bytes, always async)
    "all_gather_into_tensor": (_gather_bytes, False),
    "all_gather_single": (_gather_bytes, False),
    "reduce_scatter_tensor": (_scatter_bytes, False),
    "reduce_scatter_single": (_scatter_bytes, False),
    "all_to_all_single": (_a2a_bytes, False),
    "all_gather": (_list_gather_bytes, False),
    "all_reduce": (_reduce_bytes, False),
    "broadcast": (_whole_bytes, False),
    "send": (_whole_bytes, False),
    "recv": (_whole_bytes, False),
    "isend": (_whole_bytes, True),
    "irecv": (_whole_bytes, True),
}


def _wrap_c10d(name: str, original: Callable[..., Any], stats: LinkStats) -> Callable[..., Any]:
    nbytes_of, always_async = _C10D[name]

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        launch = time.perf_counter()
        nbytes = nbytes_of(args, kwargs)
        result = original(*args, **kwargs)
        if nbytes == 0:
            return result
        stats.collectives += 1
        stats.bytes += nbytes
        stats.modeled_s += stats.cost(nbytes)
        stats.by_op[name] = stats.by_op.get(name, 0) + nbytes
        deadline = stats.completion(launch, nbytes)
        if always_async or kwargs.get("async_op", False):
            return _LinkWork(result, deadline, stats)
        if name == "recv":  # the data left the sender when the real receive returned
            deadline = max(deadline, time.perf_counter() + stats.cost(nbytes))
        _sleep_until(deadline, stats)
        return result

    return wrapped


def _funcol_group_size(group: Any) -> int:
    if isinstance(group, tuple):  # (DeviceMesh, mesh dim)
        return int(group[0].size(group[1]))
    try:
        resolved: Any = funcol._resolve_group(group)  # type: ignore[attr-defined]
        if isinstance(resolved, str):  # a group name
            from torch.distributed.distributed_c10d import _resolve_process_group

            resolved = _resolve_process_group(resolved)  # type: ignore[arg-type]
        return dist.get_world_size(resolved)
    except Exception:  # a rank list or a tag: count it
        return len(group) if isinstance(group, (list, tuple)) else dist.get_world_size()


def _wrap_funcol(name: str, original: Callable[..., Any], stats: LinkStats) -> Callable[..., Any]:
    def wrapped(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        launch = time.perf_counter()
        out = original(tensor, *args, **kwargs)
        out = funcol.wait_tensor(out)
        if name == "all_gather_single":
            p = max(1, out.numel() // max(1, tensor.numel()))
            nbytes = link_bytes("all_gather", _nbytes(out), p)
        elif name == "reduce_scatter_single":
            p = max(1, tensor.numel() // max(1, out.numel()))
            nbytes = link_bytes("reduce_scatter", _nbytes(tensor), p)
        else:  # all_reduce(self, reduceOp, group)
            group = args[1] if len(args) > 1 else kwargs.get("group")
            p = _funcol_group_size(group)
            nbytes = link_bytes("all_reduce", _nbytes(tensor), p)
        if nbytes:
            stats.collectives += 1
            stats.bytes += nbytes
            stats.modeled_s += stats.cost(nbytes)
            stats.by_op["funcol." + name] = stats.by_op.get("funcol." + name, 0) + nbytes
            _sleep_until(stats.completion(launch, nbytes), stats)
        return out

    return wrapped


_FUNCOL = ("all_gather_single", "reduce_scatter_single", "all_reduce")


@contextlib.contextmanager
def simulated_link(latency_s: float, bytes_per_s: float) -> Iterator[LinkStats]:
    """Inside the block, every collective of this process completes no earlier than
    ``launch + latency_s + bytes / bytes_per_s`` (see the module docstring); yields the
    :class:`LinkStats` it fills. Every rank must enter it (each models its own link).
    ``ValueError`` for a negative latency or a non-positive bandwidth."""
    if latency_s < 0 or bytes_per_s <= 0:
        raise ValueError(
            f"simulated_link needs latency_s >= 0 and bytes_per_s > 0, got {latency_s}, "
            f"{bytes_per_s}"
        )
    stats = LinkStats(latency_s, bytes_per_s)
    saved: list[tuple[Any, str, Any]] = []
    try:
        for name in _C10D:
            if hasattr(dist, name):
                saved.append((dist, name, getattr(dist, name)))
                setattr(dist, name, _wrap_c10d(name, getattr(dist, name), stats))
        for name in _FUNCOL:
            if hasattr(funcol, name):
                saved.append((funcol, name, getattr(funcol, name)))
                setattr(funcol, name, _wrap_funcol(name, getattr(funcol, name), stats))
        yield stats
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)
