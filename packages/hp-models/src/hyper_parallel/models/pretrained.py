"""``from_pretrained``: a downloaded Hugging Face folder loaded straight into a parallelised
model, each rank reading only the slices it holds.

1. ``config.json`` names the stock class (:func:`~hyper_parallel.models.families.family_of_config`);
   the model is built with its parameters on the meta device (buffers, small, are real and
   initialised as the stock model initialises them);
2. every tensor the model needs is checked against the folder's safetensors headers (present,
   right shape; FP8 weights with their block scales), on every rank alike, before anything is
   communicated: a bad folder is one ``ValueError`` on every rank, naming the tensor;
3. :func:`~hyper_parallel.models.parallelize_model` places the meta parameters (experts split
   over ``ep``, MLPs over ``tp``, FSDP2 shards): nothing is allocated yet;
4. each rank allocates its own shards and fills each one with the box of the runtime tensor it
   holds (:mod:`~hyper_parallel.models.regions`), read as regions of the hub tensors that make
   it up (:mod:`~hyper_parallel.models.hub`): a rank holding experts 8–15 of a layer reads
   experts 8–15; FP8 blocks are dequantised to ``dtype`` region by region.

No rank reads, allocates or gathers the whole model. Tensors of the folder the model has no
place for (DeepSeek-V3's multi-token-prediction layer ``model.layers.61.*``) are not read.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hyper_parallel.dtensor import DeviceMesh
from hyper_parallel.models.families import ModelFamily, family_of_config
from hyper_parallel.models.hub import HubFolder, model_tensors
from hyper_parallel.models.parallelize import parallelize_model
from hyper_parallel.models.regions import local_box, mesh_device

__all__ = ["LoadReport", "from_pretrained", "load_report"]

_REPORT = "_hp_load_report"


@dataclass(frozen=True)
class LoadReport:
    """What one rank's :func:`from_pretrained` did: the folder, the family, the bytes of
    tensor data it read (FP8 scales included) out of the folder's total, how many regions and
    hub tensors it read, and the seconds it took (build, place, read)."""

    path: str
    family: str
    bytes_read: int
    folder_bytes: int
    regions: int
    tensors: int
    seconds: float


def load_report(model: Any) -> LoadReport | None:
    """The :class:`LoadReport` of a model made by :func:`from_pretrained` (``None`` else)."""
    return getattr(model, _REPORT, None)


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Parameters registered inside are made on the meta device; buffers stay real (the stock
    initialisation of rotary tables and router biases runs as usual)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: Any) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            kind = type(param)
            module._parameters[name] = kind(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _build(folder: HubFolder, fam: ModelFamily, dtype: Any, impl: dict[str, Any]) -> nn.Module:
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder.path)
    # the weights are dequantised here: the model is built unquantised
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    cls = getattr(transformers, fam.causal_lm)
    kwargs = {k: v for k, v in impl.items() if v is not None}
    if dtype is None:
        dtype = getattr(config, "dtype", None) or torch.float32
    with _parameters_on_meta():
        model = cls._from_config(config, dtype=dtype, **kwargs)
    return model


def _check_folder(folder: HubFolder, fam: ModelFamily, model: nn.Module) -> None:
    problems = []
    for key, t in model_tensors(model).items():
        for piece in fam.hub.pieces(key, tuple(t.shape)):
            why = folder.check(piece, key)
            if why is not None:
                problems.append(why)
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise ValueError(
            f"{folder.path!r} does not fit a {fam.causal_lm} of this config: "
            + "; ".join(problems[:5])
            + more
        )


def _fill(folder: HubFolder, fam: ModelFamily, model: nn.Module) -> None:
    with torch.no_grad():
        for key, t in model_tensors(model).items():
            local = t.to_local() if hasattr(t, "to_local") else t
            box = local_box(t)
            if box.numel() == 0:
                continue
            for piece in fam.hub.pieces(key, tuple(t.shape)):
                lo = [max(a, b) for a, b in zip(piece.box.offset, box.offset)]
                hi = [
                    min(a + n, b + m)
                    for a, n, b, m in zip(piece.box.offset, piece.box.shape, box.offset, box.shape)
                ]
                if any(h <= low for low, h in zip(lo, hi)):
                    continue
                src = tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, piece.box.offset))[
                    piece.lead :
                ]
                dst = tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, box.offset))
                data = folder.read(piece.key, src, local.dtype)
                local[dst] = data.reshape(local[dst].shape).to(local.device)


def _materialise(model: nn.Module, device: torch.device) -> None:
    """Allocate the meta parameters (each rank's own shards) on ``device``; buffers keep their
    values and tied parameters stay one parameter (``to_empty`` would untie them)."""
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    tied = _tied(model)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, value in buffers.items():
            model.get_buffer(name).copy_(value)
    for name, first in tied.items():
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, model.get_parameter(first))


def _tied(model: nn.Module) -> dict[str, str]:
    """Parameter names that are the same object as an earlier one (tied weights): name ->
    the first name."""
    seen: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            out[name] = seen[id(p)]
        else:
            seen[id(p)] = name
    return out


def from_pretrained(
    path: str | os.PathLike[str],
    mesh: DeviceMesh,
    *,
    dtype: torch.dtype | None = None,
    ep: int = 1,
    attn_implementation: str | None = None,
    experts_implementation: str | None = None,
    **kwargs: Any,
) -> Any:
    """Load the Hugging Face folder ``path`` into a model parallelised over ``mesh``, every rank
    reading only its own slices (see the module docstring). Call on every rank with the same
    arguments.

    ``path``: a folder in the hub layout (``config.json``; ``model.safetensors`` or shards and
    ``model.safetensors.index.json``), as downloaded or as ``save_pretrained`` (stock or
    hp-models') writes it; the config must name ``KimiLinearForCausalLM`` or
    ``DeepseekV3ForCausalLM``. ``mesh``, ``ep`` and ``kwargs`` (``grad_reduction``,
    ``mp_policy``, ``mla_strategy``, ``overlap``, ``kda_protocol``, ``local_kernel``) go to
    :func:`~hyper_parallel.models.parallelize_model`. ``dtype``: the parameters' dtype (``None``:
    the config's ``dtype``); FP8 weights (``quantization_config.quant_method == "fp8"``) are
    dequantised to it. ``attn_implementation`` / ``experts_implementation``: as in
    transformers' ``from_pretrained``.

    The parameters land on the mesh's device (the current one of its type). Returns the
    parallelised ``*ForCausalLM``; :func:`load_report` tells what this rank read.

    A pipeline: a mesh with a ``"pp"`` dim (or ``microbatches=`` given) goes to
    :func:`~hyper_parallel.models.pipeline_model` instead (``microbatches``, ``schedule``,
    ``stages_per_rank``, ``layer_split`` with the rest), which returns this rank's
    :class:`~hyper_parallel.models.PipelinedModel`: each rank allocates and reads the tensors of
    its own stages only.

    Raised on every rank alike, before any communication: ``ValueError`` for a folder that is
    not a Hugging Face model, or whose tensors are missing or of another shape than the config
    needs (naming them); ``TypeError`` for a config of a model hp-models does not parallelise;
    whatever ``parallelize_model`` raises for the mesh and options."""
    start = time.perf_counter()
    folder = HubFolder(path)
    fam = family_of_config(folder.config)
    model = _build(
        folder,
        fam,
        dtype,
        {
            "attn_implementation": attn_implementation,
            "experts_implementation": experts_implementation,
        },
    )
    _check_folder(folder, fam, model)
    pipelined = "microbatches" in kwargs or "pp" in (getattr(mesh, "mesh_dim_names", None) or ())
    if pipelined:  # each rank builds and reads its own stages only
        from hyper_parallel.models.pipeline import pipeline_model

        if "microbatches" not in kwargs:
            raise TypeError("from_pretrained over a mesh with 'pp' needs microbatches=")
        result: Any = pipeline_model(model, mesh, ep=ep, **kwargs)
        parts = list(result.parts)
    else:
        result = parallelize_model(model, mesh, ep=ep, **kwargs)
        parts = [model]
    for part in parts:
        _materialise(part, mesh_device(mesh))
        _fill(folder, fam, part)
    folder.close()
    report = LoadReport(
        path=folder.path,
        family=fam.name,
        bytes_read=folder.stats.bytes,
        folder_bytes=sum(folder.nbytes(k) for k in folder.meta),
        regions=folder.stats.regions,
        tensors=len(folder.stats.tensors),
        seconds=time.perf_counter() - start,
    )
    object.__setattr__(result, _REPORT, report)
    return result
