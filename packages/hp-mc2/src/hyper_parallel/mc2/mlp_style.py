"""``MC2MLPParallel``: the ``ParallelStyle`` for plain MLP modules (``down(act(up(x)))``:
Hugging Face ``CLIPMLP``/``PhiMLP`` (``fc1``/``fc2`` + ``activation_fn``), ``FalconMLP``/
``GPTNeoXMLP`` (``dense_h_to_4h``/``dense_4h_to_h`` + ``act``), modules with ``up_proj``/
``down_proj`` + ``act_fn`` or nn.Linear ``c_fc``/``c_proj`` + ``act``, and any module with
an up ``nn.Linear``, a per-element activation and a down ``nn.Linear``, named explicitly).

Applied with torch's ``parallelize_module(mlp, tp_mesh, MC2MLPParallel())``: the weights
become DTensors (up ``Shard(0)``, its bias ``Shard(0)``, down ``Shard(1)``, its bias
``Replicate()``) and the module's forward runs :func:`~hyper_parallel.mc2.mlp_block` (one
pipeline over row chunks, forward and backward) on this rank's sequence block. The module
keeps its class, children and parameter names; the parameters are new DTensor ``Parameter``
objects, as with torch's own styles.

It is the block style (:class:`~hyper_parallel.mc2._block_style.BlockStyle`) with one input
projection, up; the children and the activation are named or found among :data:`LAYOUTS`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from hyper_parallel.dtensor.consistency import checked_entry
from hyper_parallel.mc2._block_style import Act, BlockStyle, apply_fields
from hyper_parallel.mc2._keywords import impl_keyword

__all__ = ["MC2MLPParallel"]

_NAME = "MC2MLPParallel"
LAYER = "MC2MLPParallel"  # the name this rewrite is installed under (hp-dtensor's rewrite)

# (up, down, activation attribute), tried in this order when not given explicitly
LAYOUTS: tuple[tuple[str, str, str], ...] = (
    ("up_proj", "down_proj", "act_fn"),
    ("fc1", "fc2", "activation_fn"),
    ("c_fc", "c_proj", "act"),
    ("dense_h_to_4h", "dense_4h_to_h", "act"),
)


class MC2MLPParallel(BlockStyle):
    """Tensor + sequence parallel plain MLP ``down(act(up(x)))`` as one pipeline over row
    chunks (:func:`~hyper_parallel.mc2.mlp_block`), forward and backward.

    Input and output: this rank's sequence block as a local tensor, ``[B, S/tp, D]`` with
    ``sequence_dim=1`` (any layout with the sequence at ``sequence_dim`` and features last).
    Rank ``t`` of the tp mesh holds block ``t`` of the sequence.

    ``up`` and ``down`` name the module's ``nn.Linear`` children and ``act`` its activation
    attribute (or is the activation itself, a callable, for modules that call a function
    such as ``F.gelu`` in their forward). Left ``None``, they come from the first of
    :data:`LAYOUTS` whose up and down children the module has: ``up_proj``/``down_proj`` +
    ``act_fn``, ``fc1``/``fc2`` + ``activation_fn``, ``c_fc``/``c_proj`` + ``act``,
    ``dense_h_to_4h``/``dense_4h_to_h`` + ``act``. The activation must be per-element
    (:mod:`hyper_parallel.mc2.activation`); the module's forward must be exactly
    ``down(act(up(x)))`` (a module with an active ``nn.Dropout`` child is refused). ``impl``
    (``backend=``: its deprecated name) and ``chunks`` as in
    :func:`~hyper_parallel.mc2.mlp_block`.

    Output and every gradient equal the serial module on the full sequence; ``dW`` of each
    weight is this rank's shard of the full gradient.

    Consistency mode (hp-dtensor's README, "Ranks that disagree"): applying the style compares the
    style's options, the module's class and its weights over the tp group, before the weights
    are distributed; each forward compares the input block, ``sequence_dim``, the weight
    shards, the chosen ``impl``, the chunk count and the tp size.
    """

    _style, _layer, _prefix = _NAME, LAYER, "MC2MLP"
    _roles, _kind, _refuse_dropout = ("up",), "an MLP", True

    @impl_keyword(_NAME)
    def __init__(
        self,
        *,
        up: str | None = None,
        down: str | None = None,
        act: str | Callable[..., Any] | None = None,
        sequence_dim: int = 1,
        impl: str = "auto",
        chunks: int | None = None,
    ) -> None:
        super().__init__()
        for what, name in (("up", up), ("down", down)):
            if name is not None and (not isinstance(name, str) or not name):
                raise TypeError(f"{_NAME}: {what} must be a submodule name or None, got {name!r}")
        if act is not None and not (isinstance(act, str) and act) and not callable(act):
            raise TypeError(
                f"{_NAME}: act must be an attribute name, a callable or None, got {act!r}"
            )
        self._set_options(sequence_dim, impl, chunks)
        self.up, self.down, self.act = up, down, act

    def _options(self) -> list[tuple[str, str]]:
        act = self.act if self.act is None or isinstance(self.act, str) else _describe(self.act)
        return [("up", repr(self.up)), ("down", repr(self.down)), ("act", repr(act))]

    def resolve(self, module: nn.Module) -> tuple[tuple[str, ...], str, Act]:
        """``((up,), down, act)`` this style uses on ``module``: the explicit names, the rest
        from the first matching layout. ``ValueError`` naming the children when none
        matches."""
        children = module._modules
        for up, down, act in LAYOUTS:
            up, down = self.up or up, self.down or down
            if up in children and down in children:
                return (up,), down, self.act if self.act is not None else act
        if self.up and self.down:  # explicit, but absent: reported by _linears
            return (self.up,), self.down, self.act if self.act is not None else "act_fn"
        kind = type(module).__name__
        known = ", ".join(f"{u}/{d} + {a}" for u, d, a in LAYOUTS)
        raise ValueError(
            f"{_NAME}: {kind} has none of the known up/down layouts ({known}); its children: "
            f"{list(children)}; pass up=<name>, down=<name> (and act=<name or callable>)"
        )

    def _no_act(self, kind: str, act: Act) -> str:
        return (
            f"{_NAME}: {kind} has no activation attribute {act!r}; pass act=<name> or "
            "act=<the activation>"
        )

    _apply = checked_entry(_NAME, group="device_mesh", extra=apply_fields)(
        BlockStyle._shard_and_install
    )


def _describe(act: Any) -> str:
    return repr(act) if isinstance(act, nn.Module) else getattr(act, "__qualname__", repr(act))
