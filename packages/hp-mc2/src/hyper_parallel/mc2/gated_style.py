"""``MC2GatedMLPParallel``: the ``ParallelStyle`` for gated MLP modules
(``down(act_fn(gate(x)) * up(x))``: Hugging Face ``LlamaMLP``, ``DeepseekV3MLP``,
``KimiLinearMLP`` and any module with the same three ``nn.Linear`` children and ``act_fn``).

Applied with torch's ``parallelize_module(mlp, tp_mesh, MC2GatedMLPParallel())``: the weights
become DTensors (gate/up ``Shard(0)``, down ``Shard(1)``, gate/up biases ``Shard(0)``, the
down bias ``Replicate()``) and the module's forward runs :func:`~hyper_parallel.mc2.gated_mlp`
on this rank's sequence block. The module keeps its class, children, ``act_fn`` and parameter
names; the parameters are new DTensor ``Parameter`` objects, as with torch's own styles.

It is the block style (:class:`~hyper_parallel.mc2._block_style.BlockStyle`) with two input
projections, gate and up, named by the constructor; the activation is always ``act_fn``.
"""

from __future__ import annotations

from torch import nn

from hyper_parallel.dtensor.consistency import checked_entry
from hyper_parallel.mc2._block_style import Act, BlockStyle, apply_fields
from hyper_parallel.mc2._keywords import impl_keyword

__all__ = ["MC2GatedMLPParallel"]

_NAME = "MC2GatedMLPParallel"
LAYER = "MC2GatedMLPParallel"  # the name this rewrite is installed under (hp-dtensor's rewrite)


class MC2GatedMLPParallel(BlockStyle):
    """Tensor + sequence parallel gated MLP with one all-gather shared by gate and up.

    Input and output: this rank's sequence block as a local tensor, ``[B, S/tp, D]`` with
    ``sequence_dim=1`` (any layout with the sequence at ``sequence_dim`` and features last).
    Rank ``t`` of the tp mesh holds block ``t`` of the sequence. ``gate``, ``up``, ``down``
    name the module's ``nn.Linear`` children; the activation is the module's own
    ``act_fn`` (per-element only). ``impl`` (``backend=``: its deprecated name): the
    matmul+collective implementation, ``"auto"``, ``"torch"`` (chunked collectives
    overlapped with the matmuls) or ``"npu"`` (torch_npu MC2 kernels); ``chunks`` as in
    :func:`~hyper_parallel.mc2.gated_mlp`.

    Output and every gradient equal the serial module on the full sequence; ``dW`` of each
    weight is this rank's shard of the full gradient.

    Consistency mode (hp-dtensor's README, "Ranks that disagree"): applying the style compares, over
    the tp group and before the weights are distributed, the style's options
    (``gate``/``up``/``down``, ``sequence_dim``, ``impl``, ``chunks``), the module's class and
    its weights; each forward compares the input block, ``sequence_dim`` and
    :func:`~hyper_parallel.mc2.gated_mlp`'s fields.
    """

    _style, _layer, _prefix = _NAME, LAYER, "MC2Gated"
    _roles, _kind = ("gate", "up"), "a gated MLP"

    @impl_keyword(_NAME)
    def __init__(
        self,
        *,
        gate: str = "gate_proj",
        up: str = "up_proj",
        down: str = "down_proj",
        sequence_dim: int = 1,
        impl: str = "auto",
        chunks: int | None = None,
    ) -> None:
        super().__init__()
        for what, name in (("gate", gate), ("up", up), ("down", down)):
            if not isinstance(name, str) or not name:
                raise TypeError(f"{_NAME}: {what} must be a submodule name, got {name!r}")
        self._set_options(sequence_dim, impl, chunks)
        self.gate, self.up, self.down = gate, up, down

    def _options(self) -> list[tuple[str, str]]:
        return [("gate", repr(self.gate)), ("up", repr(self.up)), ("down", repr(self.down))]

    def resolve(self, module: nn.Module) -> tuple[tuple[str, ...], str, Act]:
        return (self.gate, self.up), self.down, "act_fn"

    def _no_act(self, kind: str, act: Act) -> str:
        return f"{_NAME}: {kind} has no act_fn; the style uses the module's own"

    _apply = checked_entry(_NAME, group="device_mesh", extra=apply_fields)(
        BlockStyle._shard_and_install
    )
