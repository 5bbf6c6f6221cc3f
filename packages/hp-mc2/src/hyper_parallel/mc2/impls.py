"""hp-mc2's implementations of the matmul+collective (``impl=``) behind one interface, and
which one runs a call, and why.

An implementation is a class with the methods of :class:`MC2Impl`: forward and backward of the
column dual (``all_gather_matmul``), of the row dual (``matmul_reduce_scatter``) and of the
fused MLP block (``gated_mlp`` / ``mlp_block``), and a constraint check. The autograd functions
(:mod:`hyper_parallel.mc2.functional`, :mod:`hyper_parallel.mc2._block`) call only these
methods, never a branch on the name, and :data:`IMPLS` is the registry the ``impl=`` names
resolve in:

- ``"torch"``: :class:`~hyper_parallel.mc2._torch_impl.TorchChunkedImpl`, the rows split into
  chunks, one chunk's async collective under another chunk's matmul, on any process group;
- ``"npu"``: :class:`~hyper_parallel.mc2._npu_impl.NpuFusedImpl`, the torch_npu MC2 fused
  kernels (Ascend);
- ``"auto"``: the first of :data:`AUTO_ORDER` whose constraints hold (:func:`select_impl`).

A further implementation (CUDA symmetric memory, say) is one new class with these methods,
one entry in :data:`IMPLS` and its place in :data:`AUTO_ORDER`; nothing else changes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from hyper_parallel.mc2._keywords import impl_keyword
from hyper_parallel.mc2._npu_impl import NpuFusedImpl
from hyper_parallel.mc2._operands import OPS, Op
from hyper_parallel.mc2._torch_impl import TorchChunkedImpl

__all__ = [
    "AUTO_ORDER",
    "IMPLS",
    "Call",
    "MC2Impl",
    "block_failure",
    "check_impl_choice",
    "impl_choices",
    "select_backend",
    "select_impl",
]

Act = Callable[[torch.Tensor], torch.Tensor]
Grad = torch.Tensor | None


@dataclass(frozen=True)
class Call:
    """What one call of a dual or a block runs over: the process group, its size and the chunk
    count (an implementation that does not chunk ignores it). The same on every rank."""

    group: Any
    ws: int
    chunks: int


class MC2Impl(Protocol):
    """One implementation of the matmul+collective. Every method works on this rank's local,
    contiguous 2-D tensors in the layouts of README "Design" (``x`` ``[m, k]``, weights in
    ``nn.Linear`` layout) and leaves the bias of a dual to its caller. A forward returns, with
    its result, a ``state`` of its own choosing that the autograd function hands back to the
    matching backward (what the backward needs beyond the saved tensors: chunk offsets, a
    kernel provider and communicator name)."""

    #: the ``impl=`` value that selects it
    name: str
    #: :func:`select_backend`'s reason when ``impl=<name>`` is given and it can run
    requested_reason: str
    #: the reason when ``impl="auto"`` picks it before any other was ruled out
    auto_reason: str

    def failure(self, op: Op, x: torch.Tensor, weight: torch.Tensor, group: Any) -> str | None:
        """``None`` when it can run ``op`` (forward and backward) on these operands over
        ``group``, else the first constraint that fails, in words."""
        ...

    def column_forward(
        self, call: Call, x: torch.Tensor, weight: torch.Tensor, *, keep_x: bool
    ) -> tuple[torch.Tensor, list[torch.Tensor], Any]:
        """``(Y, kept, state)``: ``Y = AllGather_m(x) Wᵀ`` ``[ws·m, n]``; ``kept`` the
        gathered input in whatever pieces its backward reads for ``dW`` (empty unless
        ``keep_x``); the autograd function saves them."""
        ...

    def column_backward(
        self,
        state: Any,
        dy: torch.Tensor,
        weight: torch.Tensor,
        kept: Sequence[torch.Tensor],
        *,
        need_dx: bool,
        need_dw: bool,
    ) -> tuple[Grad, Grad]:
        """``(dx, dW)``: ``dx = ReduceScatter_m(dY W)``, ``dW = dYᵀ X`` (``None`` where not
        needed; called only when one is)."""
        ...

    def row_forward(
        self, call: Call, x: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, Any]:
        """``(Y, state)``: ``Y = ReduceScatter_m(x Wᵀ)`` ``[m/ws, n]``."""
        ...

    def row_backward(
        self,
        state: Any,
        dy: torch.Tensor,
        x: torch.Tensor,
        weight: torch.Tensor,
        *,
        need_dx: bool,
        need_dw: bool,
        need_db: bool,
    ) -> tuple[Grad, Grad, Grad]:
        """``(dx, dW, db)`` from ``dY_full = AllGather_m(dY)``: ``dY_full W``,
        ``dY_fullᵀ x``, ``Σ_m dY_full`` (called only when one is needed)."""
        ...

    def block_forward(
        self,
        call: Call,
        x: torch.Tensor,
        w_in: tuple[torch.Tensor, ...],
        b_in: tuple[Grad, ...],
        wd: torch.Tensor,
        act: Act,
        *,
        keep_x: bool,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor | None, Any]:
        """``(Y, pre, X, state)`` of the MLP block with input projections ``w_in``
        (``(W_g, W_u)`` gated, ``(W_u,)`` plain) and their biases: ``pre`` the
        pre-activations ``(G, U)`` / ``(U,)`` ``[ws·m, F/ws]``, ``X`` the gathered input when
        ``keep_x`` (else ``None``), ``Y = ReduceScatter_m(H W_dᵀ)`` without ``b_d``."""
        ...

    def block_backward(
        self,
        state: Any,
        dy: torch.Tensor,
        x: torch.Tensor,
        pre: tuple[torch.Tensor, ...],
        w_in: tuple[torch.Tensor, ...],
        wd: torch.Tensor,
        act: Act,
        need: tuple[bool, ...],
        saved_x: torch.Tensor | None,
    ) -> list[Grad]:
        """``[dx, *dW_in, dW_d, *db_in, db_d]`` (``need`` in the same order; ``None`` where
        not needed). May consume ``pre``; ``saved_x`` is the ``X`` its forward kept, if any."""
        ...


IMPLS: dict[str, MC2Impl] = {impl.name: impl for impl in (TorchChunkedImpl(), NpuFusedImpl())}
#: the order ``impl="auto"`` tries them in: the first whose constraints hold runs (the last,
#: ``torch``, runs anything)
AUTO_ORDER: tuple[str, ...] = ("npu", "torch")


def impl_choices() -> tuple[str, ...]:
    """What ``impl=`` accepts: ``"auto"`` and every registered name."""
    return ("auto", *IMPLS)


def check_impl_choice(impl: Any, where: str = "") -> None:
    """``impl`` is ``"auto"`` or a registered name, else ``ValueError`` (``where``, if given,
    prefixes the message)."""
    if impl not in impl_choices():
        prefix = f"{where}: " if where else ""
        raise ValueError(f"{prefix}impl must be one of {impl_choices()}, got {impl!r}")


def select_impl(
    requested: str, where: str, failure: Callable[[MC2Impl], str | None]
) -> tuple[str, str]:
    """``(name, reason)`` of the implementation that runs ``where``; ``failure(impl)`` is its
    constraint check on this call's operands. A named ``requested`` implementation runs if its
    constraints hold, else ``ValueError`` naming the failed one; ``"auto"`` takes the first of
    :data:`AUTO_ORDER` whose constraints hold, the reason being why the ones before it could
    not run (or its own :attr:`MC2Impl.auto_reason` when it was the first)."""
    check_impl_choice(requested)
    if requested != "auto":
        impl = IMPLS[requested]
        why = failure(impl)
        if why:
            raise ValueError(f"impl={requested!r} cannot run {where}: {why}")
        return requested, impl.requested_reason
    skipped: list[tuple[str, str]] = []
    for name in AUTO_ORDER:
        why = failure(IMPLS[name])
        if not why:
            if not skipped:
                return name, IMPLS[name].auto_reason
            if len(skipped) == 1:
                return name, skipped[0][1]
            return name, "; ".join(f"{n}: {w}" for n, w in skipped)
        skipped.append((name, why))
    raise ValueError(f"no implementation can run {where}: {skipped}")


def block_failure(
    impl: MC2Impl, x: torch.Tensor, in_rows: int, wd: torch.Tensor, group: Any
) -> str | None:
    """``impl``'s constraint check of an MLP block whose input projection has ``in_rows``
    output features on this rank (gated: gate+up concatenated, ``2F/ws``; plain: ``F/ws``):
    the column dual for it, then the row dual for down on an ``H`` of ``F/ws`` features."""
    w_in = torch.empty((in_rows, wd.shape[0]), dtype=wd.dtype, device="meta")
    why = impl.failure("all_gather_matmul", x, w_in, group)
    if not why:
        # stands in for H: its device type, dtype and shape matter, not its data (a
        # zero-stride expand allocates nothing); ws rows keep the row check's divisibility
        h = x.new_zeros(()).expand(dist.get_world_size(group), wd.shape[1])
        why = impl.failure("matmul_reduce_scatter", h, wd, group)
    return why


@impl_keyword("select_backend")
def select_backend(
    op: Op,
    x: torch.Tensor,
    weight: torch.Tensor,
    group: Any = None,
    *,
    impl: str = "auto",
) -> tuple[str, str]:
    """Return ``(choice, reason)``: the implementation (``"npu"`` or ``"torch"``) that ``op``
    runs with for these operands, and why. ``impl="npu"`` raises ``ValueError`` naming the
    failed kernel constraint instead of falling back (``backend=``: deprecated name of
    ``impl=``)."""
    check_impl_choice(impl)
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    return select_impl(impl, op, lambda candidate: candidate.failure(op, x, weight, group))
