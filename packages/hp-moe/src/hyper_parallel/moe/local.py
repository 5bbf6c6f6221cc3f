"""The work one rank does without communicating: the local backends (``impl=``).

Notation: ``N`` tokens of this rank, ``K`` experts per token, ``H`` hidden, ``I`` expert
intermediate size, ``E_l = E / ep`` experts on this rank, ``M`` rows this rank's experts run.

A backend is one small class behind :class:`LocalExperts`, registered in :data:`IMPLS`:

- ``permute(hidden [N, H], top_k_index [N, K]) -> (rows [N·K, H], order [N·K])``: the (token,
  slot) pairs stably sorted by expert id (``order``: the flat ``n·K + k`` index of each sorted
  row), so the rows for rank j's experts are one contiguous block;
- ``unpermute(rows [N·K, H], order, top_k_weights [N, K], dtype) -> [N, H]``: each row back to
  its (token, slot), weighted and summed over the K slots, in ``dtype`` (the inverse);
- ``experts(x [M, H], counts, gate_up [E_l, 2I, H], down [E_l, H, I], act) -> [M, H]``: the rows
  grouped by local expert (``counts[e]`` rows for expert e, in order) through their expert.

Every method is differentiable by autograd. :class:`TorchExperts` (``"torch"``) is the
reference every other backend is tested against: one matmul pair per expert, as the stock
module computes it. ``"grouped_mm"`` runs the GEMMs of every local expert as one
``torch._grouped_mm`` (CUDA; also float32/bf16 on CPU where this torch has it). ``"npu"`` is the
torch_npu backend (:mod:`hyper_parallel.moe.npu_ops`). :func:`select_impl` resolves ``"auto"``
and says why.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "IMPLS",
    "GroupedMMExperts",
    "LocalExperts",
    "TorchExperts",
    "select_impl",
    "split_experts",
]

Act = Callable[[Tensor], Tensor]


class LocalExperts(Protocol):
    """One local backend (see the module docstring for the shapes)."""

    name: str

    def unavailable(self, device_type: str, dtype: torch.dtype, shape: Any) -> str | None:
        """``None`` when this backend can run these tensors, else why not."""
        ...

    def permute(self, hidden: Tensor, top_k_index: Tensor) -> tuple[Tensor, Tensor]: ...

    def unpermute(
        self, rows: Tensor, order: Tensor, top_k_weights: Tensor, dtype: torch.dtype
    ) -> Tensor: ...

    def experts(
        self, x: Tensor, counts: list[int], gate_up: Tensor, down: Tensor, act: Act
    ) -> Tensor: ...


class TorchExperts:
    """Plain torch: index gather/scatter and one ``F.linear`` pair per local expert (the
    reference twin of every other backend)."""

    name = "torch"

    def unavailable(self, device_type: str, dtype: torch.dtype, shape: Any) -> str | None:
        return None

    def permute(self, hidden: Tensor, top_k_index: Tensor) -> tuple[Tensor, Tensor]:
        k = top_k_index.shape[1]
        order = torch.argsort(top_k_index.reshape(-1), stable=True)
        return hidden.index_select(0, order // k), order

    def unpermute(
        self, rows: Tensor, order: Tensor, top_k_weights: Tensor, dtype: torch.dtype
    ) -> Tensor:
        n, k = top_k_weights.shape
        slots = rows.new_zeros(rows.shape).index_copy(0, order, rows).view(n, k, rows.shape[-1])
        # the stock module multiplies each expert's rows by their weight (promoting to the
        # weights' dtype) and accumulates in the hidden dtype
        return (slots * top_k_weights.unsqueeze(-1)).to(dtype).sum(1)

    def experts(self, x: Tensor, counts: list[int], gate_up: Any, down: Any, act: Act) -> Tensor:
        """``gate_up``/``down``: the stacked weights, or (from :func:`split_experts`) their
        per-expert tensors, shared by the chunks of one forward."""
        outs, start = [], 0
        gus, dns = split_experts(gate_up, down)
        for e, m in enumerate(counts):
            if m:
                rows = x[start : start + m]
                gate, up = F.linear(rows, gus[e]).chunk(2, dim=-1)
                outs.append(F.linear(act(gate) * up, dns[e]))
            start += m
        if not outs:  # no rows: keep the rows (and the exchange that brought them) and the
            # weights in the graph, a zero-cost dependency, so every backward collective runs
            keep = sum(g.sum() for g in gus) + sum(d.sum() for d in dns)
            return x.new_zeros(0, dns[0].shape[0]) + 0 * (x.sum() + keep)
        return torch.cat(outs)


def split_experts(gate_up: Any, down: Any) -> tuple[Any, Any]:
    """The per-expert views ``(gate_up[e] for e), (down[e] for e)`` by one ``unbind`` per
    weight (as they are when already split). One split serves every chunk of a forward: the
    backward of ``unbind`` stacks the experts' gradients into one tensor, where indexing
    ``gate_up[e]`` per expert (or unbinding per chunk) gives each a zero-filled gradient of the
    whole weight to add up."""
    if isinstance(gate_up, Tensor):
        gate_up = gate_up.unbind(0)
    if isinstance(down, Tensor):
        down = down.unbind(0)
    return gate_up, down


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (``torch._grouped_mm``'s
    backward rejects expanded ones)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        return grad.contiguous()


class GroupedMMExperts(TorchExperts):
    """``torch._grouped_mm`` for the GEMMs of all local experts at once (permute and unpermute
    as :class:`TorchExperts`)."""

    name = "grouped_mm"
    _DTYPES = (torch.float32, torch.bfloat16, torch.float16)

    def unavailable(self, device_type: str, dtype: torch.dtype, shape: Any) -> str | None:
        if not hasattr(torch, "_grouped_mm"):
            return f"torch {torch.__version__} has no torch._grouped_mm"
        if dtype not in self._DTYPES:
            return f"torch._grouped_mm takes float32/bfloat16/float16, not {dtype}"
        if shape is not None:
            item = torch.empty(0, dtype=dtype).element_size()
            for what, size in (("H", shape.hidden), ("I", shape.intermediate)):
                if (size * item) % 16:
                    return f"torch._grouped_mm needs rows of 16-byte multiples ({what}={size})"
        return None

    def experts(
        self, x: Tensor, counts: list[int], gate_up: Tensor, down: Tensor, act: Act
    ) -> Tensor:
        offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        h = torch._grouped_mm(x.contiguous(), gate_up.transpose(1, 2), offs=offs)
        gate, up = _ContiguousGrad.apply(h).chunk(2, dim=-1)
        y = torch._grouped_mm((act(gate) * up).contiguous(), down.transpose(1, 2), offs=offs)
        return _ContiguousGrad.apply(y)


IMPLS: dict[str, LocalExperts] = {"torch": TorchExperts(), "grouped_mm": GroupedMMExperts()}


def register_impl(backend: LocalExperts) -> None:
    """Add a local backend under its ``name`` (how the ``npu`` backend joins)."""
    IMPLS[backend.name] = backend


def select_impl(
    impl: str, device_type: str, dtype: torch.dtype, shape: Any = None
) -> tuple[LocalExperts, str]:
    """The backend for ``impl`` on tensors of ``device_type`` and ``dtype``, and why.

    ``"auto"``: ``npu`` on an NPU where torch_npu's ops can run, ``grouped_mm`` on CUDA where
    this torch has it for the dtype, else ``torch``. A named backend that cannot run raises
    ``ValueError`` with the reason. Depends on device type, dtype and shapes only, so every rank
    of a group computes the same choice."""
    if impl != "auto":
        if impl not in IMPLS:
            raise ValueError(f"impl must be 'auto' or one of {sorted(IMPLS)}, got {impl!r}")
        why = IMPLS[impl].unavailable(device_type, dtype, shape)
        if why:
            raise ValueError(f"impl={impl!r} cannot run here: {why}")
        return IMPLS[impl], f"impl={impl!r} requested"
    preferred = {"npu": "npu", "cuda": "grouped_mm"}.get(device_type)
    if preferred in IMPLS:
        why = IMPLS[preferred].unavailable(device_type, dtype, shape)
        if why is None:
            return IMPLS[preferred], f"{preferred} on {device_type}: its constraints hold"
        return IMPLS["torch"], f"torch: {preferred} cannot run ({why})"
    return IMPLS["torch"], f"torch: no fused local backend on {device_type}"
