"""``save_pretrained`` on a parallelised model: a plain Hugging Face folder in the hub layout,
written by every rank, with no rank holding the whole model.

The replacement that :func:`~hyper_parallel.models.parallelize_model` installs as
``model.save_pretrained``, for each tensor of the checkpoint in one order on every rank:

1. gathers the parameter over its mesh dims except ``ep`` (:func:`~hyper_parallel.models.
   regions.gather_over`): FSDP2 shards and ``tp`` shards are put together, a rank's experts stay
   its own. At most one whole runtime tensor (a layer's experts: ``E/ep`` of them) is held
   beyond what the rank writes;
2. converts it to the family's hub tensors (:class:`~hyper_parallel.models.hub.HubLayout`:
   per-expert keys, Kimi's ``block_sparse_moe``/``w1..w3``, split q/k/v convolutions), and
   keeps the ones this rank writes: an expert's tensors go to one of the ranks holding that
   expert (round robin over them), every other tensor to the rank that has been given the
   fewest bytes so far, so each rank writes about ``1/P`` of the model;
3. each rank writes its tensors to its own safetensors files (split at ``max_shard_size``),
   the ranks exchange their key lists (names only), and the first rank writes
   ``model.safetensors.index.json``, ``config.json`` and ``generation_config.json``;
4. a success flag is all-reduced over the whole mesh, so every rank returns, or every rank
   raises, together.

The folder (on storage every rank sees) has the keys and values stock ``save_pretrained``
writes, so ``AutoModelForCausalLM.from_pretrained`` and :func:`~hyper_parallel.models.
from_pretrained` (at any mesh and ``ep``) load it.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from hyper_parallel.dtensor import comm
from hyper_parallel.models.hub import model_tensors
from hyper_parallel.models.regions import Box, gather_over, mesh_device
from hyper_parallel.models.state import OWNER, plan_of

__all__ = ["save_pipeline", "save_pretrained", "save_pretrained_member"]

_UNSUPPORTED = ("state_dict", "distributed_checkpoint", "push_to_hub", "variant")


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def _shard_limit(value: Any) -> int | None:
    """``max_shard_size`` in bytes (an int, or ``"5GB"`` / ``"500MiB"`` as Hugging Face
    writes them); ``ValueError`` for anything else."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    m = (
        re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
        if isinstance(value, str)
        else None
    )
    if m is None or m.group(2).upper() not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"save_pretrained: max_shard_size {value!r} is not a size")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def _gather_json(obj: Any, mesh: Any) -> list[Any]:
    """Every rank's JSON-able ``obj`` over the 1-D ``mesh``, in group order."""
    g = comm.resolve_group(mesh, "save_pretrained")
    dev = mesh_device(mesh)
    payload = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8, device=dev)
    length = torch.tensor([payload.numel()], dtype=torch.int64, device=dev)
    lengths = comm.start_all_gather(length, 0, g, "all_gather:save_keys", "save", OWNER).wait()
    padded = torch.zeros(int(lengths.max()), dtype=torch.uint8, device=dev)
    padded[: payload.numel()] = payload
    blobs = comm.start_all_gather(
        padded.unsqueeze(0), 0, g, "all_gather:save_keys", "save", OWNER
    ).wait()
    return [json.loads(bytes(b[: int(n)].cpu().tolist()).decode()) for b, n in zip(blobs, lengths)]


def _is_experts(t: Tensor) -> bool:
    mesh = getattr(t, "device_mesh", None)
    return mesh is not None and "ep" in (mesh.mesh_dim_names or ())


def _share(model: nn.Module, plan: Any, ranks: list[int], me: int) -> dict[str, Tensor]:
    """The hub tensors this rank writes (step 1 and 2 of the module docstring)."""
    fam = plan.family
    edp = plan.moe.edp_mesh
    holders = ranks if edp is None else [int(r) for r in edp.mesh.flatten().tolist()]
    given = dict.fromkeys(ranks, 0)
    mine: dict[str, Tensor] = {}
    for key, t in model_tensors(model).items():
        experts = _is_experts(t)
        data, box = gather_over(t, ("ep",), key, OWNER)
        for piece in fam.hub.pieces(key, tuple(t.shape)):
            if experts:
                if not _inside(piece.box, box):
                    continue
                first = piece.box.offset[0] - box.offset[0]
                owner = holders[first % len(holders)]
            else:
                owner = min(ranks, key=lambda r: (given[r], r))
                given[owner] += piece.box.numel() * t.element_size()
            if owner == me:
                region = tuple(
                    slice(o - b, o - b + n)
                    for o, b, n in zip(piece.box.offset, box.offset, piece.box.shape)
                )
                part = data[region].reshape(piece.hub_shape)
                whole = part.numel() == data.numel() and part.is_contiguous()
                # the whole gathered tensor is kept as it is (no second copy); a piece of it
                # is copied out, so the gathered tensor can be freed
                mine[piece.key] = part if whole else part.contiguous().clone()
        del data
    return mine


def _inside(inner: Box, outer: Box) -> bool:
    return all(
        o >= b and o + n <= b + m
        for o, n, b, m in zip(inner.offset, inner.shape, outer.offset, outer.shape)
    )


def _files(tensors: dict[str, Tensor], limit: int | None) -> list[list[str]]:
    """This rank's keys cut into files of at most ``limit`` bytes (one file without limit)."""
    out: list[list[str]] = [[]]
    size = 0
    for key in sorted(tensors):
        n = tensors[key].numel() * tensors[key].element_size()
        if limit is not None and out[-1] and size + n > limit:
            out.append([])
            size = 0
        out[-1].append(key)
        size += n
    return [f for f in out if f]


def _write(model: nn.Module, plan: Any, folder: str, limit: int | None) -> str | None:
    """Steps 1–3: every rank takes part in every collective whatever fails locally; returns
    this rank's error, if any (the caller all-reduces the outcome)."""
    ranks = [int(r) for r in plan.mesh.batch.mesh.flatten().tolist()]
    me = int(torch.distributed.get_rank())
    mine = _share(model, plan, ranks, me)
    return _write_files(mine, model, plan.mesh.batch, folder, limit)


def _write_files(
    mine: dict[str, Tensor],
    model: nn.Module,
    job: Any,
    folder: str,
    limit: int | None,
    error: str | None = None,
) -> str | None:
    """Step 3 over the 1-D mesh ``job`` (every rank writing a share): this rank's hub tensors
    ``mine`` to its files, the key lists exchanged, the index and config written by ``job``'s
    first rank; returns this rank's error, if any. A rank that already failed (``error``)
    writes nothing but takes part in every exchange, so that every rank learns of it."""
    from safetensors.torch import save_file

    ranks = [int(r) for r in job.mesh.flatten().tolist()]
    me = int(torch.distributed.get_rank())
    files = _files(mine, limit) if error is None else []
    counts = _gather_json(len(files), job)
    total, first = sum(counts), sum(counts[: ranks.index(me)])
    weight_map: dict[str, str] = {}
    try:
        os.makedirs(folder, exist_ok=True)
        for i, keys in enumerate(files):
            name = f"model-{first + i + 1:05d}-of-{total:05d}.safetensors"
            tensors = {k: mine[k].cpu() for k in keys}
            save_file(tensors, os.path.join(folder, name), {"format": "pt"})
            weight_map.update(dict.fromkeys(keys, name))
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    nbytes = sum(t.numel() * t.element_size() for t in mine.values())
    del mine
    parts = _gather_json({"map": weight_map, "bytes": nbytes, "error": error}, job)
    errors = [f"rank {r}: {p['error']}" for r, p in zip(ranks, parts) if p["error"]]
    if errors:
        return error or "; ".join(errors)
    if me != ranks[0]:
        return None
    full_map: dict[str, str] = {}
    for part in parts:
        full_map.update(part["map"])
    index = {
        "metadata": {"total_size": sum(p["bytes"] for p in parts)},
        "weight_map": dict(sorted(full_map.items())),
    }
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as fh:
        json.dump(index, fh, indent=2, sort_keys=True)
        fh.write("\n")
    config: Any = model.config
    config.architectures = [type(model).__name__.removeprefix("FSDP")]
    config.save_pretrained(folder)
    gen = getattr(model, "generation_config", None)
    if gen is not None and getattr(model, "can_generate", lambda: False)():
        gen.save_pretrained(folder)
    return None


def save_pretrained(
    model: nn.Module, original: Callable[..., Any], save_directory: Any, **kwargs: Any
) -> None:
    """Write ``model`` (parallelised) to ``save_directory`` as a plain Hugging Face folder in
    the hub layout, every rank writing its share (see the module docstring). Call on every rank
    with the same arguments, as Hugging Face's examples do; ``save_directory`` must be storage
    every rank sees. ``max_shard_size`` caps each file (every writing rank writes at least one);
    ``safe_serialization`` must stay true; ``is_main_process`` is ignored (every rank writes).
    ``original`` (Hugging Face's own ``save_pretrained``) is not called: it would need the
    whole state dict on one rank.

    ``ValueError`` on every rank, before any communication, for ``state_dict=`` (the state dict
    is the model's own), ``distributed_checkpoint=True`` (use ``torch.distributed.checkpoint``:
    README, "Checkpoints"), ``push_to_hub=True`` (push the written folder instead),
    ``variant=``, ``safe_serialization=False`` and a ``max_shard_size`` that is not a size.
    ``RuntimeError`` on every rank when a rank failed to write (that rank re-raises its own
    error)."""
    del original
    limit = _check_options(kwargs)
    plan = plan_of(model, "save_pretrained")
    failure: BaseException | None = None
    try:
        why = _write(model, plan, os.fspath(save_directory), limit)
        if why is not None:
            failure = RuntimeError(f"save_pretrained({save_directory!r}) failed: {why}")
    except Exception as exc:  # the first rank's index or config: every rank must learn of it
        failure = exc
    _agree(failure, plan.mesh.batch, save_directory)


def _check_options(kwargs: dict[str, Any]) -> int | None:
    """The options every rank refuses alike, before any communication (see
    :func:`save_pretrained`); returns the file size limit in bytes (None: one file)."""
    for key in _UNSUPPORTED:
        if kwargs.get(key) not in (None, False):  # an empty state dict too
            raise ValueError(
                f"save_pretrained({key}=...) is not supported on a parallelised model: every "
                "rank writes its share of the model's own weights to one plain folder; for "
                "sharded checkpoints use torch.distributed.checkpoint (hp-models README)"
            )
    if kwargs.get("safe_serialization", True) is False:
        raise ValueError(
            "save_pretrained(safe_serialization=False) is not supported: it writes safetensors"
        )
    return _shard_limit(kwargs.get("max_shard_size"))


def save_pipeline(parts: list[nn.Module], job: Any, save_directory: Any, **kwargs: Any) -> None:
    """:func:`save_pretrained` of a pipeline: ``parts`` are this rank's stages (each a model
    parallelised by ``parallelize_model``) and ``job`` the 1-D mesh of every rank of the
    pipeline. Each stage's tensors are gathered over its own ranks and shared out among them
    (steps 1–2), then every rank of the job writes its files and the job's first rank the
    index and config: one folder, no rank holding a stage, let alone the model. The same
    options and errors as :func:`save_pretrained`."""
    limit = _check_options(kwargs)
    me = int(torch.distributed.get_rank())
    failure: BaseException | None = None
    mine: dict[str, Tensor] = {}
    error: str | None = None
    try:
        for part in parts:  # in stage order: the same on every rank of one pp coordinate
            plan = plan_of(part, "save_pretrained")
            ranks = [int(r) for r in plan.mesh.batch.mesh.flatten().tolist()]
            mine.update(_share(part, plan, ranks, me))
    except Exception as exc:  # told to every rank through the exchanges of step 3
        error = f"{type(exc).__name__}: {exc}"
    try:
        why = _write_files(mine, parts[0], job, os.fspath(save_directory), limit, error)
        if why is not None:
            failure = RuntimeError(f"save_pretrained({save_directory!r}) failed: {why}")
    except Exception as exc:
        failure = exc
    _agree(failure, job, save_directory)


def _agree(failure: BaseException | None, job: Any, save_directory: Any) -> None:
    """Step 4: every rank of ``job`` returns, or every rank raises, together."""
    flag = torch.tensor([0 if failure is None else 1], dtype=torch.int32)
    flag = flag.to(mesh_device(job))
    g = comm.resolve_group(job, "save_pretrained")
    comm.start_all_reduce(flag, g, "all_reduce:save_failed", "save", OWNER).wait()
    if failure is not None:
        raise failure
    if int(flag.item()):
        raise RuntimeError(
            f"save_pretrained({save_directory!r}) failed on another rank; see its error"
        )


def save_pretrained_member(original: type) -> Callable[..., None]:
    """``save_pretrained`` of the parallelised class made from ``original`` (a Hugging Face
    ``PreTrainedModel`` subclass): :func:`save_pretrained` of the module it is called on (a
    method of the class, so a deep copy writes its own weights)."""
    write: Any = getattr(original, "save_pretrained")  # noqa: B009 (a class attribute, by name)

    @functools.wraps(write)
    def member(self: nn.Module, save_directory: Any, **kwargs: Any) -> None:
        save_pretrained(self, write.__get__(self), save_directory, **kwargs)

    return member
