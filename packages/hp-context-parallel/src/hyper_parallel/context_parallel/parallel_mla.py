"""``parallelize_mla``: Ulysses context parallelism for an MLA block, applied from outside.

Rank r of the P-rank CP mesh holds tokens ``[r·S/P, (r+1)·S/P)``; the rewritten forward takes
``[B, S/P, D]`` and returns the same rows of the serial output (RoPE at global positions).

Schedules with ``overlap=True`` (``overlap=False``: the same math, blocking collectives).

expanded — forward: KV projection; launch a2a K, V; Q projection (K/V in flight); launch a2a
Q; wait K, V, Q; attention; launch a2a O (head→seq); ``o_proj`` waits it. Backward: ``o_proj``
input-grad matmul; launch a2a dO; ``o_proj`` weight-grad matmul; wait dO; attention backward;
launch a2a dQ, dV, dK; wait dQ; Q projection backward (dK, dV in flight); wait dV, dK; KV
projection backward.

latent — forward: latent projection (``kv_a_proj_with_mqa`` + norm + RoPE); launch the
all-gather of ``[latent, k_rope]`` (dc + dr values per token); Q projection (gather in
flight); launch a2a Q; wait the gather and expand this rank's heads with its rows of
``kv_b_proj`` (Q in flight); wait Q; attention; O as above. Backward: ``o_proj`` as above;
attention backward; launch a2a dQ; ``kv_b_proj`` input-grad matmul; launch the
reduce-scatter (sum) of the latent's gradient; ``kv_b_proj`` weight-grad matmul (dQ and the
reduce-scatter in flight); wait dQ; Q projection backward (reduce-scatter in flight); wait
the reduce-scatter; latent projection backward.

Each overlapped collective is a pair of autograd nodes (launch, wait); autograd's ready
queue runs the later-created independent nodes between them. Partial ``torch.autograd.grad``
calls that prune one node of a pair are unsupported; the leaked collective is reported at
the next forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd import Function
from torch.distributed.tensor.parallel import ParallelStyle

from hyper_parallel.context_parallel import recorder as _rec
from hyper_parallel.context_parallel.collectives import (
    _Blocking,
    _exchange,
    _Launch,
    _raise_if_pending,
    _resolve,
    _Wait,
)
from hyper_parallel.context_parallel.mla import MultiHeadLatentAttention
from hyper_parallel.dtensor import DeviceMesh

__all__ = [
    "STRATEGIES",
    "ContextParallelMLA",
    "is_context_parallel",
    "parallelize_mla",
    "unparallelize_mla",
]

STRATEGIES = ("expanded", "latent")
_STATE = "_hp_cp_state"
_OWNER = "parallel_mla"  # tags the collectives launched by rewritten blocks


@dataclass(frozen=True)
class _CPState:
    mesh: DeviceMesh
    pg: Any
    size: int
    rank: int
    strategy: str
    overlap: bool
    original_class: type

    def __deepcopy__(self, memo: dict) -> _CPState:
        # a deep copy of a rewritten block is rewritten too, on the same mesh and group
        return self


# ---- recorder markers (inserted only while recording) -----------------------------------
class _Mark(Function):
    @staticmethod
    def forward(ctx: Any, name: str, begin: bool, *xs: Tensor) -> Any:  # type: ignore[override]
        ctx.name, ctx.begin = name, begin
        rec = _rec._ACTIVE
        if rec is not None:
            rec.add("begin" if begin else "end", name, "forward")
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Any:  # type: ignore[override]
        rec = _rec._ACTIVE
        if rec is not None:
            rec.add("end" if ctx.begin else "begin", ctx.name, "backward")
        return (None, None, *grads)


def _mark(name: str, begin: bool, *xs: Tensor) -> tuple[Tensor, ...]:
    if _rec._ACTIVE is None:
        return xs
    return _Mark.apply(name, begin, *xs)


class _span:
    """Record a compute span inside a fused node (no-op when recording is off)."""

    __slots__ = ("name", "phase", "rec")

    def __init__(self, name: str, phase: str) -> None:
        self.name, self.phase, self.rec = name, phase, _rec._ACTIVE

    def __enter__(self) -> None:
        if self.rec is not None:
            self.rec.add("begin", self.name, self.phase)

    def __exit__(self, *exc: object) -> None:
        if self.rec is not None:
            self.rec.add("end", self.name, self.phase)


# ---- fused wait + matmul nodes with split input/weight gradients ------------------------
class _WaitLinear(Function):
    """Wait the head→seq exchange of the attention output, then ``o_proj``.

    Backward: input-grad matmul, launch the gradient's seq→head exchange (waited by the
    paired launch node), then the weight-grad matmul while it is in flight.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, token: Tensor, weight: Tensor, bias: Tensor | None, ex: Any, head_width: int
    ) -> Tensor:
        work, ex.fwd = ex.fwd, None
        a = work.wait()
        with _span("o_proj", "forward"):
            a = a.flatten(2)
            y = F.linear(a, weight, bias)
        ctx.ex, ctx.has_bias, ctx.a_shape, ctx.head_width = (
            ex,
            bias is not None,
            a.shape,
            head_width,
        )
        ctx.save_for_backward(a, weight)
        return y

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> Any:  # type: ignore[override]
        a, weight = ctx.saved_tensors
        ex = ctx.ex
        with _span("o_proj.input_grad", "backward"):
            da = (dy @ weight).view(*ctx.a_shape[:2], -1, ctx.head_width)
        ex.bwd = ex.launch_grad(da.contiguous())
        dw = db = None
        with _span("o_proj.weight_grad", "backward"):
            if ctx.needs_input_grad[1]:
                dw = dy.flatten(0, 1).t() @ a.flatten(0, 1)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                db = dy.flatten(0, 1).sum(0)
        return dy.new_empty(0), dw, db, None, None


class _WaitExpand(Function):
    """Wait the all-gather of ``[latent, k_rope]``; expand this rank's heads with its rows of
    ``kv_b_proj``. Returns ``kv [B, S, h, dn + dv]`` and ``k_rope [B, S, dr]``.

    Backward: input-grad matmul, launch the reduce-scatter (sum) of the gathered tensor's
    gradient (waited by the paired launch node), then the weight-grad matmul.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, token: Tensor, weight: Tensor, ex: Any, rows: slice, dc: int, heads: int
    ) -> Any:
        work, ex.fwd = ex.fwd, None
        full = work.wait()
        with _span("kv_b_proj", "forward"):
            lat = full[..., :dc].contiguous()
            k_rope = full[..., dc:].contiguous()
            kv = F.linear(lat, weight[rows]).view(*lat.shape[:2], heads, -1)
        ctx.ex, ctx.rows = ex, rows
        ctx.save_for_backward(lat, weight)
        return kv, k_rope

    @staticmethod
    def backward(ctx: Any, dkv: Tensor, dk_rope: Tensor) -> Any:  # type: ignore[override]
        lat, weight = ctx.saved_tensors
        rows = ctx.rows
        d2 = dkv.reshape(*dkv.shape[:2], -1)
        with _span("kv_b_proj.input_grad", "backward"):
            dlat = d2 @ weight[rows]
        ctx.ex.bwd = ctx.ex.launch_grad(torch.cat([dlat, dk_rope], dim=-1))
        dw = None
        with _span("kv_b_proj.weight_grad", "backward"):
            if ctx.needs_input_grad[1]:
                dw = torch.zeros_like(weight)
                dw[rows] = d2.flatten(0, 1).t() @ lat.flatten(0, 1)
        return dkv.new_empty(0), dw, None, None, None, None


# ---- the rewritten forward ----------------------------------------------------------------
def _cp_forward(m: MultiHeadLatentAttention, st: _CPState, x: Tensor) -> Tensor:
    c = m.config
    if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != c.hidden_size:
        raise ValueError(
            f"hidden_states must be this rank's sequence block [B, S/P, {c.hidden_size}], got "
            f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}"
        )
    _raise_if_pending("context-parallel MLA forward", _OWNER)
    s = x.shape[1]
    positions = torch.arange(st.rank * s, (st.rank + 1) * s, device=x.device)
    cos, sin = m.rope_tables(positions, x.dtype)
    h = c.num_heads // st.size
    pg = st.pg

    def a2a(t: Tensor, name: str, kind: str = "s2h") -> Any:
        return _exchange(kind, t, 1, 2, pg, f"a2a:{name}", _OWNER)

    if st.strategy == "expanded":
        (xk,) = _mark("kv_proj", True, x)
        k, v = m.expand_kv(m.project_latent(xk, cos, sin))
        k, v = _mark("kv_proj", False, k, v)
        if st.overlap:
            ek, ev = a2a(k, "k"), a2a(v, "v")
            tk, tv = _Launch.apply(k, ek), _Launch.apply(v, ev)
        else:
            k_h, v_h = _Blocking.apply(k, a2a(k, "k")), _Blocking.apply(v, a2a(v, "v"))
        q = _q_branch(m, x, cos, sin)
        if st.overlap:
            eq = a2a(q, "q")
            tq = _Launch.apply(q, eq)
            k_h, v_h = _Wait.apply(tk, ek), _Wait.apply(tv, ev)
            q_h = _Wait.apply(tq, eq)
        else:
            q_h = _Blocking.apply(q, a2a(q, "q"))
    else:
        (xk,) = _mark("kv_a_proj", True, x)
        lat = m.project_latent(xk, cos, sin)
        (lat,) = _mark("kv_a_proj", False, lat)
        eg = _exchange("ag", lat, 1, -1, pg, "all_gather:latent", _OWNER)
        width = h * (c.qk_nope_head_dim + c.v_head_dim)  # kv_b_proj rows of this rank's heads
        rows = slice(st.rank * width, (st.rank + 1) * width)
        w = m.kv_b_proj.weight
        if st.overlap:
            tg = _Launch.apply(lat, eg)
            q = _q_branch(m, x, cos, sin)
            eq = a2a(q, "q")
            tq = _Launch.apply(q, eq)
            kv, k_rope = _WaitExpand.apply(tg, w, eg, rows, c.kv_lora_rank, h)
            k_h, v_h = m.split_kv(kv, k_rope)
            q_h = _Wait.apply(tq, eq)
        else:
            full = _Blocking.apply(lat, eg)
            q = _q_branch(m, x, cos, sin)
            q_h = _Blocking.apply(q, a2a(q, "q"))
            (full,) = _mark("kv_b_proj", True, full)
            lat_full, k_rope = full.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
            kv = F.linear(lat_full, w[rows]).view(*lat_full.shape[:2], h, -1)
            k_h, v_h = m.split_kv(kv, k_rope)
            k_h, v_h = _mark("kv_b_proj", False, k_h, v_h)

    q_h, k_h, v_h = _mark("attention", True, q_h, k_h, v_h)
    o_h = m.attend(q_h, k_h, v_h)
    (o_h,) = _mark("attention", False, o_h)
    eo = a2a(o_h, "o", "h2s")
    if st.overlap:
        to = _Launch.apply(o_h, eo)
        return _WaitLinear.apply(to, m.o_proj.weight, m.o_proj.bias, eo, c.v_head_dim)
    o = _Blocking.apply(o_h, eo)
    (o,) = _mark("o_proj", True, o)
    y = m.o_proj(o.flatten(2))
    (y,) = _mark("o_proj", False, y)
    return y


def _q_branch(m: MultiHeadLatentAttention, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    (xq,) = _mark("q_proj", True, x)
    q = m.project_q(xq, cos, sin)
    (q,) = _mark("q_proj", False, q)
    return q


# ---- the transactional rewrite ------------------------------------------------------------
_CLASSES: dict[type, type] = {}


def _cp_class(cls: type) -> type:
    if cls not in _CLASSES:

        def forward(self: Any, hidden_states: Tensor) -> Tensor:
            return _cp_forward(self, getattr(self, _STATE), hidden_states)

        _CLASSES[cls] = type(
            f"ContextParallel{cls.__name__}",
            (cls,),
            {"forward": forward, "__module__": cls.__module__, "__doc__": cls.__doc__},
        )
    return _CLASSES[cls]


def _validate(module: Any, cp_mesh: Any, strategy: Any, overlap: Any) -> _CPState:
    if not isinstance(module, MultiHeadLatentAttention):
        raise TypeError(
            f"parallelize_mla needs a MultiHeadLatentAttention module, got {type(module).__name__}"
        )
    if hasattr(module, _STATE):
        raise RuntimeError(
            "parallelize_mla was already applied to this module; call unparallelize_mla first"
        )
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be a bool, got {overlap!r}")
    if not isinstance(cp_mesh, DeviceMesh):
        raise TypeError(f"cp_mesh must be a 1-D torch DeviceMesh, got {type(cp_mesh).__name__}")
    g = _resolve(cp_mesh)  # ValueError for n-D meshes or a rank order differing from the group's
    heads = module.config.num_heads
    if heads % g.size:
        raise ValueError(f"num_heads ({heads}) is not divisible by the CP size {g.size}")
    return _CPState(cp_mesh, g.pg, g.size, g.rank, strategy, overlap, type(module))


def _install(module: nn.Module, state: _CPState) -> list[Any]:
    """Apply the rewrite step by step; returns the undo actions (in application order)."""
    undo: list[Any] = []
    try:
        setattr(module, _STATE, state)
        undo.append(lambda: delattr(module, _STATE))
        _swap_class(module, _cp_class(state.original_class))
        undo.append(lambda: _swap_class(module, state.original_class))
    except BaseException:
        for u in reversed(undo):
            u()
        raise
    return undo


def _swap_class(module: nn.Module, cls: type) -> None:
    module.__class__ = cls


def parallelize_mla(
    module: MultiHeadLatentAttention,
    cp_mesh: DeviceMesh,
    *,
    strategy: str = "expanded",
    overlap: bool = True,
) -> MultiHeadLatentAttention:
    """Rewrite ``module`` in place for Ulysses context parallelism over the 1-D ``cp_mesh``.

    Afterwards ``module(hidden_states [B, S/P, D])`` on rank r returns rows
    ``[r·S/P, (r+1)·S/P)`` of the serial output; the input's gradient and every parameter's
    gradient summed over ranks equal the serial module's (parameters stay whole and
    replicated: the latent strategy reads only its rows of ``kv_b_proj``, so that parameter's
    gradient is non-zero only in those rows on each rank).

    ``strategy``: ``"expanded"`` (a2a of Q, K and V) or ``"latent"`` (a2a of Q, all-gather of
    the ``kv_lora_rank + qk_rope_head_dim`` latent). ``overlap``: overlap collectives with
    projection compute (see the module docstring) or run them blocking.

    Errors, raised identically on every rank before any communication, leaving the module
    untouched: ``TypeError`` (not MLA, ``overlap`` not a bool, ``cp_mesh`` not a DeviceMesh),
    ``RuntimeError`` (already parallelized), ``ValueError`` (unknown strategy, mesh not 1-D or
    with a rank order differing from its group's, heads not divisible by the CP size). A
    sequence length not divisible by P is rejected by :func:`shard_sequence`.
    """
    state = _validate(module, cp_mesh, strategy, overlap)
    _install(module, state)
    return module


def unparallelize_mla(module: MultiHeadLatentAttention) -> MultiHeadLatentAttention:
    """Undo :func:`parallelize_mla` (``RuntimeError`` if it was not applied)."""
    state = getattr(module, _STATE, None)
    if state is None:
        raise RuntimeError("module is not context-parallel")
    _swap_class(module, state.original_class)
    delattr(module, _STATE)
    return module


def is_context_parallel(module: nn.Module) -> bool:
    return hasattr(module, _STATE)


class ContextParallelMLA(ParallelStyle):
    """torch ``ParallelStyle`` form of :func:`parallelize_mla`, for ``parallelize_module``::

    parallelize_module(model, cp_mesh, {"layers.0.attn": ContextParallelMLA("latent")})
    """

    def __init__(self, strategy: str = "expanded", *, overlap: bool = True) -> None:
        super().__init__()
        self.strategy, self.overlap = strategy, overlap

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return parallelize_mla(
            module,  # type: ignore[arg-type]  # validated: TypeError unless MLA
            device_mesh,
            strategy=self.strategy,
            overlap=self.overlap,
        )
