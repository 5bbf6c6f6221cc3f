"""The MoE blocks of a parallelised model: experts split over ep ranks (hp-moe), the shared
experts under the dispatch, the routing counts, and DeepSeek-V3's auxiliary-loss-free balancing.

Meshes: the ``dp·cp·tp`` ranks of one global batch, flattened innermost first (tp, then cp,
then dp: :attr:`SequenceMesh.batch`), are cut into groups of ``ep`` consecutive ranks (so a
group prefers ranks that share a node): ``ep`` = one group, the ranks that split one MoE layer's
experts; ``edp`` = the ``dp·cp·tp/ep`` ranks holding the same experts (expert data
parallelism). Both come from one :func:`hyper_parallel.dtensor.unflatten` of the batch mesh.

Per MoE block (``DeepseekV3MoE`` / ``KimiLinearMoE``: ``gate``, ``experts``,
``shared_experts``; ``Qwen3NextSparseMoeBlock``: the gated ``shared_expert`` and
``shared_expert_gate``), with ``ep > 1``:

- ``experts``: ``hyper_parallel.moe.parallelize_experts(experts, ep)``; rank r keeps experts
  ``r_ep·E/ep …``; each expert's gradient is summed over its ``edp`` ranks (FSDP2 over ``edp``,
  or ``sync_gradients``' all-reduce over ``edp``); the router and the shared experts stay whole
  on every rank (summed over every rank, like every other whole parameter);
- the block's forward is the stock one with the shared experts run while the first dispatch
  is in flight (``hyper_parallel.moe.moe_block_forward``).

With any ``ep`` (1 included) each experts module records the per-expert counts of this rank's
``top_k_index`` at every forward; :func:`balance_experts` sums them over the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from hyper_parallel.dtensor import DeviceMesh, comm, unflatten
from hyper_parallel.dtensor.rewrite import install_forward, parallel_state
from hyper_parallel.models.state import OWNER, pipeline_parts, plan_of
from hyper_parallel.moe import moe_block_forward, parallelize_experts, shared_work
from hyper_parallel.moe.dispatch import dispatcher_label, resolve_dispatcher

__all__ = ["MoEState", "balance_experts", "check_ep", "expert_meshes", "install_moe"]

MOE_LAYER = "hp-models-moe"  # the rewrite's layer name of a MoE block with split experts


@dataclass
class MoEState:
    """The experts of a parallelised model: ``ep``, the meshes (``None`` at ep = 1) and the
    last forward's local per-expert counts of each MoE block (by module path); with
    ``accumulate`` (a pipeline's stages), the counts of every forward since they were last
    cleared (the micro-batches of one step)."""

    ep: int = 1
    ep_mesh: DeviceMesh | None = None
    edp_mesh: DeviceMesh | None = None
    counts: dict[str, Tensor] = field(default_factory=dict)
    accumulate: bool = False
    dispatcher: Any = "alltoall"  # hp-moe's dispatcher of every MoE block (a name or object)
    overlap: bool = True  # hp-moe's in-layer overlap (False: every exchange waited at once)
    chunks: int | str = "auto"  # hp-moe's chunks (resolved by resolve_moe_chunks)


def num_experts(block: nn.Module) -> int:
    weight: Any = block.get_submodule("experts").gate_up_proj
    return int(weight.shape[0])


def resolve_moe_chunks(moe_chunks: Any, overlap: bool) -> int | str:
    """``moe_chunks`` as hp-moe's ``chunks``: an int >= 1 as given; ``"auto"``: hp-moe's own
    choice (:func:`hyper_parallel.moe.choose_chunks`) where the layers overlap in-layer, one
    chunk where they do not (``overlap=False``: a blocking exchange gains nothing from chunks,
    only their copies and per-exchange costs). ``ValueError`` otherwise, collective-free."""
    if moe_chunks == "auto":
        return "auto" if overlap else 1
    if isinstance(moe_chunks, bool) or not isinstance(moe_chunks, int) or moe_chunks < 1:
        raise ValueError(f"moe_chunks must be 'auto' or an int >= 1, got {moe_chunks!r}")
    return moe_chunks


def check_dispatcher(dispatcher: Any, ep: Any) -> None:
    """``dispatcher`` names one of hp-moe's dispatchers or is one (``ValueError`` /
    ``TypeError`` from hp-moe otherwise), and is the default where there is nothing to
    dispatch (ep = 1): collective-free, the same on every rank."""
    resolve_dispatcher(dispatcher)
    if ep == 1 and not (isinstance(dispatcher, str) and dispatcher == "alltoall"):
        raise ValueError(
            f"dispatcher={dispatcher_label(dispatcher)!r} moves rows between the ranks of an ep "
            "group: it needs ep > 1 (at ep = 1 every rank runs every expert on its own tokens)"
        )


def check_ep(ep: Any, batch_size: int, moe_blocks: dict[str, nn.Module]) -> None:
    """``ep`` divides the ranks of the batch and every MoE block's expert count (``TypeError``
    / ``ValueError`` otherwise; collective-free, the same on every rank)."""
    if isinstance(ep, bool) or not isinstance(ep, int):
        raise TypeError(f"ep must be an int, got {ep!r}")
    if ep < 1 or batch_size % ep:
        raise ValueError(
            f"ep={ep} must be a positive divisor of the dp·cp·tp = {batch_size} ranks of the batch"
        )
    for path, block in moe_blocks.items():
        if num_experts(block) % ep:
            raise ValueError(
                f"{path}: {num_experts(block)} routed experts cannot be split evenly over ep={ep}"
            )


def expert_meshes(batch: DeviceMesh, ep: int) -> tuple[DeviceMesh, DeviceMesh]:
    """``(ep, edp)``: the batch mesh's ranks in groups of ``ep`` consecutive ranks, and the
    ranks holding the same experts."""
    name = (batch.mesh_dim_names or ("batch",))[0]
    split = unflatten(batch, name, (batch.size() // ep, ep), ("edp", "ep"))
    return split["ep"], split["edp"]


def _record(state: MoEState, path: str, index: Any, experts: int) -> None:
    if isinstance(index, Tensor) and not index.dtype.is_floating_point:
        flat = index.detach().reshape(-1)
        counts = torch.bincount(flat.clamp(0, experts - 1), minlength=experts)
        if state.accumulate and path in state.counts:  # the micro-batches of one step
            counts = counts + state.counts[path]
        state.counts[path] = counts


def _record_counts(state: MoEState, path: str) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
        weight: Any = module.gate_up_proj
        _record(state, path, args[1] if len(args) > 1 else None, int(weight.shape[0]))

    return hook


@dataclass(frozen=True)
class _BlockState:
    moe: MoEState
    path: str


def _moe_forward(original: type) -> Any:
    def forward(self: Any, hidden_states: Tensor) -> Tensor:
        st: _BlockState = parallel_state(self, MOE_LAYER)
        experts = num_experts(self)
        return moe_block_forward(
            self, hidden_states, on_routing=lambda index: _record(st.moe, st.path, index, experts)
        )

    return forward


def install_moe(state: MoEState, base: nn.Module, moe_paths: list[str]) -> None:
    """Split the experts of every MoE block over ``state.ep_mesh`` (when ep > 1) and record
    every experts module's routing counts."""
    for path in moe_paths:
        block = base.get_submodule(path)
        experts = block.get_submodule("experts")
        if state.ep > 1:
            parallelize_experts(
                experts, state.ep_mesh, dispatcher=state.dispatcher, overlap=state.overlap,
                chunks=state.chunks,
            )  # fmt: skip
        if state.ep > 1 and shared_work(block) is not None:
            install_forward(block, MOE_LAYER, _BlockState(state, path), _moe_forward, prefix="")
        else:  # the stock block forward calls the experts module: count in a pre-hook
            experts.register_forward_pre_hook(_record_counts(state, path))


def _check_rate(rate: Any) -> None:
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not (rate >= 0):
        raise ValueError(f"balance_experts: rate must be a finite number >= 0, got {rate!r}")
    if rate == float("inf"):
        raise ValueError("balance_experts: rate must be finite")


def balance_experts(model: Any, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing, which transformers never applies in
    training: for every MoE router of a model parallelised by ``parallelize_model``,
    ``e_score_correction_bias += rate · sign(mean(load) − load)``, ``load[e]`` being the
    (token, expert) assignments of the last forward over the **whole global batch** (every rank
    of dp × cp × tp: one all-reduce of every layer's counts), so the bias is identical on every
    rank. Call after the step (every rank); the bias only shifts which experts are chosen,
    never the routing weights. A :class:`~hyper_parallel.models.PipelinedModel`: the loads of
    every micro-batch of the last step, each stage over its own ranks (a stage without MoE
    layers does nothing). A router without ``e_score_correction_bias`` is left alone.
    ``RuntimeError`` before the first forward; ``ValueError`` for a rate that is not a finite
    number ``>= 0``."""
    parts = pipeline_parts(model)
    if parts is not None:  # each stage over its own ranks; a stage without MoE does nothing
        _check_rate(rate)
        for part in parts:
            balance_experts(part, rate)
        return
    plan = plan_of(model, "balance_experts")
    _check_rate(rate)
    state: MoEState = plan.moe
    paths = [p for p, role in plan.roles.items() if role.routed]
    if not paths:
        return
    missing = [p for p in paths if p not in state.counts]
    if missing:
        raise RuntimeError(f"balance_experts: no forward has routed tokens yet ({missing})")
    from hyper_parallel.models.families import family_of

    _, base = family_of(model)
    loads = torch.cat([state.counts[p].to(torch.float64) for p in paths])
    if plan.mesh.batch.size() > 1:
        grp = comm.resolve_group(plan.mesh.batch, "balance_experts")
        loads = comm.start_all_reduce(loads, grp, "all_reduce:expert_load", "step", OWNER).wait()
    offset = 0
    for p in paths:
        router = base.get_submodule(p).get_submodule("gate")
        n = state.counts[p].numel()
        load = loads[offset : offset + n]
        offset += n
        bias = getattr(router, "e_score_correction_bias", None)
        if not isinstance(bias, Tensor):
            continue
        step = rate * torch.sign(load.mean() - load)
        with torch.no_grad():
            bias.add_(step.to(device=bias.device, dtype=bias.dtype))
