"""``pipeline_model``: a stock causal LM cut into pipeline stages over a ``"pp"`` mesh dim, each
stage parallelised by ``parallelize_model`` over its ``(dp, cp, tp)`` ranks, run by
torch.distributed.pipelining's schedules.

Mesh: ``("pp", "cp", "tp")`` or ``("pp", "dp", "cp", "tp")``, pp first. The ranks of one pp
coordinate are one ``(dp,) cp, tp`` mesh (``mesh[dims[1:]]``) holding the same stages; the
ranks of one ``(dp, cp, tp)`` coordinate form the pp group the stages send activations over
(torch's ``PipelineStage`` point-to-point). A mesh without ``"pp"`` is pp = 1: the
micro-batches of one step run one after another (gradient accumulation in one call).

A step (:meth:`PipelinedModel.step`) takes the global batch, identical on every rank, cuts it
into ``m`` micro-batches of ``B/m`` rows (micro-batch ``k``: rows ``[k·B/m, (k+1)·B/m)``), and
each micro-batch into this rank's block with ``shard_batch`` (the dp replica's rows, the
sequence block; its document table rides along). The loss of micro-batch ``k`` on the last
stage is its targets' summed cross-entropy over ``N``, the number of targets of the WHOLE
global batch (counted on every rank from the labels it was given, no collective), so the
micro-batches' losses add up to the global batch's mean, not a mean of micro-batch means; the
schedule runs with ``scale_grads=False``. The loss is then summed over the pp group (the last
stage's holder gives it to every rank).

Gradients: FSDP2 per stage with ``reshard_after_forward=False`` (each stage's parameters are
gathered once a step, not once a micro-batch; torch's stage keeps gradient sync off until the
last micro-batch) or, with ``grad_reduction="allreduce"``,
:func:`~hyper_parallel.models.sync_gradients` after the step. Every parameter lives in exactly
one stage: no pipeline-dim reduction is needed.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch import Tensor, nn

from hyper_parallel.dtensor import DeviceMesh, checked_entry, comm
from hyper_parallel.dtensor.mesh import native_path_available, root_mesh
from hyper_parallel.models.batch import IGNORE_INDEX, shard_batch
from hyper_parallel.models.documents import TABLE_KEYS
from hyper_parallel.models.experts import check_dispatcher, resolve_moe_chunks
from hyper_parallel.models.families import family_of
from hyper_parallel.models.mesh import DP_MESH_DIMS, MESH_DIMS, check_mesh, cp_tp
from hyper_parallel.models.parallelize import _roles, apply_parallel
from hyper_parallel.models.pipeline.interleave import hold_backward_end, run_interleaved, segment
from hyper_parallel.models.pipeline.p2p import every_work
from hyper_parallel.models.pipeline.schedules import (
    ScheduleSpec,
    check_schedule,
    schedule_class,
    stages_of_rank,
)
from hyper_parallel.models.pipeline.split import (
    balanced_split,
    check_layer_split,
    decoder_layers,
    layer_costs,
    stage_ranges,
)
from hyper_parallel.models.pipeline.stages import Feed, StageModule, stage_model
from hyper_parallel.models.state import OWNER, plan_of
from hyper_parallel.moe.dispatch import dispatcher_label

__all__ = ["FORWARD_BACKWARD", "PipelinedModel", "pipeline_model", "split_mesh"]

#: ``pipeline_model(..., overlap=FORWARD_BACKWARD)``: micro-batch i+1's forward interleaved
#: with micro-batch i's backward (:mod:`hyper_parallel.models.pipeline.interleave`)
FORWARD_BACKWARD = "forward_backward"

_PP_DIMS = (("pp", *MESH_DIMS), ("pp", *DP_MESH_DIMS))


def split_mesh(mesh: Any) -> tuple[DeviceMesh | None, DeviceMesh]:
    """``(pp mesh or None, the stage mesh)`` of a pipeline mesh: ``("pp", "cp", "tp")`` or
    ``("pp", "dp", "cp", "tp")`` gives ``mesh["pp"]`` and ``mesh[dims[1:]]``; a mesh without
    ``"pp"`` (``("cp", "tp")`` / ``("dp", "cp", "tp")``) is pp = 1. ``ValueError`` for a
    ``"pp"`` that is not first or other dims; collective-free."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch DeviceMesh, got {type(mesh).__name__}")
    names = tuple(mesh.mesh_dim_names or ())
    if "pp" not in names:
        return None, check_mesh(mesh)
    if names not in _PP_DIMS:
        raise ValueError(
            f'a pipeline mesh has dims {_PP_DIMS[0]} or {_PP_DIMS[1]}, "pp" first (stages '
            f"outermost); got dims {names}"
        )
    return mesh["pp"], _stage_mesh(mesh, names[1:])


def _stage_mesh(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """``mesh[names]``, the ranks of this rank's pp coordinate. Where torch cannot slice a slice
    (torch < 2.10, hp-dtensor's fallback path: "Cannot create a submesh from a submesh"), the
    same ranks and groups as a mesh of its own instead (``DeviceMesh.from_group``, never
    sliced from ``mesh``: torch would take an equal slice for a child), whose root for
    hp-dtensor stays ``mesh``'s (``_hp_root``, which :func:`hyper_parallel.dtensor.root_mesh`
    follows), so every flatten and unflatten of a stage's dims lays its groups out over the
    whole job, the same on every rank."""
    if native_path_available():
        return mesh[names]
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError("this rank is not part of the mesh")
    groups = [mesh.get_group(d) for d in range(1, mesh.ndim)]
    ranks = mesh.mesh[coord[0]].clone()
    stage = DeviceMesh.from_group(groups, mesh.device_type, mesh=ranks, mesh_dim_names=names)
    stage._hp_root = root_mesh(mesh)  # type: ignore[attr-defined]
    try:
        stage[names[0]]
    except RuntimeError:  # an equal mesh (same ranks and names) sliced earlier in this process
        # made torch < 2.10 take this one for that child: it is a root of its own
        from torch.distributed.device_mesh import _mesh_resources

        getattr(_mesh_resources, "child_to_root_mapping", {}).pop(stage, None)
    return stage


def _device(mesh: DeviceMesh) -> torch.device:
    kind = mesh.device_type
    if kind == "cpu":
        return torch.device("cpu")
    module = getattr(torch, kind, None)
    index = module.current_device() if module is not None else 0
    return torch.device(kind, index)


def _warm_groups(model: nn.Module, stage_mesh: DeviceMesh, kda_protocol: str) -> None:
    """Create, on every rank, the process groups a stage's layers create while being
    parallelised, so that stages holding different layer kinds create the same groups in the
    same order (``new_group`` involves every process): the delta-rule layers' grouped state
    exchange (``"grouped"`` / ``"auto"`` over 4 or more ranks)."""
    fam, base = family_of(model)
    delta = any(
        fam.role_of(block).name in ("kda", "gdn")
        for i, layer in enumerate(decoder_layers(base))
        for _, block in fam.layer_blocks(layer, i)
    )
    if not delta or kda_protocol not in ("auto", "grouped"):
        return
    from hyper_parallel.kda import build_state_exchange
    from hyper_parallel.models.mesh import sequence_mesh

    flat = sequence_mesh(stage_mesh).flat
    if flat.size() >= 4:
        build_state_exchange(flat, kda_protocol)


class PipelinedModel:
    """This rank's pipeline stages of a stock causal LM (see the module docstring), made by
    :func:`pipeline_model`.

    ``parts``: this rank's stages as parallelised stock ``*ForCausalLM`` modules holding only
    their own layers (in stage order); ``stages``: their indices; ``layers``: the decoder
    layers of every stage of the pipeline (``layers[s]`` the range of stage ``s``);
    ``pp``/``microbatches``/``schedule`` as given; ``mesh`` the whole pipeline's mesh."""

    def __init__(
        self,
        parts: list[nn.Module],
        mesh: DeviceMesh,
        stages: list[int],
        layers: list[range],
        pp_mesh: DeviceMesh | None,
        stage_mesh: DeviceMesh,
        microbatches: int,
        spec: ScheduleSpec,
        overlap: bool | str = True,
    ) -> None:
        self.parts = parts
        self.overlap = overlap
        self.mesh = mesh
        self.stages = stages
        self.layers = layers
        self.pp_mesh = pp_mesh
        self.stage_mesh = stage_mesh
        self.microbatches = microbatches
        self.schedule = spec.name
        self._spec = spec
        self._feed = Feed()
        self._modules = [
            StageModule(part, s, s == 0, s == len(layers) - 1, self._feed)
            for part, s in zip(parts, stages)
        ]
        for mod in self._modules:  # torch's stage drives FSDP2 through the module it runs
            plan = plan_of(mod.part, "pipeline_model")
            if plan.moe is not None:  # balance_experts: the loads of every micro-batch
                plan.moe.accumulate = True
            if plan.grad_reduction == "fsdp":
                from torch.distributed.fsdp import fully_shard

                fully_shard(mod, mesh=plan.mesh.fsdp_mesh, reshard_after_forward=False)
        self._runner: Any = None
        self._shape: tuple[Any, ...] | None = None
        #: with ``overlap="forward_backward"``: for each interleaved pair of the last step
        #: (micro-batch k's forward with k−1's backward), how often the two handed over
        self.switches: list[int] = []
        self.__hp_pipeline__ = True

    # -- what the rank holds ------------------------------------------------------------------

    @property
    def pp(self) -> int:
        return 1 if self.pp_mesh is None else self.pp_mesh.size()

    @property
    def num_stages(self) -> int:
        return len(self.layers)

    def named_parameters(self, prefix: str = "", recurse: bool = True) -> Iterator[Any]:
        """This rank's parameters under the stock model's names (``model.layers.7.mlp...``)."""
        for part in self.parts:
            yield from part.named_parameters(prefix=prefix, recurse=recurse)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def state_dict(self) -> dict[str, Any]:
        """This rank's stages' state dicts merged (stock keys; every key held by one stage), for
        ``torch.distributed.checkpoint``: saved from one pipeline, it loads into another of any
        pp, split and mesh (each rank reads the keys of its stages)."""
        out: dict[str, Any] = {}
        for part in self.parts:
            out.update(part.state_dict())
        return out

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Load this rank's keys of ``state_dict`` into its stages (``strict``: every key of
        the stages present, no key left over)."""
        used: set[str] = set()
        for part in self.parts:
            own = part.state_dict()
            part.load_state_dict({k: state_dict[k] for k in own if k in state_dict}, strict=strict)
            used |= set(own)
        extra = sorted(set(state_dict) - used)
        if strict and extra:
            raise KeyError(f"keys of no stage of this rank: {extra[:5]}")

    def save_pretrained(self, save_directory: Any, **kwargs: Any) -> None:
        """Write the whole model as one plain Hugging Face folder (the hub layout, stock
        keys) from every rank of the pipeline, no rank gathering more than one tensor of its
        own stage at a time (``save_pretrained`` of a parallelised model, over every stage:
        :func:`hyper_parallel.models.checkpoint.save_pipeline`). Call on every rank; the same
        options and errors as a parallelised model's ``save_pretrained``."""
        from hyper_parallel.dtensor import flatten
        from hyper_parallel.models.checkpoint import save_pipeline

        job = self.mesh if self.mesh.ndim == 1 else flatten(self.mesh)
        save_pipeline(self.parts, job, save_directory, **kwargs)

    def train(self, mode: bool = True) -> PipelinedModel:
        for part in self.parts:
            part.train(mode)
        return self

    def eval(self) -> PipelinedModel:
        return self.train(False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        spans = ", ".join(
            f"stage {s}: layers {r.start}-{r.stop - 1}" for s, r in enumerate(self.layers)
        )
        return (
            f"PipelinedModel(pp={self.pp}, schedule={self.schedule!r}, "
            f"microbatches={self.microbatches}, this rank's stages {self.stages}; {spans})"
        )

    # -- one step -----------------------------------------------------------------------------

    def _micro_batches(self, batch: dict[str, Tensor]) -> tuple[list[dict[str, Tensor]], int]:
        """Every check of a step (collective-free, the same verdict on every rank), then this
        rank's block of each micro-batch and the global target count."""
        ids = batch.get("input_ids")
        labels = batch.get("labels")
        if not isinstance(ids, Tensor) or ids.dim() != 2:
            raise ValueError("PipelinedModel.step needs input_ids as a [B, T] tensor")
        if not isinstance(labels, Tensor) or tuple(labels.shape) != tuple(ids.shape):
            raise ValueError(
                "PipelinedModel.step trains: it needs labels [B, T] (unshifted, -100 where no "
                "loss is taken), the same shape as input_ids"
            )
        bsz = ids.shape[0]
        m = self.microbatches
        names = tuple(self.stage_mesh.mesh_dim_names or ())
        dp = self.stage_mesh.size(0) if names[0] == "dp" else 1
        if bsz % (m * dp):
            raise ValueError(
                f"batch size B={bsz} does not divide into microbatches·dp = {m}·{dp} = {m * dp}"
                ": each micro-batch takes B/microbatches rows and each dp replica B/(m·dp) of "
                "them"
            )
        count = int((labels[:, 1:] != IGNORE_INDEX).sum())
        if count == 0:
            raise ValueError("PipelinedModel.step: no label of the global batch is a target")
        tables = sorted(k for k in TABLE_KEYS[:2] if batch.get(k) is not None)
        if tables and m > 1:
            raise ValueError(
                f"PipelinedModel.step: {tables} describe the documents of one packed row, but "
                f"the batch is cut into {m} micro-batches of their own rows; give packed rows "
                "with position_ids restarting at 0 at every document (each row's documents "
                "are read from its own positions)"
            )
        rows = bsz // m
        micro: list[dict[str, Tensor]] = []
        for k in range(m):
            part = {}
            for key, value in batch.items():
                if key == "position_ids" and value is not None and value.shape[0] == 1:
                    part[key] = value
                elif isinstance(value, Tensor) and value.dim() == 2 and value.shape[0] == bsz:
                    part[key] = value[k * rows : (k + 1) * rows]
                else:
                    part[key] = value
            micro.append(shard_batch(part, self.stage_mesh))
        return micro, count

    def _build(self, first: Tensor, hidden_dtype: torch.dtype) -> Any:
        """torch's stages and schedule for micro-batches whose first-stage input is ``first``
        (one micro-batch's token ids ``[b, S]``)."""
        from torch.distributed.pipelining import PipelineStage

        b, s = first.shape
        hidden = int(cast(Any, self.parts[0]).config.hidden_size)
        device = _device(self.stage_mesh)
        if self.pp_mesh is not None:
            group = self.pp_mesh.get_group()
        else:  # pp = 1: a pipeline of one stage, each rank its own (a group of one)
            from hyper_parallel.dtensor.groups import group_for

            group = group_for([[r] for r in range(torch.distributed.get_world_size())])
        stages = []
        for mod in self._modules:
            # examples of what the stage takes and gives (torch reads shape, dtype and whether
            # a gradient flows back: the hidden states carry one, the token ids do not)
            x = (
                torch.empty(b, s, dtype=first.dtype, device=device)
                if mod.first
                else torch.empty(b, s, hidden, dtype=hidden_dtype, device=device).requires_grad_()
            )
            y = (
                torch.empty(1, dtype=torch.float32, device=device).requires_grad_()
                if mod.last
                else torch.empty(b, s, hidden, dtype=hidden_dtype, device=device).requires_grad_()
            )
            stages.append(
                PipelineStage(
                    mod,
                    mod.index,
                    self.num_stages,
                    device,
                    input_args=(x,),
                    output_args=(y,),
                    group=group,
                    dw_builder=_whole_backward if self._spec.split_backward else None,
                )
            )
        cls = schedule_class(self.schedule)

        def loss_fn(output: Tensor, target: Tensor) -> Tensor:
            return output.sum()

        if self._spec.multi:
            runner = cls(stages, self.microbatches, loss_fn=loss_fn, scale_grads=False)
            if self.overlap == FORWARD_BACKWARD:  # checked by pipeline_model: DualPipeV
                from torch.distributed.pipelining.schedules import OVERLAP_F_B

                runner.register_custom_function(OVERLAP_F_B, self._overlap_f_b)
            return runner
        return cls(stages[0], self.microbatches, loss_fn=loss_fn, scale_grads=False)

    def _overlap_f_b(self, action: Any, ctx: Any) -> None:
        """torch's ``OVERLAP_F_B`` action (DualPipeV's paired forward of one stage and full
        backward of the other) with its two sub-actions interleaved at their in-flight points
        (:func:`~hyper_parallel.models.pipeline.interleave.run_interleaved`) instead of one
        after the other. Each sub-action runs as the schedule runs it alone (its receives
        waited, its loss, its stage's gradient-sync switches); the sends follow the pair, as
        for the sequential pair. The runtime's per-action function is taken from its running
        frame: ``pipeline_model`` admits this only where the installed torch has it."""
        perform = _runtime_perform(sys._getframe(1))
        f_act, b_act = action.sub_actions
        _, switches = run_interleaved(
            lambda: perform(f_act),
            lambda: perform(b_act),
            names=(
                f"forward mb{f_act.microbatch_index} (stage {f_act.stage_index})",
                f"backward mb{b_act.microbatch_index} (stage {b_act.stage_index})",
            ),
        )
        self.switches.append(switches)

    def step(
        self,
        *,
        input_ids: Tensor,
        labels: Tensor,
        position_ids: Tensor | None = None,
        **kwargs: Any,
    ) -> Tensor:
        """Forward and backward of the whole global batch under the schedule; returns its loss
        (the mean over every target of the global batch, a 0-d float32 tensor, the same on every
        rank). Call on every rank with the same global batch ``shard_batch`` takes
        (``input_ids``, ``labels`` ``[B, T]``, ``position_ids``, packed-document tables).
        Gradients accumulate into the parameters (``zero_grad`` between steps); then
        :func:`~hyper_parallel.models.sync_gradients`,
        :func:`~hyper_parallel.models.clip_grad_norm_` and the optimizer.

        ``ValueError`` on every rank before any communication: no labels, no target in the
        batch, ``B`` not a multiple of ``microbatches·dp``, and what ``shard_batch`` refuses."""
        batch: dict[str, Any] = {"input_ids": input_ids, "labels": labels, **kwargs}
        if position_ids is not None:
            batch["position_ids"] = position_ids
        micro, count = self._micro_batches(batch)
        for part in self.parts:
            moe = plan_of(part, "PipelinedModel.step").moe
            if moe is not None:
                moe.counts.clear()
        self._feed.micro = micro
        self._feed.count = count
        first = micro[0]["input_ids"]
        dtype = _hidden_dtype(self.parts[0])
        shape = (tuple(first.shape), first.dtype, dtype)
        own_runner = self.overlap == FORWARD_BACKWARD and self.num_stages == 1
        if not own_runner and (self._runner is None or self._shape != shape):
            self._runner = self._build(first, dtype)
            self._shape = shape
        m = self.microbatches
        device = _device(self.stage_mesh)
        mb = torch.arange(m, device=device)
        args: tuple[Tensor, ...] = ()
        call: dict[str, Any] = {"mb": mb}
        holds_first = 0 in self.stages
        holds_last = self.num_stages - 1 in self.stages
        if holds_first:
            args = (torch.cat([x["input_ids"] for x in micro]).to(device),)
        if holds_last:
            call["target"] = mb.clone()
        losses: list[Tensor] = []
        try:
            self.switches = []
            if own_runner:
                losses = self._interleaved(micro, device)
            else:
                with every_work():  # torch 2.7 on gloo: wait on every point-to-point work
                    self._runner.step(*args, losses=losses, **call)
        finally:
            self._feed.micro = []
        total = torch.zeros((), dtype=torch.float32, device=device)
        if holds_last:
            total = torch.stack([x.detach().float().reshape(()) for x in losses]).sum()
        if self.pp_mesh is not None and self.pp_mesh.size() > 1:
            g = comm.resolve_group(self.pp_mesh, "the pipeline loss")
            name = "all_reduce:pipeline_loss"
            total = comm.start_all_reduce(total, g, name, "step", OWNER).wait()
        return total

    def _interleaved(self, micro: list[dict[str, Tensor]], device: torch.device) -> list[Tensor]:
        """``overlap="forward_backward"`` at pp = 1: micro-batch 0's forward, then the forward
        of micro-batch k and the backward of micro-batch k−1 interleaved node by node
        (:func:`~hyper_parallel.models.pipeline.interleave.run_interleaved`), then the last
        backward alone. FSDP2 accumulates unreduced gradients until that last backward, which
        reduce-scatters them (its public gradient-accumulation switches). Under hp-dtensor's
        event recorder each running stretch is a segment ``forward mb k`` / ``backward mb k``
        (:func:`~hyper_parallel.models.pipeline.interleave.segment_spans`)."""
        mod = self._modules[0]
        fsdp: Any = mod if hasattr(mod, "set_requires_gradient_sync") else None

        def forward(k: int) -> Tensor:
            x = micro[k]["input_ids"].to(device)
            return cast(Tensor, mod(x, torch.tensor([k], device=device)))

        def backward(loss: Tensor) -> None:
            torch.autograd.backward(hold_backward_end(loss))

        def sync(last: bool) -> None:
            if fsdp is not None:
                fsdp.set_requires_gradient_sync(last)
                fsdp.set_is_last_backward(last)
                fsdp.set_reshard_after_backward(last)

        m = self.microbatches
        losses: list[Tensor] = []
        with segment("forward mb0", "forward"):
            loss = forward(0)
        sync(False)
        self.switches = []
        for k in range(1, m):
            prev = loss
            loss, switches = run_interleaved(
                lambda k=k: forward(k),  # type: ignore[misc]
                lambda prev=prev: backward(prev),  # type: ignore[misc]
                names=(f"forward mb{k}", f"backward mb{k - 1}"),
            )
            self.switches.append(switches)
            losses.append(prev.detach())
        sync(True)
        with segment(f"backward mb{m - 1}", "backward"):
            backward(loss)
        losses.append(loss.detach())
        return losses


def _runtime_perform(frame: Any) -> Any:
    """torch's ``_PipelineScheduleRuntime._step_microbatches`` runs a registered custom
    function from inside itself; its ``_perform_action`` (a local function) runs one plain
    action. ``RuntimeError`` where the installed torch is laid out otherwise (every rank runs
    the same torch, so every rank raises alike)."""
    perform = frame.f_locals.get("_perform_action") if frame is not None else None
    if frame is None or frame.f_code.co_name != "_step_microbatches" or perform is None:
        raise RuntimeError(
            f"overlap={FORWARD_BACKWARD!r} at pp > 1: torch {torch.__version__}'s pipeline "
            "runtime does not run its overlapped actions the way this release expects "
            "(_step_microbatches' _perform_action); use overlap=True"
        )
    return perform


def fb_overlap_schedules() -> str | None:
    """``None`` when this torch runs DualPipeV's ``OVERLAP_F_B`` actions through a registered
    function (``_PipelineScheduleRuntime.register_custom_function``), else why not."""
    from torch.distributed.pipelining import schedules

    runtime = getattr(schedules, "_PipelineScheduleRuntime", None)
    if not hasattr(schedules, "OVERLAP_F_B") or not hasattr(runtime, "register_custom_function"):
        return (
            f"torch {torch.__version__}'s pipeline runtime has no overlapped forward-backward "
            "action to run them in (OVERLAP_F_B with register_custom_function)"
        )
    return None


def _whole_backward() -> Any:
    """torch's ``dw_builder`` for the split-backward schedules: the stage's backward computes
    the input and the weight gradients in one pass (see
    :mod:`hyper_parallel.models.pipeline.schedules`), so the deferred weight step has nothing
    left to do."""
    return _nothing


def _nothing() -> None:
    return None


def _hidden_dtype(part: nn.Module) -> torch.dtype:
    """The dtype of the hidden states between stages: FSDP2's ``param_dtype`` where a mixed
    precision policy casts the parameters, else the embeddings' (the model's) dtype."""
    policy = getattr(part, "_hp_mp_policy", None)
    if policy is not None and getattr(policy, "param_dtype", None) is not None:
        return policy.param_dtype
    for p in part.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.get_default_dtype()


def _pipeline_fields(args: Any) -> dict[str, Any]:
    fam, _ = family_of(args.model)
    return {
        "model": type(args.model).__name__,
        "family": fam.name,
        "roles": _roles(args.model),
        "param_count": sum(1 for _ in args.model.parameters()),
        "mesh": (tuple(args.mesh.mesh.shape), args.mesh.mesh_dim_names),
        "options": sorted(
            (k, dispatcher_label(v) if k == "dispatcher" else repr(v))
            for k, v in args.kwargs.items()
        ),
    }


@checked_entry(
    "pipeline_model",
    compare=("microbatches", "schedule", "stages_per_rank", "layer_split"),
    extra=_pipeline_fields,
)
def pipeline_model(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    microbatches: int,
    schedule: str = "1F1B",
    stages_per_rank: int = 1,
    layer_split: Any = None,
    **kwargs: Any,
) -> PipelinedModel:
    """Cut a stock ``KimiLinearForCausalLM`` / ``DeepseekV3ForCausalLM`` /
    ``Qwen3NextForCausalLM`` into pipeline stages and parallelise each (see the module
    docstring); return this rank's :class:`PipelinedModel`. ``model`` is taken apart: its
    layers move into the stages (use the returned object, not ``model``, afterwards).

    - ``mesh``: ``("pp", "cp", "tp")`` or ``("pp", "dp", "cp", "tp")``; without ``"pp"``,
      pp = 1 (micro-batches only).
    - ``microbatches``: micro-batches a step (``m``); ``schedule``: torch's schedule by name
      (``"GPipe"``, ``"1F1B"``, ``"Interleaved1F1B"``, ``"InterleavedZeroBubble"``,
      ``"ZBVZeroBubble"``, ``"DualPipeV"``; see
      :mod:`hyper_parallel.models.pipeline.schedules` for what each needs);
      ``stages_per_rank``: stages a rank holds (``pp·stages_per_rank`` stages in all).
    - ``layer_split``: decoder layers a stage, in stage order (each ``>= 1``, adding up to the
      model's layers); default: split by each layer's cost
      (:func:`~hyper_parallel.models.pipeline.split.balanced_split`). Layers keep their indices.
    - every other keyword goes to :func:`~hyper_parallel.models.parallelize_model` for each
      stage (``mla_strategy``, ``overlap``, ``kda_protocol``, ``local_kernel``,
      ``grad_reduction``, ``mp_policy``, ``ep``, ``dispatcher``, ``moe_chunks``; ``ep``
      divides each stage's ``dp·cp·tp``). ``overlap`` also takes ``"forward_backward"``: one
      micro-batch's forward interleaved with another's backward at their exchanges (pp = 1:
      the micro-batches of the stage; pp > 1: inside ``"DualPipeV"``'s overlapped actions;
      :mod:`hyper_parallel.models.pipeline.interleave`), the layers keeping their own overlap:
      at pp = 1 the first forward and the last backward run alone, and there only the MoE
      blocks' chunks (``moe_chunks``) hide their exchanges.

    Raised on every rank alike before any communication: ``TypeError`` for an unsupported or
    base model or option type; ``ValueError`` for a mesh whose ``"pp"`` is not first, an
    unknown schedule or one this torch lacks (naming the release that has it), fewer
    micro-batches than the schedule needs, a ``layer_split`` that does not add up or leaves a
    stage empty, fewer layers than stages, tied embeddings over pp > 1, and what
    ``parallelize_model`` refuses. Consistency mode: the ranks first compare the model's
    class, roles and parameter count, the mesh and every option.
    """
    fam, base = family_of(model)
    overlap = kwargs.get("overlap", True)
    if overlap == FORWARD_BACKWARD:
        kwargs["overlap"] = True  # the layers keep their own in-layer overlap
    elif not isinstance(overlap, bool):
        raise ValueError(f"overlap must be True, False or {FORWARD_BACKWARD!r}, got {overlap!r}")
    # before the stages' groups are made: the same verdict on every rank, nothing started
    check_dispatcher(kwargs.get("dispatcher", "alltoall"), kwargs.get("ep", 1))
    resolve_moe_chunks(kwargs.get("moe_chunks", "auto"), kwargs.get("overlap", True))
    if base is model:
        raise TypeError(
            f"pipeline_model needs the causal LM ({fam.causal_lm}): its last stage computes "
            f"the loss; got the base model {type(model).__name__}"
        )
    pp_mesh, stage_mesh = split_mesh(mesh)
    pp = 1 if pp_mesh is None else pp_mesh.size()
    spec = check_schedule(schedule, pp, stages_per_rank, microbatches)
    num_stages = pp * stages_per_rank
    if overlap == FORWARD_BACKWARD and num_stages > 1:
        if spec.name != "DualPipeV" or pp == 1:
            raise ValueError(
                f"overlap={FORWARD_BACKWARD!r} interleaves a forward with a backward that does "
                "not wait for it: at pp = 1 the micro-batches of one stage (one stage a rank), "
                "at pp > 1 the forward and full backward that schedule 'DualPipeV' pairs "
                f"(this call: pp = {pp}, {num_stages} stages, schedule {spec.name!r}; in the "
                "other schedules a stage's next forward feeds the backward it would be paired "
                "with, so the pair would wait on itself); use overlap=True there"
            )
        why = fb_overlap_schedules()
        if why:
            raise ValueError(f"overlap={FORWARD_BACKWARD!r} with schedule 'DualPipeV': {why}")
    if overlap == FORWARD_BACKWARD and microbatches < 2:
        raise ValueError(
            f"overlap={FORWARD_BACKWARD!r} pairs one micro-batch's forward with another's "
            f"backward: it needs microbatches >= 2, got {microbatches}"
        )
    n_layers = len(decoder_layers(base))
    if layer_split is None:
        costs, head = layer_costs(model)
        sizes = balanced_split(costs, num_stages, last_extra=head)
    else:
        sizes = check_layer_split(layer_split, n_layers, num_stages)
    if num_stages > 1 and model.get_submodule("lm_head").weight is getattr(
        base.get_submodule("embed_tokens"), "weight", None
    ):
        raise ValueError(
            "pipeline_model: the LM head is tied to the embeddings (tie_word_embeddings), but "
            "the first stage holds the embeddings and the last the head; untie them"
        )
    cp, tp = cp_tp(stage_mesh)
    ep = kwargs.get("ep", 1)
    names = tuple(stage_mesh.mesh_dim_names or ())
    if isinstance(ep, int) and not isinstance(ep, bool) and ep > 1:
        dp = stage_mesh.size(0) if names[0] == "dp" else 1
        if (dp * cp * tp) % ep:
            raise ValueError(f"ep={ep} must divide each stage's dp·cp·tp = {dp * cp * tp} ranks")
    ranges = stage_ranges(sizes)
    owner = [s for s, r in enumerate(ranges) for _ in r]
    pp_rank = 0 if pp_mesh is None else int(pp_mesh.get_local_rank())
    mine = stages_of_rank(spec, pp_rank, pp, stages_per_rank)
    parts = [stage_model(model, base, ranges[s], owner, s == 0, s == num_stages - 1) for s in mine]
    kda_protocol = kwargs.get("kda_protocol", "auto")
    _warm_groups(model, stage_mesh, kda_protocol)
    for part in parts:
        apply_parallel(part, stage_mesh, reshard_after_forward=False, **kwargs)
        part._hp_mp_policy = kwargs.get("mp_policy")  # type: ignore[assignment]
    return PipelinedModel(
        parts, mesh, mine, ranges, pp_mesh, stage_mesh, microbatches, spec, overlap
    )
