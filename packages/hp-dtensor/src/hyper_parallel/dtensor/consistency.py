"""Rank-consistency checks: catch ranks that disagree before they hang or corrupt data.

A collective given different shapes on different ranks hangs (gloo) or silently mixes data
(NCCL, HCCL). With the check on, each layer's entry point calls :func:`check_consistent` with
a small signature of its call (shapes, dtypes, the chosen backend, chunk count or protocol);
two small all-gathers (lengths, then the JSON bytes) compare them, and every rank raises the same
:class:`InconsistentRanksError` naming the field and which ranks hold which value.

Off by default (it costs one small collective per call). Turn it on for a whole process with
``HP_CHECK_CONSISTENCY=1``, or for a block with ``with consistency_checks(): ...``.

A layer declares the check once per public entry point with :func:`checked_entry`, naming
the arguments to compare: the decorator binds the call's arguments by name, builds the signature
lazily (only with the checks on) without ever raising (a field that cannot be read is compared
as ``"<ExceptionName>"``), compares it before the entry point's body runs (so before its first
collective), and runs the body with the checks of nested entry points and helpers turned off
(:func:`check_consistent` returns at once inside a checked call): the outermost entry point's
signature covers what its callees would have compared.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import SimpleNamespace
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

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
    _compare(group, what, {name: signature(value) for name, value in fields.items()})


def _compare(group: Any, what: str, mine: dict[str, str]) -> None:
    """Compare this rank's field signatures with the other ranks' of ``group``."""
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


def _read(fn: Callable[..., Any], *args: Any) -> str:
    """The :func:`signature` of ``fn(*args)``, or ``"<ExceptionName>"`` of what it raised (the
    never-raise guard: a rank whose argument cannot be read then differs from the others,
    which all raise :class:`InconsistentRanksError` with it, instead of raising alone while
    they wait; ranks that all fail alike agree, and the body raises the real error on each)."""
    try:
        return signature(fn(*args))
    except Exception as exc:  # any failure becomes a compared value
        return f"<{type(exc).__name__}>"


_NO_GROUP = object()  # a group that cannot be resolved: nothing is compared

_GroupSpec = str | Callable[[Any], Any] | None
_Extra = Mapping[str, Callable[[Any], Any]] | Callable[[Any], Mapping[str, Any] | None] | None


def _resolve_group(spec: _GroupSpec, args: SimpleNamespace) -> Any:
    """The process group ``spec`` names for this call: an argument's name or a function of the
    arguments, whose value is a process group, a 1-D mesh (its group) or ``None`` (the default
    group); anything else (an n-D mesh, another type, a function that raises) is
    :data:`_NO_GROUP`, for a call the body rejects."""
    try:
        if spec is None:
            return None
        value = getattr(args, spec) if isinstance(spec, str) else spec(args)
        if isinstance(value, DeviceMesh):
            return value.get_group(0) if value.ndim == 1 else _NO_GROUP
    except Exception:
        return _NO_GROUP
    return value if value is None or isinstance(value, dist.ProcessGroup) else _NO_GROUP


def _declared_fields(
    sig: inspect.Signature,
    compare: tuple[str, ...],
    group: _GroupSpec,
    extra: _Extra,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[Any, dict[str, str]] | None:
    """``(group, {name: signature})`` of one call in the declarative form, ``None`` for nothing
    to compare. Never raises."""
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError:  # the call itself raises it, before anything else
        return None
    bound.apply_defaults()
    named = SimpleNamespace(**bound.arguments)
    pg = _resolve_group(group, named)
    if pg is _NO_GROUP:
        return None
    mine = {name: _read(getattr, named, name) for name in compare}
    if isinstance(extra, Mapping):
        mine.update({name: _read(read, named) for name, read in extra.items()})
    elif extra is not None:
        try:
            more = extra(named)
        except Exception as exc:  # compared as such on this rank
            mine["<extra>"] = f"<{type(exc).__name__}>"
        else:
            if more is None:
                return None
            mine.update({name: _read(lambda v: v, value) for name, value in more.items()})
    return pg, mine


def checked_entry(
    what: str,
    fields: Callable[..., tuple[Any, Mapping[str, Any]] | None] | None = None,
    *,
    compare: Iterable[str] = (),
    group: _GroupSpec = None,
    extra: _Extra = None,
) -> Callable[[_F], _F]:
    """Declare an entry point's consistency check once, as a decorator.

    With the checks on (and outside another checked call), the call's arguments are bound by
    name (``inspect.signature(fn).bind``, defaults applied) and compared over a group before the
    body runs; the body runs with nested checks off. With the checks off nothing is built and
    the decorated function costs one flag read more.

    - ``compare``: the names of the arguments compared (each by :func:`signature`: a tensor by
      shape, dtype and device type).
    - ``group``: where to compare: the name of the argument holding it, or a function of the
      arguments returning it; a process group, a 1-D mesh (its group) or ``None`` (the default
      group, also when ``group`` is not given). Nothing is compared where it is anything else
      (an n-D mesh, another type) or the function raises: a call the body rejects.
    - ``extra``: computed fields, ``{name: function of the arguments}``, or one function of
      the arguments returning ``{name: value}`` (or ``None``: this call communicates nothing,
      compare nothing).

    The functions receive the arguments as one namespace (``args.x``, ``args.self``; ``*args``
    and ``**kwargs`` under their own names). Nothing they do can make one rank raise alone: a
    field (or the whole ``extra`` function) that raises is compared as ``"<ExceptionName>"``,
    so that rank differs from the others and every rank raises :class:`InconsistentRanksError`
    (ranks that all fail alike agree, and the body then raises the real error on each). They
    should only read (shapes, dtypes, options), not validate. Example::

        @checked_entry("my_gather", compare=("x", "dim"), group="mesh",
                       extra={"mesh_size": lambda args: args.mesh.size()})
        def my_gather(x, mesh, dim=0): ...

    The earlier form ``checked_entry(what, fields)`` still works: ``fields(*args, **kwargs)``
    returns ``(group, {name: value})`` or ``None`` (nothing to compare); it runs unguarded, so
    it must not raise.
    """
    names = tuple(compare)
    declarative = bool(names) or group is not None or extra is not None
    if fields is not None and declarative:
        raise TypeError(f"checked_entry({what!r}): give fields, or compare/group/extra, not both")
    if fields is None and not (names or extra is not None):
        raise TypeError(f"checked_entry({what!r}): nothing to compare (compare= or extra=)")

    def decorate(fn: _F) -> _F:
        build: Callable[[tuple[Any, ...], dict[str, Any]], tuple[Any, Any] | None]
        if fields is None:
            sig = inspect.signature(fn)
            wanted = (*names, *((group,) if isinstance(group, str) else ()))
            unknown = [name for name in wanted if name not in sig.parameters]
            if unknown:
                raise TypeError(
                    f"checked_entry({what!r}): {getattr(fn, '__qualname__', fn)} has no "
                    f"argument {', '.join(map(repr, unknown))}"
                )

            def build(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
                if not dist.is_initialized():
                    return None
                return _declared_fields(sig, names, group, extra, args, kwargs)

            compare_fn: Callable[[Any, str, Any], None] = _compare
        else:
            legacy = fields

            def build(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
                return legacy(*args, **kwargs)

            def compare_fn(pg: Any, name: str, values: Any) -> None:
                check_consistent(pg, name, **values)

        @functools.wraps(fn)
        def entry(*args: Any, **kwargs: Any) -> Any:
            if not consistency_enabled() or _inside_checked.get():
                return fn(*args, **kwargs)
            declared = build(args, kwargs)
            if declared is not None:
                compare_fn(declared[0], what, declared[1])
            token = _inside_checked.set(True)
            try:
                return fn(*args, **kwargs)
            finally:
                _inside_checked.reset(token)

        return entry  # type: ignore[return-value]

    return decorate
