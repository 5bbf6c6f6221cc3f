"""``save_pretrained`` on a parallelised model: a plain Hugging Face folder, written by one rank.

The parallelised model's parameters are DTensors (FSDP2 shards, hp-mc2's ``tp`` shards) or
whole tensors; Hugging Face's own ``save_pretrained`` cannot serialise the shards. The
replacement that :func:`~hyper_parallel.models.parallelize_model` installs as
``model.save_pretrained``

1. gathers the full state dict with torch's ``get_model_state_dict(full_state_dict=True,
   cpu_offload=True)`` (every rank takes part in the all-gathers; only the writing rank keeps
   the tensors, on CPU),
2. on the writing rank only (coordinate 0 on every mesh dim) calls Hugging Face's own
   ``save_pretrained`` with that state dict: the folder ``from_pretrained`` loads into the plain
   model, with the same weights;
3. all-reduces a success flag over the whole mesh, so every rank returns, or every rank raises,
   together (the other ranks write nothing).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hyper_parallel.dtensor import comm
from hyper_parallel.models.plan import OWNER, plan_of

__all__ = ["save_pretrained", "save_pretrained_member"]


def _writer(plan: Any) -> bool:
    coord = plan.mesh.mesh.get_coordinate()
    return coord is not None and all(c == 0 for c in coord)


def _world_groups(plan: Any) -> list[Any]:
    mesh = plan.mesh.mesh
    return [mesh.get_group(d) for d in range(mesh.ndim) if mesh.size(d) > 1]


def save_pretrained(
    model: nn.Module, original: Callable[..., Any], save_directory: Any, **kwargs: Any
) -> None:
    """Write ``model`` (parallelised) to ``save_directory`` as a plain Hugging Face folder (see
    the module docstring). Call on every rank with the same arguments, as Hugging Face's
    examples do. ``kwargs`` go to Hugging Face's ``save_pretrained`` on the writing rank
    (``max_shard_size``, ``variant``, ``safe_serialization``, ...); ``is_main_process`` is
    ignored (the writer is the rank at mesh coordinate 0).

    ``ValueError`` on every rank, before any communication, for ``state_dict=`` (the state dict
    is gathered here), ``distributed_checkpoint=True`` (use ``torch.distributed.checkpoint``:
    README, "Checkpoints") and ``push_to_hub=True`` (push the written folder instead).
    ``RuntimeError`` on every rank when the writing rank failed (it re-raises its own error)."""
    for key in ("state_dict", "distributed_checkpoint", "push_to_hub"):
        if kwargs.get(key) not in (None, False):  # an empty state dict too
            raise ValueError(
                f"save_pretrained({key}=...) is not supported on a parallelised model: it "
                "gathers the full state dict itself and writes a plain folder from one rank; "
                "for sharded checkpoints use torch.distributed.checkpoint (hp-models README)"
            )
    kwargs.pop("is_main_process", None)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    plan = plan_of(model, "save_pretrained")
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    failure: BaseException | None = None
    if _writer(plan):
        try:
            original(save_directory, state_dict=full, is_main_process=True, **kwargs)
        except Exception as exc:  # every rank must learn of it, not wait forever
            failure = exc
    del full
    flag = torch.tensor([0 if failure is None else 1], dtype=torch.int32)
    device = next(iter(model.parameters())).device
    flag = flag.to(device)
    for group in _world_groups(plan):  # summed: non-zero if the writer failed
        g = comm.resolve_group(group, "save_pretrained")
        comm.start_all_reduce(flag, g, "all_reduce:save_failed", "save", OWNER).wait()
    if failure is not None:
        raise failure
    if int(flag.item()):
        raise RuntimeError(
            f"save_pretrained({save_directory!r}) failed on the writing rank (mesh coordinate "
            "0); see its error"
        )


def save_pretrained_member(original: type) -> Callable[..., None]:
    """``save_pretrained`` of the parallelised class made from ``original`` (a Hugging Face
    ``PreTrainedModel`` subclass): :func:`save_pretrained` of the module it is called on,
    writing through ``original``'s own ``save_pretrained`` (a method of the class, so a deep
    copy writes its own weights)."""
    write: Any = getattr(original, "save_pretrained")  # noqa: B009 (a class attribute, by name)

    @functools.wraps(write)
    def member(self: nn.Module, save_directory: Any, **kwargs: Any) -> None:
        save_pretrained(self, write.__get__(self), save_directory, **kwargs)

    return member
