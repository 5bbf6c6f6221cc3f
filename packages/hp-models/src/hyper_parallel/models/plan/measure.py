"""What a real step holds and moves on this rank, to set beside the plan (tests, the main job).

- :func:`track_activations`: the peak bytes of the tensors created inside the block (a
  ``TorchDispatchMode`` sees every op's outputs; a storage counts from its first output until
  it is freed), gradients of parameters and FSDP2's parameter buffers set aside: the
  activations and temporaries of one forward + backward.
- :func:`count_collectives`: the bytes this rank moves over its link per collective, from
  hp-dtensor's recorder (every layer's collectives, by name), from FSDP2's own
  all-gathers, reduce-scatters and all-reduces and from torch's pipeline stages' sends
  (``p2p:pipeline``; wrapped for the block), each counted by ``comm.link_bytes``.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["ActivationTrace", "count_collectives", "held_bytes", "track_activations"]


@dataclass
class ActivationTrace:
    """``events``: ``(allocation id, +bytes | -bytes)`` in order; :meth:`peak` leaves out the
    allocations found, after the step, to be parameter gradients (or anything else given to
    :meth:`exclude_tensors`)."""

    events: list[tuple[int, int]] = field(default_factory=list)
    excluded: set[int] = field(default_factory=set)
    live: dict[int, tuple[int, int]] = field(default_factory=dict)  # address -> (id, bytes)

    def peak(self, upto: int | None = None) -> int:
        """The most bytes live at once, the excluded allocations left out; ``upto``: over the
        first ``upto`` events only (``len(trace.events)`` read at some point of the step)."""
        live = peak = 0
        for uid, delta in self.events[:upto]:
            if uid in self.excluded:
                continue
            live += delta
            peak = max(peak, live)
        return peak

    def live_bytes(self) -> int:
        """Bytes live now (nothing excluded)."""
        return sum(n for _, n in self.live.values())

    def exclude_tensors(self, tensors: list[torch.Tensor]) -> None:
        """Leave these (still live) tensors' storages out of :meth:`peak`."""
        for t in tensors:
            local = t.to_local() if hasattr(t, "to_local") else t
            entry = self.live.get(local.untyped_storage().data_ptr())
            if entry is not None:
                self.excluded.add(entry[0])


class _Tracker(TorchDispatchMode):
    def __init__(self, trace: ActivationTrace) -> None:
        super().__init__()
        self.trace = trace
        self.next_id = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # an output on an input's storage (a view, an in-place op: a parameter's ``t()`` in
        # every linear) allocated nothing: one made before the block is not an activation
        inputs = {p for p in map(_storage_ptr, tree_leaves((args, kwargs))) if p is not None}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self._see(t, inputs)
        return out

    def _see(self, t: torch.Tensor, inputs: set[int]) -> None:
        try:
            st = t.untyped_storage()
            nbytes, ptr = st.nbytes(), st.data_ptr()
        except (RuntimeError, NotImplementedError):  # a wrapper subclass without a storage
            return
        if not nbytes or ptr in self.trace.live or ptr in inputs:
            return
        self.next_id += 1
        self.trace.live[ptr] = (self.next_id, nbytes)
        self.trace.events.append((self.next_id, nbytes))
        weakref.finalize(st, self._free, ptr, self.next_id)

    def _free(self, ptr: int, uid: int) -> None:
        entry = self.trace.live.get(ptr)
        if entry is not None and entry[0] == uid:
            del self.trace.live[ptr]
            self.trace.events.append((uid, -entry[1]))


def _storage_ptr(t: Any) -> int | None:
    if not isinstance(t, torch.Tensor) or t.is_meta:
        return None
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return None


@contextlib.contextmanager
def track_activations() -> Iterator[ActivationTrace]:
    """Trace the storages created in the block; after it, ``trace.exclude_tensors(...)`` the
    parameter gradients (and anything else that is not an activation), then ``trace.peak()``.
    CPU tensors (a storage's lifetime is followed through its Python object, which torch keeps
    for as long as the storage lives)."""
    trace = ActivationTrace()
    with _Tracker(trace):
        yield trace


# ---- collectives --------------------------------------------------------------------------
# torch's function -> (our name, the byte rule's op, the argument the rule counts: position,
# keyword names)
_FSDP_OPS = {
    "all_gather_into_tensor": ("fsdp.all_gather", "all_gather", 0, ("output_tensor",)),
    "all_gather_single": ("fsdp.all_gather", "all_gather", 0, ("output", "output_tensor")),
    "reduce_scatter_tensor": ("fsdp.reduce_scatter", "reduce_scatter", 1, ("input",)),
    "reduce_scatter_single": ("fsdp.reduce_scatter", "reduce_scatter", 1, ("input",)),
    "all_reduce": ("fsdp.all_reduce", "all_reduce", 0, ("tensor",)),
}


def _from_fsdp() -> bool:
    frame = sys._getframe(2)
    return str(frame.f_globals.get("__name__", "")).startswith("torch.distributed.fsdp")


def _wrap(
    fn: Callable[..., Any],
    key: str,
    op: str,
    which: int,
    names: tuple[str, ...],
    out: dict,
    trace: ActivationTrace | None,
) -> Any:
    from hyper_parallel.dtensor.comm import link_bytes

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if _from_fsdp():
            if len(args) > which:
                t = args[which]
            else:
                t = next(kwargs[n] for n in names if n in kwargs)
            group = kwargs.get("group")
            if group is None:
                group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            size = dist.get_world_size(group)
            nbytes = link_bytes(op, t.numel() * t.element_size(), size)
            if nbytes:
                out[key] = out.get(key, 0) + nbytes
            if trace is not None:  # FSDP2's buffers: parameters and gradients, not activations
                trace.exclude_tensors(
                    [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
                )
        return fn(*args, **kwargs)

    return wrapped


def _wrap_sends(fn: Callable[..., Any], out: dict) -> Any:
    """A torch pipeline stage's ``get_fwd_send_ops`` / ``get_bwd_send_ops`` (each called once
    for every send it then launches): the bytes of its sends, as ``p2p:pipeline``."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        ops = fn(*args, **kwargs)
        for op in ops:
            if getattr(op.op, "__name__", "") == "isend":
                nbytes = op.tensor.numel() * op.tensor.element_size()
                out["p2p:pipeline"] = out.get("p2p:pipeline", 0) + nbytes
        return ops

    return wrapped


@contextlib.contextmanager
def count_collectives(trace: ActivationTrace | None = None) -> Iterator[dict[str, int]]:
    """``{collective name: bytes over this rank's link}`` for the block: hp-dtensor's
    recorder's launches by name (a layer's ``a2a:q``, ``all_gather:latent``, ...), FSDP2's
    collectives (``fsdp.all_gather``, ``fsdp.reduce_scatter``, ``fsdp.all_reduce``) and the
    hidden states and gradients torch's pipeline stages send (``p2p:pipeline``).
    ``trace``: an activation trace running in the block, told to leave out FSDP2's
    all-gathered parameters and reduce-scattered gradients."""
    from hyper_parallel.dtensor.recorder import record_events

    counts: dict[str, int] = {}
    saved = {name: getattr(dist, name) for name in _FSDP_OPS if hasattr(dist, name)}
    for name, fn in saved.items():
        setattr(dist, name, _wrap(fn, *_FSDP_OPS[name], counts, trace))
    stage_cls: Any = None
    try:
        from torch.distributed.pipelining.stage import _PipelineStageBase as stage_cls
    except ImportError:  # a torch without pipelining
        pass
    names = ("get_fwd_send_ops", "get_bwd_send_ops")
    sends: dict[str, Any] = {n: getattr(stage_cls, n) for n in names if hasattr(stage_cls, n)}
    for n, fn in sends.items():
        setattr(stage_cls, n, _wrap_sends(fn, counts))
    try:
        with record_events() as rec:
            yield counts
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
        for n, fn in sends.items():
            setattr(stage_cls, n, fn)
    for e in rec.events:
        if e.kind == "launch" and e.nbytes:
            counts[e.name] = counts.get(e.name, 0) + e.nbytes


# ---- held state ---------------------------------------------------------------------------
def _storage_bytes(tensors: list[Any]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        st = local.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def held_bytes(model: torch.nn.Module, optimizer: Any = None) -> dict[str, int]:
    """What this rank holds: ``parameters`` and ``gradients`` (the storages of their local
    tensors, each counted once: FSDP2's padded shards and reduce-scatter outputs as
    allocated) and ``optimizer`` (the local bytes of every state tensor)."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    states = 0
    if optimizer is not None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    local = value.to_local() if hasattr(value, "to_local") else value
                    states += local.numel() * local.element_size()
    return {
        "parameters": _storage_bytes(params),
        "gradients": _storage_bytes(grads),
        "optimizer": states,
    }
