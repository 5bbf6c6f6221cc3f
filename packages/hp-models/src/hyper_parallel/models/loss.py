"""The parallelised model's forward: checks, then the model's own forward, then the loss made
global.

Each rank computes Hugging Face's own causal-LM loss on its block with ``num_items_in_batch``
set to the number of non-ignored targets of the WHOLE batch, so its loss is its share
``ℓ_r = Σ_{i ∈ block r} CE_i / N``. The reported loss is ``Σ_r ℓ_r`` (an all-reduce), the serial
loss on the full batch, identical on every rank; its backward sends gradient 1 to each rank's
own share (not ``P``), so after :func:`~hyper_parallel.models.sync_gradients` sums the
parameter gradients over ranks they equal the serial ones.

A ``num_items_in_batch`` given by the caller is taken as ``N`` itself (no count is taken): the
number of targets of a larger batch this call is one part of (gradient accumulation; each
micro-batch of :func:`~hyper_parallel.models.pipeline_model` passes the count of the whole
global batch), so that the parts' losses add up to the whole batch's mean.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor

from hyper_parallel.dtensor import checked_entry, comm
from hyper_parallel.dtensor.rewrite import parallel_state
from hyper_parallel.models.batch import IGNORE_INDEX
from hyper_parallel.models.documents import count_tokens, pass_documents
from hyper_parallel.models.mesh import SequenceMesh, sequence_mesh
from hyper_parallel.models.state import LAYER, OWNER, ParallelPlan, plan_of

__all__ = ["global_loss", "global_mean_loss", "parallel_forward", "refuse_generate"]


class _SumShares(torch.autograd.Function):
    """``Σ_r x_r`` over the group in forward; identity in backward (each rank's ``x_r`` is
    its own term of the sum)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, mesh: Any) -> Tensor:
        g = comm.resolve_group(mesh, "the global loss")
        out = x.detach().clone()
        return comm.start_all_reduce(out, g, "all_reduce:loss", "forward", OWNER).wait()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def global_loss(share: Tensor, sm: SequenceMesh) -> Tensor:
    """The global loss from this rank's share (see the module docstring)."""
    if sm.batch.size() == 1:  # sm.batch: every rank of the global batch (dp·cp·tp)
        return share
    return _SumShares.apply(share, sm.batch)


def global_mean_loss(local_sum: Tensor, local_count: Tensor | int, mesh: Any) -> Tensor:
    """The mean of a per-token loss over the WHOLE batch, from this rank's block, for a loss
    computed by the caller from ``out.logits`` (a fused cross-entropy kernel, a custom
    objective): ``local_sum`` is the sum of the per-token losses of this rank's block (a 0-d
    tensor with autograd), ``local_count`` the number of tokens that entered it.

    Returns ``Σ_r local_sum_r / Σ_r local_count_r``, the serial mean, identical on every rank of
    ``mesh`` (a :class:`~hyper_parallel.models.SequenceMesh` or the ``("cp", "tp")`` mesh given
    to ``parallelize_model``). Its backward gives each rank the gradient of its own term only,
    so after :func:`~hyper_parallel.models.sync_gradients` every gradient equals the serial
    one. A plain ``local_sum / local_count`` (the mean over the local tokens) is ``P`` times too
    large in gradient, and a different number on every rank. Two all-reduces (count, loss)."""
    sm = _as_sequence_mesh(mesh)
    if not isinstance(local_sum, Tensor) or local_sum.dim() != 0:
        raise ValueError("global_mean_loss: local_sum must be a 0-d tensor (sum over the block)")
    count = torch.as_tensor(local_count, dtype=torch.float64, device=local_sum.device).detach()
    if count.dim() != 0:
        raise ValueError("global_mean_loss: local_count must be a number or a 0-d tensor")
    count = count.clone()
    if sm.batch.size() > 1:
        g = comm.resolve_group(sm.batch, "global_mean_loss")
        count = comm.start_all_reduce(count, g, "all_reduce:loss_tokens", "forward", OWNER).wait()
    if not bool(count > 0):
        raise ValueError("global_mean_loss: no token in the whole batch entered the loss")
    return global_loss(local_sum / count.to(local_sum.dtype), sm)


def _as_sequence_mesh(mesh: Any) -> SequenceMesh:
    return mesh if isinstance(mesh, SequenceMesh) else sequence_mesh(mesh)


def refuse_generate(*args: Any, **kwargs: Any) -> Any:
    """``generate`` of a parallelised model: generation is not supported (raises at once, before
    any communication, on every rank alike)."""
    raise NotImplementedError(
        "generate() is not supported on a parallelised model: decoding needs the KV cache and "
        "the recurrent state of the whole sequence on every step, which parallelize_model "
        "splits across ranks (a forward on a full prompt would give each rank the wrong "
        "scores). Generate with the serial model: load the checkpoint saved from this one "
        "(save_pretrained / a full state dict) into a plain model"
    )


def _check_call(args: tuple[Any, ...], kwargs: dict[str, Any], has_loss: bool) -> None:
    """Local, structural checks: the same inputs structure on every rank gives the same
    verdict on every rank, before the model issues any collective."""
    if args:
        raise TypeError(
            "a parallelised model takes its inputs by keyword (model(**shard_batch(batch, mesh)))"
        )
    if kwargs.get("use_cache"):
        raise ValueError(
            "use_cache=True is not supported on a parallelised model (training only: the KV "
            "cache and the recurrent state are not split across ranks)"
        )
    if kwargs.get("past_key_values") is not None:
        raise ValueError("past_key_values is not supported on a parallelised model")
    if kwargs.get("cache_position") is not None:
        raise ValueError(
            "cache_position is not supported on a parallelised model: incremental decoding "
            "is not split across ranks (generate with the serial model)"
        )
    ids = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    pos = kwargs.get("position_ids")
    if pos is None:
        raise ValueError(
            "a parallelised model needs this rank's block of the batch and its positions: "
            "call model(**shard_batch(batch, mesh)) (no position_ids were given, so the input "
            "is not a block cut by shard_batch; the full batch on every rank gives wrong "
            "results)"
        )
    if (
        isinstance(ids, Tensor)
        and isinstance(pos, Tensor)
        and (pos.dim() != 2 or pos.shape[1] != ids.shape[1])
    ):
        raise ValueError(
            f"position_ids {tuple(pos.shape)} do not match the block's {tuple(ids.shape[:2])}: "
            "call model(**shard_batch(batch, mesh))"
        )
    if kwargs.get("attention_mask") is not None:
        raise ValueError(
            "attention_mask is not supported on a parallelised model: padding cannot be split "
            "across ranks; shard_batch accepts an all-ones mask and drops it"
        )
    if has_loss and kwargs.get("labels") is not None and kwargs.get("shift_labels") is None:
        raise ValueError(
            "labels need shift_labels: cut the batch with shard_batch, which shifts the labels "
            "on the full sequence (a block's last target is the next block's first token)"
        )


def _argument(value: Any) -> Any:
    """What the consistency check compares of one keyword argument: a tensor (its shape, dtype
    and device type, via ``checked_entry``), a plain value, or else its type's name (an
    object's ``repr`` may hold its address)."""
    if value is None or isinstance(value, (Tensor, bool, int, float, str)):
        return value
    return type(value).__name__


def _autocast(kwargs: dict[str, Any]) -> str:
    """The autocast dtype the forward runs under on its inputs' device type (``"off"``)."""
    ids = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    device = ids.device.type if isinstance(ids, Tensor) else "cpu"
    try:
        if not torch.is_autocast_enabled(device):
            return "off"
        return str(torch.get_autocast_dtype(device)).removeprefix("torch.")
    except (AttributeError, RuntimeError, TypeError):  # a device type autocast does not know
        return "unknown"


def _flat_mesh(args: Any) -> Any:
    """The mesh the forward compares over: the flattened one (none for a model that is not
    parallelised: the body raises)."""
    return cast(ParallelPlan, parallel_state(args.self, LAYER)).mesh.flat


def _call_fields(args: Any) -> dict[str, Any]:
    """The forward's consistency fields (``checked_entry``'s ``extra``): the keyword arguments
    of the call (``input_ids``, ``labels``/``shift_labels``, ``position_ids``, ...: tensors by
    shape, dtype and device type; a packed-documents table also by its values), whether the
    model has a loss, whether autograd records and the autocast dtype. The layers' own forward
    checks are covered by it (nested checks off)."""
    plan = cast(ParallelPlan, parallel_state(args.self, LAYER))
    kwargs = args.kwargs
    fields = {f"arg_{k}": _argument(v) for k, v in kwargs.items()}
    for key in ("cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k"):
        table = kwargs.get(key)
        if isinstance(table, Tensor) and table.dim() == 1:  # the documents: values, not shape
            fields[f"documents_{key}"] = tuple(int(v) for v in table.tolist())
    fields["has_loss"] = plan.has_loss
    fields["grad_enabled"] = torch.is_grad_enabled()
    fields["autocast"] = _autocast(kwargs)
    return fields


def parallel_forward(model_class: type) -> Callable[..., Any]:
    """The parallelised model's ``forward``, for hp-dtensor's ``install_forward``: it wraps
    ``model_class``'s own ``forward``; the mesh and options come from the
    model's :class:`~hyper_parallel.models.ParallelPlan` (its rewrite state), so one function
    serves every model of a class (see the module docstring). The loss is made global in
    both of Hugging Face's output forms: ``out.loss``, and the first element of the tuple that
    ``return_dict=False`` returns when labels are given."""

    original: Callable[..., Any] = model_class.forward  # type: ignore[attr-defined]

    @functools.wraps(original)
    @checked_entry("parallelized model forward", group=_flat_mesh, extra=_call_fields)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        plan = plan_of(self, "the parallelised forward")
        sm, has_loss = plan.mesh, plan.has_loss
        _check_call(args, kwargs, has_loss)
        kwargs["use_cache"] = False
        # one sequence context for every layer: the packed documents, validated once; the
        # masks as the family's model takes them
        ctx = pass_documents(kwargs, plan.family, sm)
        targets = kwargs.get("shift_labels") if has_loss else None
        if (
            targets is not None
            and kwargs.get("labels") is not None
            and kwargs.get("num_items_in_batch") is None
        ):
            count = (targets != IGNORE_INDEX).sum()  # int64: the loss keeps its dtype
            if sm.batch.size() > 1:  # carrying the table's fingerprint (documents.py)
                count = count_tokens(count, ctx, sm, OWNER)
            kwargs["num_items_in_batch"] = count
        out = original(self, **kwargs)
        if targets is None or kwargs.get("labels") is None:
            return out
        if isinstance(out, tuple):  # return_dict=False: (loss, logits, ...)
            return (global_loss(out[0], sm), *out[1:])
        if getattr(out, "loss", None) is not None:
            out.loss = global_loss(out.loss, sm)
        return out

    return forward
