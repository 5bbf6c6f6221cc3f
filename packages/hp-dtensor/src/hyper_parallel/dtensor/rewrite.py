"""Installing and undoing a parallel forward on a module: one way for every layer.

A layer rewrites a module in place by giving it a subclass of its own class whose ``forward``
is the parallel one, and keeps what the forward needs (meshes, groups, executors, options) in
one state object of its own, stored on the module under one attribute (:data:`STATE_ATTR`)
together with the module's original class. So for every layer:

- :func:`install_forward` applies the rewrite, transactionally (nothing changes if it fails),
  and refuses a module some layer already rewrote (``RuntimeError`` naming that layer);
- :func:`uninstall_forward` undoes it (the module's own class back, the state dropped; its
  Parameters were never replaced by the rewrite itself);
- :func:`parallel_state` is the layer's state of a module (what its forward reads),
  :func:`is_parallelized` whether (and by which layer) a module is rewritten;
- a deep copy of a rewritten module is rewritten too and shares the state (the copy runs on
  the same meshes and groups: groups cannot be copied).

The subclass is built once per (class, layer) and cached (``make_forward`` is called only
then), so rewriting many layers of one model makes one class.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = [
    "STATE_ATTR",
    "Rewrite",
    "install_forward",
    "is_parallelized",
    "parallel_state",
    "uninstall_forward",
]

STATE_ATTR = "_hp_parallel"
_CLASSES: dict[tuple[type, str], type] = {}


@dataclass(frozen=True, eq=False)
class Rewrite:
    """What a layer installed on a module: the layer's name, the module's own class and the
    layer's state object."""

    layer: str
    original_class: type
    state: Any

    def __deepcopy__(self, memo: dict[int, Any]) -> Rewrite:
        return self  # a deep copy of a rewritten module is rewritten too, on the same groups


def _rewrite(module: nn.Module) -> Rewrite | None:
    found = module.__dict__.get(STATE_ATTR)
    return found if isinstance(found, Rewrite) else None


def install_forward(
    module: nn.Module,
    layer: str,
    state: Any,
    make_forward: Callable[[type], Callable[..., Any]],
    *,
    prefix: str,
    members: Mapping[str, Callable[..., Any]] | None = None,
) -> nn.Module:
    """Rewrite ``module`` for ``layer``: its class becomes ``<prefix><Class>``, a subclass whose
    ``forward`` is ``make_forward(original_class)``, and ``state`` is stored with it.
    ``members``, if given, are further methods of the subclass (e.g. an ``extra_repr`` showing
    the layer's options, or a ``save_pretrained`` that must act on the rewritten module): as
    methods of the class, not attributes of the instance, a deep copy's act on the copy. They
    read what they need from the state (:func:`parallel_state`); a layer passes the same ones
    on every call (the subclass is made once per class and layer).

    ``RuntimeError`` (module untouched) if any layer already rewrote ``module``."""
    existing = _rewrite(module)
    if existing is not None:
        raise RuntimeError(
            f"{layer}: this {existing.original_class.__name__} was already parallelized by "
            f"{existing.layer}; undo that first"
        )
    original = type(module)
    key = (original, layer)
    cls = _CLASSES.get(key)
    if cls is None:
        body: dict[str, Any] = {
            **(members or {}),
            "forward": make_forward(original),
            "__module__": original.__module__,
            "__doc__": original.__doc__,
        }
        cls = type(f"{prefix}{original.__name__}", (original,), body)
    module.__dict__[STATE_ATTR] = Rewrite(layer, original, state)
    try:
        module.__class__ = cls
    except BaseException:
        del module.__dict__[STATE_ATTR]
        raise
    _CLASSES[key] = cls
    return module


def uninstall_forward(module: nn.Module, layer: str) -> Any:
    """Undo :func:`install_forward` of ``layer`` on ``module``; returns the layer's state.
    ``RuntimeError`` if ``module`` was not rewritten by ``layer``."""
    found = _rewrite(module)
    if found is None or found.layer != layer:
        by = "is not parallelized" if found is None else f"was parallelized by {found.layer}"
        raise RuntimeError(f"{layer}: module {by}")
    module.__class__ = found.original_class
    del module.__dict__[STATE_ATTR]
    return found.state


def parallel_state(module: nn.Module, layer: str) -> Any:
    """The state ``layer`` installed on ``module`` (``None`` if ``layer`` did not rewrite it)."""
    found = _rewrite(module)
    return found.state if found is not None and found.layer == layer else None


def is_parallelized(module: nn.Module, layer: str | None = None) -> bool:
    """Whether ``module`` is rewritten (by ``layer``, if given)."""
    found = _rewrite(module)
    return found is not None and (layer is None or found.layer == layer)
