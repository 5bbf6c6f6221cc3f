"""Rank-consistency checks: catch ranks that disagree before they hang or corrupt data.

A collective given different shapes on different ranks hangs (gloo) or silently mixes data
(NCCL, HCCL). With the check on, each layer's entry point calls :func:`check_consistent` with
a small signature of its call (shapes, dtypes, the chosen backend, chunk count or protocol);
two small all-gathers (lengths, then the JSON bytes) compare them, and every rank raises the same
:class:`InconsistentRanksError` naming the field and which ranks hold which value.

Off by default (it costs one small collective per call). Turn it on for a whole process with
``HP_CHECK_CONSISTENCY=1``, or for a block with ``with consistency_checks(): ...``.

A layer declares the check once per public entry point with :func:`checked_entry`: the
decorator builds the signature lazily (only with the checks on), compares it before the entry
point's body runs (so before its first collective), and runs the body with the checks of nested
entry points and helpers turned off (:func:`check_consistent` returns at once inside a checked
call): the outermost entry point's signature covers what its callees would have compared.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist

__all__ = [
    "InconsistentRanksError",
    "check_consistent",
    "checked_entry",
    "consistency_checks",
    "consistency_enabled",
    "signature",
]

_ENV = "HP_CHECK_CONSISTENCY"
_override: bool | None = None
_inside_checked = contextvars.ContextVar("hp_inside_checked_entry", default=False)
_F = TypeVar("_F", bound=Callable[..., Any])


class InconsistentRanksError(ValueError):
    """The ranks of one call disagree. ``field`` names the first differing field and
    ``values`` maps each distinct value to the group ranks holding it."""

    def __init__(self, what: str, field: str, values: dict[str, list[int]]) -> None:
        self.field, self.values = field, values
        parts = "; ".join(f"ranks {ranks}: {value}" for value, ranks in values.items())
        super().__init__(f"{what}: ranks disagree on {field!r} ({parts})")


def consistency_enabled() -> bool:
    """Whether :func:`check_consistent` communicates (the context manager wins over the
    environment variable)."""
    if _override is not None:
        return _override
    return os.environ.get(_ENV, "").strip() not in ("", "0", "false", "False")


@contextlib.contextmanager
def consistency_checks(enabled: bool = True) -> Iterator[None]:
    """Turn the checks on (or off) inside the ``with`` block, whatever ``HP_CHECK_CONSISTENCY``
    says. Every rank must enter the same blocks."""
    global _override
    old, _override = _override, enabled
    try:
        yield
    finally:
        _override = old


def signature(value: Any) -> str:
    """A short, comparable description of one argument: a tensor's shape, dtype and device
    type (not its data); other values' ``repr``."""
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        return f"{type(value).__name__}{list(value.shape)}:{dtype}:{value.device.type}"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(signature(v) for v in value) + ")"
    return repr(value)


def _device_of(group: Any) -> torch.device:
    """Where this group's collectives take their tensors (CPU for gloo, the current card for
    NCCL/HCCL)."""
    try:
        from torch.distributed.distributed_c10d import _get_object_coll_device

        return torch.device(_get_object_coll_device(group))
    except Exception:  # older torch: gloo groups are the ones without a device of their own
        return torch.device("cpu")


def _gather_signatures(mine: dict[str, str], group: Any, size: int) -> list[dict[str, str]]:
    """Every rank's signature, in group-rank order: JSON bytes in a padded uint8 tensor (torch's
    ``all_gather_object`` needs NumPy, which hp-dtensor does not depend on)."""
    device = _device_of(group)
    payload = torch.tensor(list(json.dumps(mine).encode()), dtype=torch.uint8, device=device)
    length = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(size)]
    dist.all_gather(lengths, length, group=group)
    longest = max(int(n.item()) for n in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    blobs = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(blobs, padded, group=group)
    return [
        json.loads(bytes(blob[: int(n.item())].tolist()).decode())
        for blob, n in zip(blobs, lengths)
    ]


def check_consistent(group: Any, what: str, **fields: Any) -> None:
    """With the checks on: every rank of ``group`` must pass equal :func:`signature` s for each
    field, else every rank raises :class:`InconsistentRanksError` (``what`` names the call, e.g.
    ``"parallelize_kda"``). With the checks off, or inside a call already checked by
    :func:`checked_entry`, returns at once without communicating."""
    if not consistency_enabled() or _inside_checked.get() or not dist.is_initialized():
        return
    mine = {name: signature(value) for name, value in fields.items()}
    size = dist.get_world_size(group)
    if size == 1:
        return
    every = _gather_signatures(mine, group, size)
    names = sorted({name for sig in every for name in sig}, key=lambda n: (n not in mine, n))
    for name in names:
        values: dict[str, list[int]] = {}
        for rank, sig in enumerate(every):
            values.setdefault(str(sig.get(name, "<missing>")), []).append(rank)
        if len(values) > 1:
            raise InconsistentRanksError(what, name, values)


def checked_entry(
    what: str, fields: Callable[..., tuple[Any, Mapping[str, Any]] | None]
) -> Callable[[_F], _F]:
    """Declare an entry point's consistency check once, as a decorator.

    With the checks on (and outside another checked call), ``fields(*args, **kwargs)`` (the
    decorated function's own arguments) returns ``(group, {name: value})`` (``group``: a
    process group, or ``None`` for the default one) or ``None`` when there is nothing to
    compare; :func:`check_consistent` compares them over ``group`` before the body runs, and
    the body runs with nested checks off. ``fields`` should only read its arguments (shapes,
    dtypes, options), not validate them: an error it raises on one rank only would leave the
    others waiting in the comparison. With the checks off, ``fields`` is never called and the
    decorated function costs one flag read more.

    Example::

        @checked_entry("my_gather", lambda x, mesh: (mesh.get_group(), {"x": x}))
        def my_gather(x, mesh): ...
    """

    def decorate(fn: _F) -> _F:
        @functools.wraps(fn)
        def entry(*args: Any, **kwargs: Any) -> Any:
            if not consistency_enabled() or _inside_checked.get():
                return fn(*args, **kwargs)
            declared = fields(*args, **kwargs)
            if declared is not None:
                group, values = declared
                check_consistent(group, what, **values)
            token = _inside_checked.set(True)
            try:
                return fn(*args, **kwargs)
            finally:
                _inside_checked.reset(token)

        return entry  # type: ignore[return-value]

    return decorate
