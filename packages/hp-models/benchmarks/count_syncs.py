"""Collectives and host reads per forward (and backward) of a whole hp-models Kimi-Linear step.

``tiny_model("kimi")`` (KDA, MLA, KDA, MLA; dense MLPs and one MoE block; float64) under
``parallelize_model`` on (cp, tp) = (2, 2) (4 gloo ranks on CPU, ``grad_reduction=
"allreduce"``, consistency mode off), one row of T = 16 tokens, labels given, one forward
(``model(**shard_batch(batch, mesh))``) and its backward (``out.loss.backward()``; no
``sync_gradients``): once with one document per row, once packed (documents ``[0, 3, 4, 8,
9, 16]`` from ``position_ids``, as in ``tests/test_models_documents.py``), and packed
without labels (no loss: the backward of the sum of this rank's logits).

What is counted, on every rank (rank 0's in detail, then every rank's totals):

- **collectives**: every c10d call (``torch.distributed``'s collective and point-to-point
  functions, patched for the run), by function; and every collective a layer starts through
  hp-dtensor's ``comm`` by its name (``all_gather:block_lengths``, ``a2a:q``, ...; hp-dtensor's
  ``recorder.record_events``).
- **host syncs**, emulating a run on an accelerator (``torch.cuda.set_sync_debug_mode`` is
  CUDA-only, and one GPU cannot hold four NCCL ranks): a ``TorchFunctionMode`` follows where
  every tensor would live. The model's parameters and the block from ``shard_batch`` (moved to
  the device in a GPU job) are *device* tensors; inside the step, a factory call without a
  ``device`` argument (``torch.tensor(list)``, ``torch.zeros(n)``, a mesh's rank tensor) makes
  a *host* tensor, one with a ``device`` argument a device tensor, and an op's result lives on
  the device when any of its tensor inputs does. Counted, by the calling function (the
  innermost frame in ``hyper_parallel`` or ``transformers``):

  - **D2H reads**: a device tensor's values brought to Python (``item``, ``tolist``,
    ``bool``/``int``/``float``/``index``, ``cpu``, ``numpy``, ``torch.equal``, ``nonzero``,
    ``unique``, ``masked_select``, boolean-mask indexing): each a device-to-host sync;
  - **H2D copies**: a host tensor copied to the device (``.to(device)``, or ``torch.tensor``
    / ``as_tensor`` of Python values with a ``device``): on CUDA a blocking copy from pageable
    memory waits for the stream (``non_blocking=True`` ones are counted apart).

  Reading a host tensor (a mesh's ranks, a table built on the host) costs no sync and is not
  counted. ``int(x)`` on each element of a device tensor counts once per element.

    python packages/hp-models/benchmarks/count_syncs.py [--markdown]
"""

from __future__ import annotations

import collections
import functools
import sys
import traceback
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from hyper_parallel.dtensor import init_device_mesh, unflatten
from hyper_parallel.dtensor.recorder import record_events
from hyper_parallel.dtensor.testing import run_distributed

SEQ = 16
CASES = ("plain", "packed", "packed, no labels")
OFFSETS = [0, 3, 4, 8, 9, 16]
_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy",
          "equal", "nonzero", "unique", "masked_select"}  # fmt: skip
_C10D = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
         "_all_gather_base", "reduce_scatter_tensor", "reduce_scatter_single",
         "all_to_all_single", "all_to_all", "broadcast", "send", "recv", "isend", "irecv",
         "batch_isend_irecv", "barrier")  # fmt: skip


def _site() -> str:
    """The innermost caller in hyper_parallel or transformers: ``package.module:function``."""
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename.replace("\\", "/")
        for root in ("hyper_parallel/", "transformers/"):
            if root in path and "benchmarks/" not in path:
                mod = path.split(root, 1)[1].removesuffix(".py").replace("/", ".")
                return f"{root.rstrip('/')}.{mod}:{frame.name}"
    return "other"


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


class HostSyncs(TorchFunctionMode):
    """Follows where each tensor would live on an accelerator (see the module docstring) and
    counts the device-to-host reads and host-to-device copies, by kind and call site.
    ``device``: the tensors on the device when the step starts (parameters, the block)."""

    def __init__(self, device: list[torch.Tensor]) -> None:
        super().__init__()
        self.counts: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self._device: dict[int, Any] = {}  # id -> weakref of the device tensors
        self._mark(device)

    def _on_device(self, t: torch.Tensor) -> bool:
        ref = self._device.get(id(t))
        return ref is not None and ref() is t

    def _mark(self, out: Any) -> None:
        for t in _tensors(out):
            key = id(t)
            self._device[key] = weakref.ref(t, lambda _, k=key: self._device.pop(k, None))

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        ins = _tensors(args) + _tensors(kwargs)
        on_device = any(self._on_device(t) for t in ins)
        target = kwargs.get("device")
        if name in ("to", "cuda") and target is None:
            dev = [a for a in args[1:] if isinstance(a, (str, torch.device, torch.Tensor))]
            target = dev[0] if dev else ("cuda" if name == "cuda" else None)
        out = func(*args, **kwargs)
        if name in ("to", "cuda") and ins and not self._on_device(ins[0]) and target is not None:
            kind = "H2D (non_blocking)" if kwargs.get("non_blocking") else "H2D"
            self.counts[("h2d", kind, _site())] += 1
            self._mark(out)
            return out
        if not ins:  # a factory: on the device when given one
            if target is not None:
                if name in ("tensor", "as_tensor"):  # Python values copied to the device
                    self.counts[("h2d", "H2D", _site())] += 1
                self._mark(out)
            return out
        read = name in _READS
        if name == "__getitem__" and len(args) > 1:  # boolean-mask indexing
            idx = args[1]
            read = isinstance(idx, torch.Tensor) and idx.dtype == torch.bool
        if read and isinstance(args[0], torch.Tensor) and self._on_device(args[0]):
            self.counts[("d2h", name, _site())] += 1
        if on_device and name != "cpu":
            self._mark(out)
        return out


class C10dCalls:
    """Counts the torch.distributed calls made while active, by function."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.saved: dict[str, Any] = {}

    def __enter__(self) -> C10dCalls:
        for name in _C10D:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self.saved[name] = fn

            def wrapped(*args: Any, _n: str = name, _f: Any = fn, **kwargs: Any) -> Any:
                self.counts[_n] += 1
                return _f(*args, **kwargs)

            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def _batch(packed: bool) -> dict[str, torch.Tensor]:
    from hyper_parallel.models import IGNORE_INDEX

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 48, (1, SEQ), generator=g)
    labels = ids.clone()
    batch = {"input_ids": ids, "labels": labels}
    if packed:
        pos = torch.cat([torch.arange(b - a) for a, b in zip(OFFSETS, OFFSETS[1:])])[None]
        labels[0, OFFSETS[:-1]] = IGNORE_INDEX
        batch["position_ids"] = pos
    return batch


def _phase(run: Any, device: list[torch.Tensor]) -> dict[str, Any]:
    syncs, calls = HostSyncs(device), C10dCalls()
    with record_events() as rec, calls, syncs:
        out = run()
    named = collections.Counter(rec.names("launch"))
    return {"out": out, "syncs": dict(syncs.counts), "c10d": dict(calls.counts),
            "named": dict(named)}  # fmt: skip


def _count() -> dict[str, Any]:
    from hyper_parallel.models import parallelize_model, shard_batch
    from hyper_parallel.models.testing import tiny_model

    world = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("world",))
    mesh = unflatten(world, "world", (2, 2), ("cp", "tp"))
    res: dict[str, Any] = {}
    for case in CASES:
        packed = case != "plain"
        model = parallelize_model(tiny_model("kimi"), mesh, grad_reduction="allreduce")
        local = shard_batch(_batch(packed), mesh)
        if case == "packed, no labels":
            local = {k: v for k, v in local.items() if k not in ("labels", "shift_labels")}
        _loss(model(**local)).backward()  # warm-up: lazy state, first-call paths
        model.zero_grad()
        device = [*model.parameters(), *model.buffers(), *local.values()]
        fwd = _phase(functools.partial(model, **local), device)
        loss = _loss(fwd.pop("out"))
        bwd = _phase(loss.backward, [*device, loss])
        bwd.pop("out")
        res[case] = {"forward": fwd, "backward": bwd}
    return res


def _loss(out: Any) -> torch.Tensor:
    """The model's loss, or (no labels) the sum of this rank's logits."""
    return out.loss if out.loss is not None else out.logits.sum()


def _total(d: dict[Any, int], kind: str | None = None) -> int:
    return sum(n for k, n in d.items() if kind is None or k[0] == kind)


def _per_rank(results: list[dict[str, Any]], case: str, phase: str, what: str, kind: Any) -> str:
    return "/".join(str(_total(r[case][phase][what], kind)) for r in results)


def report(results: list[dict[str, Any]], markdown: bool = False) -> str:
    """Rank 0's counts in detail, then (``markdown``) every rank's totals as a table."""
    lines = []
    for case in CASES:
        for phase in ("forward", "backward"):
            r0 = results[0][case][phase]
            lines.append(
                f"## {case} {phase} (rank 0): {_total(r0['c10d'])} c10d calls, "
                f"{_total(r0['syncs'], 'd2h')} D2H reads, {_total(r0['syncs'], 'h2d')} H2D copies"
            )
            lines.append("  c10d: " + ", ".join(f"{k} {v}" for k, v in sorted(r0["c10d"].items())))
            lines.append(
                "  named: " + ", ".join(f"{k} {v}" for k, v in sorted(r0["named"].items()))
            )
            for (kind, how, site), n in sorted(r0["syncs"].items()):
                lines.append(f"  {kind} {n:3d}  {site} ({how})")
    if markdown:
        lines += [
            "",
            "| case | phase | c10d calls | D2H reads | H2D copies |",
            "|---|---|---|---|---|",
        ]
        for case in CASES:
            for phase in ("forward", "backward"):
                cells = [
                    _per_rank(results, case, phase, "c10d", None),
                    _per_rank(results, case, phase, "syncs", "d2h"),
                    _per_rank(results, case, phase, "syncs", "h2d"),
                ]
                lines.append(f"| {case} | {phase} | " + " | ".join(cells) + " |")
        lines.append("")
        lines.append("(ranks 0/1/2/3)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    results = run_distributed(_count, 4, timeout=900)
    print(report(results, markdown="--markdown" in argv))


if __name__ == "__main__":
    main()
