"""Per-layer time and communication of the main job (a dispatch mode plus module hooks).

``LayerMeter(layers)`` times each named layer's forward and backward and counts the bytes this
rank moves over its link in every ``torch.distributed`` collective (hp-dtensor's
``comm.link_bytes``, the rule the recorder and the modeled link use), attributed to the layer
running; ``meter.recorder`` (hp-dtensor's ``EventRecorder``) also gets the layer spans for the
trace of the recorded step.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hyper_parallel.dtensor.comm import link_bytes


class _Stamp(torch.autograd.Function):
    """Identity that calls ``hook`` when its gradient passes (marks a layer's backward)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, hook: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.hook = hook
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.hook()
        return grad, None


class LayerMeter(TorchDispatchMode):
    """Per-layer forward/backward wall time (every step) and the bytes this rank's collectives
    move over its link (while the dispatch mode is on), attributed to the layer running.

    Bytes by ``comm.link_bytes``: ``(P-1)/P`` of the gathered, scattered or exchanged buffer,
    ``2(P-1)/P`` of an all-reduced one, the tensor of a send, receive or broadcast."""

    def __init__(self, layers: list[tuple[str, torch.nn.Module]]) -> None:
        super().__init__()
        self.names: list[str] = []
        self.time: dict[tuple[str, str], float] = {}
        self.bytes: dict[str, int] = {}
        self.current = "other"
        self.recorder: Any = None
        self._t: dict[tuple[str, str], float] = {}
        for name, layer in layers:
            self.names.append(name)
            layer.register_forward_pre_hook(self._pre(name), with_kwargs=True)
            layer.register_forward_hook(self._post(name))

    def _mark(self, name: str, phase: str, begin: bool) -> None:
        now = time.perf_counter()
        if begin:
            self._t[(name, phase)] = now
            self.current = name
        else:
            key = (name, phase)
            self.time[key] = self.time.get(key, 0.0) + now - self._t.pop(key, now)
            self.current = "other"
        if self.recorder is not None:
            self.recorder.add("begin" if begin else "end", f"layer {name}", phase)

    def _pre(self, name: str) -> Any:
        # Hugging Face calls its attention modules with keyword arguments only
        def hook(_m: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            self._mark(name, "forward", True)
            done = lambda: self._mark(name, "backward", False)  # noqa: E731
            if args:
                return (_Stamp.apply(args[0], done), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": _Stamp.apply(kwargs["hidden_states"], done)}

        return hook

    def _post(self, name: str) -> Any:
        def hook(_m: Any, _a: Any, out: Any) -> Any:
            self._mark(name, "forward", False)
            start = lambda: self._mark(name, "backward", True)  # noqa: E731
            if isinstance(out, tuple):  # attention modules return (output, weights)
                return (_Stamp.apply(out[0], start), *out[1:])
            return _Stamp.apply(out, start)

        return hook

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if name.startswith("c10d."):
            n = _link_bytes(name, args)
            if n:
                self.bytes[self.current] = self.bytes.get(self.current, 0) + n
        return out


def _link_bytes(op: str, args: Any) -> int:
    pg = None
    for a in args:  # the process group arrives as a TorchScript object
        if type(a).__name__ == "ScriptObject":
            try:
                pg = torch._C._distributed_c10d.ProcessGroup.unbox(a)
                break
            except Exception:
                continue
    ws = pg.size() if pg is not None else 1

    def nbytes(t: Any) -> int:
        if isinstance(t, torch.Tensor):
            return t.numel() * t.element_size()
        return sum(nbytes(x) for x in t) if isinstance(t, list | tuple) else 0

    # c10d op -> (the byte rule's collective, the argument holding its buffer)
    for key, kind, arg in (
        ("_allgather_base_", "all_gather", 0),
        ("_reduce_scatter_base_", "reduce_scatter", 1),
        ("alltoall", "all_to_all", 0),
        ("allgather_", "all_gather", 0),
        ("reduce_scatter_", "reduce_scatter", 1),
        ("allreduce_", "all_reduce", 0),
        ("broadcast_", "broadcast", 0),
        ("recv_", "recv", 0),
        ("send", "send", 0),
    ):
        if key in op:
            return link_bytes(kind, nbytes(args[arg]), ws)
    return 0
