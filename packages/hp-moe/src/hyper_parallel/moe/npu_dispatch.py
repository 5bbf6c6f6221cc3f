"""The torch_npu dispatchers: ``npu_permute``, ``npu_fused_gmm``, ``npu_distribute``.

Each is a :class:`~hyper_parallel.moe.dispatch.AllToAllDispatcher` with some steps replaced.
None imports ``torch_npu``: the ops come from the process's NPU provider
(:func:`~hyper_parallel.moe.npu_ops.current_npu_ops`), asked first whether it has them
(``available(ops=(...))``), and the communicator name (``hcom``) of the ep group from the
provider's ``comm_name(group)``. Tests install a double whose comm-fused ops run real gloo
communication on the group that name stands for.

- ``npu_permute``: the all-to-all of ``"alltoall"`` with permute/unpermute by
  ``npu_moe_token_permute`` / ``npu_moe_token_unpermute`` (the ``npu`` local backend's; their
  backward is registered from op-plugin 7.2.0); the expert GEMMs by ``impl=``.
- ``npu_fused_gmm``: dispatch is ``npu_alltoallv_gmm`` (all-to-all-v, permute, then the
  gate/up grouped GEMM) and combine ``npu_gmm_alltoallv`` (the down grouped GEMM, unpermute,
  then the all-to-all-v back); the activation runs between them. torch_npu registers no
  backward: as MindSpeed's ``AllToAllGroupedMatmul`` / ``GroupedMatmulAllToAll`` do, the input
  gradient of one is the other op on the transposed weights with the counts swapped, and each
  expert's weight gradient is a per-expert GEMM of the rows it saw (the permuted rows, or the
  permuted output gradient, ``permute_out_flag=True``). The weight gradients are their own
  local autograd nodes, so the exchanges stay hp-dtensor's launch/wait pair.
- ``npu_distribute``: ``npu_moe_distribute_dispatch_v2`` / ``npu_moe_distribute_combine_v2``
  (the whole routing in two ops: no chunks, the weighted sum inside combine). Inference only:
  refused (on every rank, by the count exchange's verdicts) when gradients are needed.

What the Ascend documentation says about the ops (and what these backends rely on):

``npu_alltoallv_gmm(gmm_x, gmm_weight, hcom, ep_world_size, send_counts, recv_counts, *,
send_counts_tensor=None, recv_counts_tensor=None, mm_x=None, mm_weight=None,
trans_gmm_weight=False, trans_mm_weight=False, permute_out_flag=False) -> (gmm_y, mm_y,
permute_out)``
    All-to-all-v of ``gmm_x [BSK, H1]`` (rows ordered by destination rank, then by its local
    expert), permute of the received rows to expert-major, then the grouped GEMM with
    ``gmm_weight [e, H1, N1]`` (``trans_gmm_weight``: given as ``[e, N1, H1]``):
    ``gmm_y [A, N1]``; ``permute_out [A, H1]`` when ``permute_out_flag``. ``send_counts`` /
    ``recv_counts``: ``e·ep`` ints, rows to (from) each (rank, local expert), rank-major.
    float16/bfloat16; ``ep_world_size`` 8, 16, 32, 64 (128 in later releases); ``e <= 32``,
    ``e·ep <= 256``; ``H1``, ``N1`` in ``(0, 65536)``; ``BSK`` in ``(0, 52428800)``; K in
    [2, 8]; 2 MB to 100 MB a card per call; Atlas A3 only; its page says "inference", while
    MindSpeed trains with it through its own autograd function (as here).
``npu_gmm_alltoallv(gmm_x, gmm_weight, hcom, ep_world_size, send_counts, recv_counts, *,
send_counts_tensor=None, recv_counts_tensor=None, mm_x=None, mm_weight=None,
trans_gmm_weight=False, trans_mm_weight=False) -> (y, mm_y)``
    The reverse: the grouped GEMM of expert-major ``gmm_x [A, H1]`` with ``gmm_weight``,
    unpermute to destination-major, all-to-all-v: ``y [BSK, N1]``. ``ep_world_size`` 8, 16, 32,
    64, 128; the other limits as above.
``npu_moe_distribute_dispatch_v2(x, expert_ids, group_ep, ep_world_size, ep_rank_id,
moe_expert_num, *, scales=None, x_active_mask=None, expert_scales=None, elastic_info=None,
group_tp="", tp_world_size=0, tp_rank_id=0, expert_shard_type=0, shared_expert_num=1,
shared_expert_rank_num=0, quant_mode=0, global_bs=0, expert_token_nums_type=1, comm_alg="",
zero_expert_num=0, copy_expert_num=0, const_expert_num=0) -> (expand_x, dynamic_scales,
assist_info_for_combine, expert_token_nums, ep_recv_counts, tp_recv_counts, expand_scales)``
    ``x [BS, H]`` float16/bfloat16 and ``expert_ids [BS, K]`` int32 (distinct ids a row, in
    ``[0, moe_expert_num)``) in; ``expand_x [A, H]``: the rows this rank's experts receive,
    grouped by local expert (``expert_token_nums [e]``, int64, counts with type 1; ``A`` is the
    most it can receive, ``>= global_bs·min(e, K)``: rows past the counts are padding).
    ``global_bs``: ``max BS · ep`` when the ranks' BS differ. Atlas A2: ep 16–256, ``e <= 24``,
    ``H <= 7168`` (a multiple of 32), ``0 < BS <= 256``; Atlas A3: ep 2–768, ``H`` in
    [1024, 8192], ``0 < BS <= 512``; ``moe_expert_num <= 1024``; ``0 < K <= 16``. Inference
    only (no backward).
``npu_moe_distribute_combine_v2(expand_x, expert_ids, assist_info_for_combine, ep_send_counts,
expert_scales, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *, tp_send_counts=None,
x_active_mask=None, expand_scales=None, shared_expert_x=None, elastic_info=None, ori_x=None,
const_expert_alpha_1=None, const_expert_alpha_2=None, const_expert_v=None,
performance_info=None, group_tp="", tp_world_size=0, tp_rank_id=0, expert_shard_type=0,
shared_expert_num=1, shared_expert_rank_num=0, global_bs=0, comm_quant_mode=0, comm_alg="",
zero_expert_num=0, copy_expert_num=0, const_expert_num=0) -> Tensor``
    The expert outputs (``expand_x`` of dispatch's layout) back to their tokens, weighted by
    ``expert_scales [BS, K]`` (float32) and summed over K: ``[BS, H]``. ``assist_info_for_combine``
    and ``ep_send_counts`` are dispatch's ``assist_info_for_combine`` and ``ep_recv_counts``,
    passed on unread. Same limits, inference only.

Sources: Ascend/op-plugin ``docs/context/torch_npu-npu_alltoallv_gmm.md``,
``torch_npu-npu_gmm_alltoallv.md``, ``torch_npu-npu_moe_distribute_dispatch_v2.md``,
``torch_npu-npu_moe_distribute_combine_v2.md``, ``op_plugin/ops/opapi/AllToAllvGmmNpuOpApi.cpp``,
``GmmAllToAllvNpuOpApi.cpp``; MindSpeed ``mindspeed/ops/grouped_matmul_mc2.py`` and
MindSpeed-MM ``mindspeed_mm/fsdp/ops/moe_ops/gemm_mc2.py`` (the training autograd of the pair);
CANN ``aclnnAlltoAllvGroupedMatMul`` / ``aclnnGroupedMatMulAlltoAllv`` (hicann ops-transformer
``mc2/``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from hyper_parallel.dtensor.overlap import launch, wait
from hyper_parallel.moe.dispatch import (
    AllToAllDispatcher,
    Capabilities,
    DispatchHandle,
    _rows_of,
    register_dispatcher,
)
from hyper_parallel.moe.form import ExpertsShape
from hyper_parallel.moe.npu_ops import NpuExperts, current_npu_ops

__all__ = [
    "FUSED_GMM_OPS",
    "DISTRIBUTE_OPS",
    "PERMUTE_OPS",
    "NpuDistributeDispatcher",
    "NpuFusedGmmDispatcher",
    "NpuPermuteDispatcher",
]

Act = Callable[[Tensor], Tensor]
HALF = (torch.float16, torch.bfloat16)
PERMUTE_OPS = ("npu_moe_token_permute", "npu_moe_token_unpermute")
FUSED_GMM_OPS = ("npu_alltoallv_gmm", "npu_gmm_alltoallv")
DISTRIBUTE_OPS = ("npu_moe_distribute_dispatch_v2", "npu_moe_distribute_combine_v2")
_FUSED_SRC = "torch_npu npu_alltoallv_gmm/npu_gmm_alltoallv docs"
_DIST_SRC = "torch_npu npu_moe_distribute_dispatch_v2/combine_v2 docs"
_NO_BACKWARD = "npu_distribute is inference-only: npu_moe_distribute_* have no backward"


def _ops_refusal(names: Iterable[str]) -> str | None:
    """Why the provider cannot run the ops ``names`` (``None``: it can)."""
    ops, names = current_npu_ops(), tuple(names)
    try:
        why = ops.available(ops=names)  # type: ignore[call-arg]
    except TypeError:  # a provider from before the seam took op names
        why = ops.available()
    if why:
        return str(why)
    missing = [n for n in names if not callable(getattr(ops, n, None))]
    if missing:
        return f"the NPU ops provider ({type(ops).__name__}) has no {', '.join(missing)}"
    return None


def _op(name: str) -> Any:
    return getattr(current_npu_ops(), name)


def _comm_name(handle: DispatchHandle) -> str:
    """The ep group's communicator name, from the provider (cached in the handle)."""
    if "hcom" not in handle.state:
        ops, group = current_npu_ops(), handle.group
        namer = getattr(ops, "comm_name", None)
        if namer is not None:
            handle.state["hcom"] = str(namer(group.pg))
        else:  # torch > 2.0.1's HCCL backend
            backend = group.pg._get_backend(torch.device("npu"))
            handle.state["hcom"] = str(backend.get_hccl_comm_name(group.ranks[group.rank]))
    return str(handle.state["hcom"])


def _soc() -> str | None:
    namer = getattr(current_npu_ops(), "soc_name", None)
    return None if namer is None else namer()


def _is_a3(soc: str | None) -> bool:
    return soc is not None and soc.startswith("Ascend910_93")


def _device() -> tuple[str, ...]:
    return (current_npu_ops().device_type,)


# --- npu_permute ------------------------------------------------------------------------------


class NpuPermuteDispatcher(AllToAllDispatcher):
    """``"npu_permute"``: the all-to-all-v exchanges of ``"alltoall"``; permute and unpermute by
    ``npu_moe_token_permute`` / ``npu_moe_token_unpermute`` (their fallbacks where a call is
    outside the ops' limits: :class:`~hyper_parallel.moe.npu_ops.NpuExperts`); the expert GEMMs
    by ``impl=``."""

    name = "npu_permute"
    _permuter = NpuExperts()

    @property
    def capabilities(self) -> Capabilities:
        if self._override is not None:
            return self._override
        return Capabilities(
            backward=True, device_types=_device(), dtypes=(*HALF, torch.float32),
            platforms="Atlas A2/A3",
            source="torch_npu npu_moe_token_permute/unpermute (backward from op-plugin 7.2.0)",
        )  # fmt: skip

    def __init__(self, capabilities: Capabilities | None = None, name: str | None = None) -> None:
        super().__init__(None, name)
        self._override = capabilities

    def refusal(self, device_type: str, ep: int, shape: ExpertsShape) -> str | None:
        return _ops_refusal(PERMUTE_OPS)

    def dispatch_preprocess(
        self, handle: DispatchHandle, hidden: Tensor, gate_up: Tensor, down: Tensor
    ) -> Tensor:
        handle.gate_up, handle.down = gate_up, down
        handle.anchors = (gate_up[:0], down[:0]) if torch.is_grad_enabled() else ()
        rows, handle.order = self._permuter.permute(hidden, handle.top_k_index)
        handle.state["empty"] = rows[:0]
        return rows

    def combine_postprocess(
        self,
        handle: DispatchHandle,
        back: dict[int, Tensor],
        top_k_weights: Tensor,
        dtype: torch.dtype,
    ) -> Tensor:
        local, handle.local = handle.local, self._permuter  # type: ignore[assignment]
        try:
            return super().combine_postprocess(handle, back, top_k_weights, dtype)
        finally:
            handle.local = local


# --- npu_fused_gmm ----------------------------------------------------------------------------


class _FusedDispatch:
    """Chunk q's dispatch as one ``npu_alltoallv_gmm`` (rows out, gate/up GEMM of the rows in);
    its gradient ``npu_gmm_alltoallv`` on the untransposed weight with the counts swapped."""

    def __init__(self, hcom: str, ep: int, send: list[int], recv: list[int], w: Tensor) -> None:
        self.hcom, self.ep, self.send, self.recv, self.w = hcom, ep, send, recv, w
        self.permute_out: Tensor | None = None
        self._y: Tensor | None = None
        self._dx: Tensor | None = None

    def start(self, x: Tensor) -> None:
        y, _, self.permute_out = _op("npu_alltoallv_gmm")(
            x, self.w, self.hcom, self.ep, self.send, self.recv,
            trans_gmm_weight=True, permute_out_flag=True,
        )  # fmt: skip
        self._y = y

    def finish(self) -> Tensor:
        y, self._y = self._y, None
        assert y is not None, "npu_fused_gmm dispatch: nothing started"
        return y

    def start_grad(self, grad: Tensor) -> None:
        self._dx, _ = _op("npu_gmm_alltoallv")(
            grad, self.w, self.hcom, self.ep, self.recv, self.send, trans_gmm_weight=False
        )

    def finish_grad(self) -> Tensor:
        dx, self._dx = self._dx, None
        assert dx is not None, "npu_fused_gmm dispatch: no gradient started"
        return dx


class _FusedCombine:
    """Chunk q's combine as one ``npu_gmm_alltoallv`` (down GEMM, rows back); its gradient
    ``npu_alltoallv_gmm`` on the untransposed weight, keeping the permuted output gradient for
    the weight's gradient."""

    def __init__(self, hcom: str, ep: int, send: list[int], recv: list[int], w: Tensor) -> None:
        self.hcom, self.ep, self.send, self.recv, self.w = hcom, ep, send, recv, w
        self.permute_grad: Tensor | None = None
        self._y: Tensor | None = None
        self._dz: Tensor | None = None

    def start(self, z: Tensor) -> None:
        self._y, _ = _op("npu_gmm_alltoallv")(
            z, self.w, self.hcom, self.ep, self.send, self.recv, trans_gmm_weight=True
        )

    def finish(self) -> Tensor:
        y, self._y = self._y, None
        assert y is not None, "npu_fused_gmm combine: nothing started"
        return y

    def start_grad(self, grad: Tensor) -> None:
        self._dz, _, self.permute_grad = _op("npu_alltoallv_gmm")(
            grad, self.w, self.hcom, self.ep, self.recv, self.send,
            trans_gmm_weight=False, permute_out_flag=True,
        )  # fmt: skip

    def finish_grad(self) -> Tensor:
        dz, self._dz = self._dz, None
        assert dz is not None, "npu_fused_gmm combine: no gradient started"
        return dz


def _per_expert(a: Tensor, b: Tensor, counts: list[int], w: Tensor) -> Tensor:
    """``out[e] = a_eᵀ @ b_e`` over the row groups of ``counts`` (the shape of ``w``)."""
    out = w.new_zeros(w.shape)
    start = 0
    for e, m in enumerate(counts):
        if m:
            out[e] = (a[start : start + m].t() @ b[start : start + m]).to(w.dtype)
        start += m
    return out


class _GateUpGrad(torch.autograd.Function):
    """Identity on the dispatch's GEMM output ``h``; backward adds ``gate_up``'s gradient
    ``d gate_up[e] = dh_eᵀ @ permute_out_e`` (local work)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, h: Tensor, w: Tensor, ex: _FusedDispatch, counts: list[int]
    ) -> Tensor:
        ctx.ex, ctx.counts = ex, counts
        ctx.save_for_backward(w)
        return h.view_as(h)

    @staticmethod
    def backward(ctx: Any, dh: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        (w,) = ctx.saved_tensors
        dw = None
        if ctx.needs_input_grad[1]:
            assert ctx.ex.permute_out is not None
            dw = _per_expert(dh, ctx.ex.permute_out, ctx.counts, w)
        return dh, dw, None, None


class _DownGrad(torch.autograd.Function):
    """Identity on the combine's GEMM input ``z``; backward adds ``down``'s gradient
    ``d down[e] = permute_grad_eᵀ @ z_e`` (the permuted output gradient the combine's gradient
    exchange kept; local work)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, z: Tensor, w: Tensor, ex: _FusedCombine, counts: list[int]
    ) -> Tensor:
        ctx.ex, ctx.counts = ex, counts
        ctx.save_for_backward(z, w)
        return z.view_as(z)

    @staticmethod
    def backward(ctx: Any, dz: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        z, w = ctx.saved_tensors
        dw = None
        if ctx.needs_input_grad[1]:
            assert ctx.ex.permute_grad is not None
            dw = _per_expert(ctx.ex.permute_grad, z, ctx.counts, w)
        return dz, dw, None, None


class NpuFusedGmmDispatcher(AllToAllDispatcher):
    """``"npu_fused_gmm"``: dispatch fused with the gate/up grouped GEMM
    (``npu_alltoallv_gmm``), combine with the down grouped GEMM (``npu_gmm_alltoallv``); the
    activation between them; its own backward (see the module docstring). Chunked like
    ``"alltoall"`` (each chunk's counts per (rank, expert) from the plan). ``impl=`` only
    chooses the permute/unpermute around them."""

    name = "npu_fused_gmm"
    EP_SIZES = (8, 16, 32, 64, 128)

    def __init__(self, capabilities: Capabilities | None = None, name: str | None = None) -> None:
        super().__init__(None, name)
        self._override = capabilities

    @property
    def capabilities(self) -> Capabilities:
        if self._override is not None:
            return self._override
        return Capabilities(
            backward=True, device_types=_device(), ep_sizes=self.EP_SIZES, max_local_experts=32,
            max_experts=256, max_hidden=65535, dtypes=HALF, fuses_expert_gemms=True,
            platforms="Atlas A3 only", source=_FUSED_SRC,
        )  # fmt: skip

    def refusal(self, device_type: str, ep: int, shape: ExpertsShape) -> str | None:
        why = _ops_refusal(FUSED_GMM_OPS)
        if why:
            return why
        soc = _soc()
        if soc is not None and not _is_a3(soc):
            return f"its ops run on Atlas A3 only (Ascend910_93xx), not {soc} ({_FUSED_SRC})"
        if 2 * shape.intermediate >= 65536 or shape.intermediate >= 65536:
            return f"the GEMM widths must be < 65536 (2I={2 * shape.intermediate}; {_FUSED_SRC})"
        return None

    def dispatch_start(self, handle: DispatchHandle, q: int, rows: Tensor) -> Tensor:
        plan = handle.plan
        assert handle.gate_up is not None
        ex = _FusedDispatch(
            _comm_name(handle), plan.size, plan.send_counts_by_expert(q),
            plan.recv_counts_by_expert(q), handle.gate_up.detach(),
        )  # fmt: skip
        handle.state[("dispatch", q)] = ex
        return launch(ex, _rows_of(rows, plan.send_ranges(q)), *handle.anchors)

    def dispatch_finish(self, handle: DispatchHandle, q: int, token: Tensor) -> Tensor:
        handle.state[("fused", q)] = ex = handle.state.pop(("dispatch", q))
        return wait(ex, token)

    def dispatch_postprocess(
        self, handle: DispatchHandle, q: int, received: Tensor
    ) -> tuple[Tensor, list[int]]:
        """Local: the received rows are already expert-major and through gate/up; the tap
        that gives ``gate_up`` its gradient."""
        counts, _ = handle.plan.received_by_expert(q)
        for e, n in enumerate(counts):
            handle.rows[e] += n
        handle.state[("counts", q)] = counts
        ex = handle.state.pop(("fused", q))
        return _GateUpGrad.apply(received, handle.gate_up, ex, counts), counts

    def experts(
        self, handle: DispatchHandle, q: int, x: Tensor, counts: list[int], act: Act
    ) -> Tensor:
        """Local: the activation between the two fused GEMMs."""
        gate, up = x.chunk(2, dim=-1)
        return act(gate) * up

    def combine_preprocess(self, handle: DispatchHandle, q: int, y: Tensor) -> Tensor:
        plan = handle.plan
        assert handle.down is not None
        ex = _FusedCombine(
            _comm_name(handle), plan.size, plan.recv_counts_by_expert(q),
            plan.send_counts_by_expert(q), handle.down.detach(),
        )  # fmt: skip
        handle.state[("combine", q)] = ex
        counts = handle.state.pop(("counts", q))
        return _DownGrad.apply(y.contiguous(), handle.down, ex, counts)

    def combine_start(self, handle: DispatchHandle, q: int, y: Tensor) -> Tensor:
        return launch(handle.state[("combine", q)], y, *handle.anchors)


# --- npu_distribute ---------------------------------------------------------------------------


class _DistributeDispatch:
    """The one dispatch of ``npu_moe_distribute_dispatch_v2`` (no backward)."""

    def __init__(self, kwargs: dict[str, Any], expert_ids: Tensor) -> None:
        self.kwargs, self.expert_ids = kwargs, expert_ids
        self.outs: tuple[Tensor, ...] = ()

    def start(self, x: Tensor) -> None:
        self.outs = tuple(_op("npu_moe_distribute_dispatch_v2")(x, self.expert_ids, **self.kwargs))

    def finish(self) -> Tensor:
        return self.outs[0]

    def start_grad(self, grad: Tensor) -> None:
        raise RuntimeError(
            "npu_distribute is inference-only: npu_moe_distribute_* have no backward"
        )

    def finish_grad(self) -> Tensor:
        raise RuntimeError(
            "npu_distribute is inference-only: npu_moe_distribute_* have no backward"
        )


class _DistributeCombine:
    """The one combine of ``npu_moe_distribute_combine_v2`` (no backward)."""

    def __init__(self, d: _DistributeDispatch, weights: Tensor) -> None:
        self.d, self.weights = d, weights
        self._out: Tensor | None = None

    def start(self, y: Tensor) -> None:
        outs, kw = self.d.outs, self.d.kwargs
        self._out = _op("npu_moe_distribute_combine_v2")(
            y, self.d.expert_ids, outs[2], outs[4], self.weights, kw["group_ep"],
            kw["ep_world_size"], kw["ep_rank_id"], kw["moe_expert_num"],
            shared_expert_num=0, global_bs=kw["global_bs"],
        )  # fmt: skip

    def finish(self) -> Tensor:
        out, self._out = self._out, None
        assert out is not None
        return out

    start_grad = _DistributeDispatch.start_grad
    finish_grad = _DistributeDispatch.finish_grad


class NpuDistributeDispatcher(AllToAllDispatcher):
    """``"npu_distribute"``: ``npu_moe_distribute_dispatch_v2`` / ``combine_v2``, inference
    only (refused on every rank when gradients are needed). One exchange each way (no chunks);
    combine does the weighted sum over the slots; the expert GEMMs by ``impl=``. Its limits
    are Atlas A3's where the provider names an A3 SoC, else Atlas A2's (the stricter)."""

    name = "npu_distribute"

    def __init__(self, capabilities: Capabilities | None = None, name: str | None = None) -> None:
        super().__init__(None, name)
        self._override = capabilities

    @property
    def capabilities(self) -> Capabilities:
        if self._override is not None:
            return self._override
        if _is_a3(_soc()):
            return Capabilities(
                backward=False, device_types=_device(), ep_sizes=tuple(range(2, 769)),
                max_experts=1024, max_tokens_per_rank=512, min_tokens_per_rank=1,
                max_hidden=8192, dtypes=HALF, chunks=False, platforms="Atlas A3",
                source=_DIST_SRC,
            )  # fmt: skip
        return Capabilities(
            backward=False, device_types=_device(), ep_sizes=(16, 32, 64, 128, 256),
            max_local_experts=24, max_experts=1024, max_tokens_per_rank=256,
            min_tokens_per_rank=1, max_hidden=7168, dtypes=HALF, chunks=False,
            platforms="Atlas A2", source=_DIST_SRC,
        )  # fmt: skip

    def refusal(self, device_type: str, ep: int, shape: ExpertsShape) -> str | None:
        return _ops_refusal(DISTRIBUTE_OPS)

    def exchange_plan(self, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                      *args: Any, **kwargs: Any) -> DispatchHandle:  # fmt: skip
        handle = super().exchange_plan(hidden, top_k_index, top_k_weights, *args, **kwargs)
        handle.state["weights"] = top_k_weights
        return handle

    def dispatch_preprocess(
        self, handle: DispatchHandle, hidden: Tensor, gate_up: Tensor, down: Tensor
    ) -> Tensor:
        """Local: nothing to sort (the op routes whole tokens)."""
        handle.gate_up, handle.down = gate_up, down
        return hidden

    def dispatch_start(self, handle: DispatchHandle, q: int, rows: Tensor) -> Tensor:
        plan = handle.plan
        max_bs = max(plan.tokens(s, handle.top_k) for s in range(plan.size))
        kwargs = dict(
            group_ep=_comm_name(handle), ep_world_size=plan.size, ep_rank_id=plan.rank,
            moe_expert_num=handle.shape.num_experts, shared_expert_num=0,
            global_bs=max_bs * plan.size, expert_token_nums_type=1,
        )  # fmt: skip
        ex = handle.state["dispatch"] = _DistributeDispatch(kwargs, handle.top_k_index.int())
        return launch(ex, rows)

    def dispatch_finish(self, handle: DispatchHandle, q: int, token: Tensor) -> Tensor:
        return wait(handle.state["dispatch"], token)

    def dispatch_postprocess(
        self, handle: DispatchHandle, q: int, received: Tensor
    ) -> tuple[Tensor, list[int]]:
        """Local: the rows past the local experts' counts are the op's padding."""
        counts, _ = handle.plan.received_by_expert(q)
        for e, n in enumerate(counts):
            handle.rows[e] += n
        handle.state["padded"] = received.shape[0]
        return received[: sum(counts)], counts

    def combine_preprocess(self, handle: DispatchHandle, q: int, y: Tensor) -> Tensor:
        pad = handle.state["padded"] - y.shape[0]
        return torch.cat([y, y.new_zeros(pad, y.shape[1])]) if pad else y

    def combine_start(self, handle: DispatchHandle, q: int, y: Tensor) -> Tensor:
        weights = handle.state["weights"].float()
        ex = handle.state["combine"] = _DistributeCombine(handle.state["dispatch"], weights)
        return launch(ex, y)

    def combine_finish(self, handle: DispatchHandle, q: int, token: Tensor) -> Tensor:
        return wait(handle.state["combine"], token)

    def combine_postprocess(
        self,
        handle: DispatchHandle,
        back: dict[int, Tensor],
        top_k_weights: Tensor,
        dtype: torch.dtype,
    ) -> Tensor:
        """Local: combine already weighted and summed; the hidden dtype."""
        return back[0].to(dtype)


register_dispatcher(NpuPermuteDispatcher())
register_dispatcher(NpuFusedGmmDispatcher())
register_dispatcher(NpuDistributeDispatcher())
