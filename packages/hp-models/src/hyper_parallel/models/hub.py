"""The Hugging Face hub layout of a model family, and reading regions of it from safetensors.

transformers 5.23 runs a model in a *runtime* layout (fused experts ``experts.gate_up_proj``
``[E, 2I, H]``, Kimi-Linear's one ``conv1d`` for q/k/v, ...) and converts from and to the *hub*
layout that checkpoints on the hub use and stock ``save_pretrained`` writes (per-expert
``experts.{e}.gate_proj.weight`` ``[I, H]``; Kimi's ``block_sparse_moe``, ``w1/w2/w3``, the
separate q/k/v convolutions). A :class:`HubLayout` says, for one family, which hub tensors make
up a runtime tensor and where each one sits in it (:class:`Piece`): so a rank that holds a
region of a runtime tensor (a box: :mod:`hyper_parallel.models.regions`) reads only the
regions of the hub tensors that fall inside it, and a rank that writes computes each hub tensor
from the runtime region that holds it.

:class:`HubFolder` is a downloaded model folder: ``config.json`` and safetensors files
(``model.safetensors`` or shards with ``model.safetensors.index.json``). Only the headers are
read up front; :meth:`HubFolder.read` reads one region of one tensor through safetensors'
memory-mapped slices (the file pages it touches, nothing else), dequantising DeepSeek-V3's FP8
blocks (``float8_e4m3fn`` with a float32 ``weight_scale_inv`` per ``128×128`` block, edge blocks
partial) to the requested dtype.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from hyper_parallel.models.regions import Box

__all__ = ["Fused", "HubFolder", "HubLayout", "Piece", "model_tensors", "per_expert_gate_up_down"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SCALE_SUFFIX = "_scale_inv"  # DeepSeek-V3 FP8: ``x.weight`` is scaled by ``x.weight_scale_inv``


@dataclass(frozen=True)
class Fused:
    """A runtime tensor ``<prefix>.<suffix>`` made of the hub tensors ``<hub prefix>.<part>``
    concatenated along ``dim`` (in a part's frame), in equal sizes. ``per_expert``: the runtime
    tensor has a leading expert dim ``E`` and each part names ``{e}``, one hub tensor per
    expert."""

    suffix: str
    parts: tuple[str, ...]
    dim: int = 0
    per_expert: bool = False


def per_expert_gate_up_down() -> tuple[Fused, ...]:
    """The experts as most hub folders store them (DeepSeek-V3, Qwen3-Next, ...): one
    ``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj`` weight an expert, making the
    runtime ``experts.gate_up_proj [E, 2I, H]`` and ``experts.down_proj [E, H, I]``."""
    return (
        Fused(
            "experts.gate_up_proj",
            ("experts.{e}.gate_proj.weight", "experts.{e}.up_proj.weight"),
            per_expert=True,
        ),
        Fused("experts.down_proj", ("experts.{e}.down_proj.weight",), per_expert=True),
    )


@dataclass(frozen=True)
class Piece:
    """Hub tensor ``key`` sits at ``box`` of the runtime tensor; its own shape is
    ``box.shape[lead:]`` (``lead`` = 1 for a per-expert part: the expert dim, size 1)."""

    key: str
    box: Box
    lead: int = 0

    @property
    def hub_shape(self) -> tuple[int, ...]:
        return self.box.shape[self.lead :]


@dataclass(frozen=True)
class HubLayout:
    """``renames``: ``(runtime regex, hub replacement)`` applied in order to a runtime key (or
    to a fused tensor's prefix); ``fused``: the runtime tensors made of several hub tensors."""

    renames: tuple[tuple[str, str], ...] = ()
    fused: tuple[Fused, ...] = ()

    def hub_name(self, runtime: str) -> str:
        for pattern, repl in self.renames:
            runtime = re.sub(pattern, repl, runtime)
        return runtime

    def pieces(self, key: str, shape: tuple[int, ...]) -> list[Piece]:
        """The hub tensors of runtime tensor ``key`` of (global) ``shape``."""
        for f in self.fused:
            if key == f.suffix or key.endswith("." + f.suffix):
                return self._fused(f, key, shape)
        return [Piece(self.hub_name(key), Box((0,) * len(shape), tuple(shape)))]

    def _fused(self, f: Fused, key: str, shape: tuple[int, ...]) -> list[Piece]:
        prefix = self.hub_name(key[: len(key) - len(f.suffix)])
        lead = 1 if f.per_expert else 0
        inner = list(shape[lead:])
        d = f.dim
        if d >= len(inner) or inner[d] % len(f.parts):
            raise ValueError(
                f"{key}: shape {tuple(shape)} cannot hold {len(f.parts)} equal parts "
                f"{list(f.parts)} along dim {d}"
            )
        width = inner[d] // len(f.parts)
        out = []
        for e in range(shape[0]) if f.per_expert else [None]:
            for j, part in enumerate(f.parts):
                off = [0] * len(inner)
                off[d] = j * width
                size = list(inner)
                size[d] = width
                if e is None:
                    out.append(Piece(prefix + part, Box(tuple(off), tuple(size))))
                else:
                    name = prefix + part.format(e=e)
                    out.append(Piece(name, Box((e, *off), (1, *size)), lead=1))
        return out


@dataclass
class ReadStats:
    """What one rank read: bytes of tensor data (scales included), tensor regions, and the
    hub tensors it touched."""

    bytes: int = 0
    regions: int = 0
    tensors: set[str] = field(default_factory=set)


def _header(path: str) -> dict[str, Any]:
    """A safetensors file's JSON header (tensor name -> dtype, shape, offsets), read alone."""
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        if n <= 0 or n > 100_000_000:
            raise ValueError(f"{path} is not a safetensors file")
        head = json.loads(fh.read(n))
    head.pop("__metadata__", None)
    return dict(head)


_ITEMSIZE = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8,
             "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}  # fmt: skip


class HubFolder:
    """A Hugging Face model folder: its config (``config.json``, parsed) and the tensors of its
    safetensors files (headers read here; data only through :meth:`read`). ``ValueError`` for a
    folder without ``config.json`` or safetensors weights, naming what is missing."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        cfg = os.path.join(self.path, "config.json")
        if not os.path.isdir(self.path) or not os.path.isfile(cfg):
            raise ValueError(
                f"{self.path!r} is not a Hugging Face model folder: it has no config.json"
            )
        with open(cfg) as fh:
            self.config: dict[str, Any] = json.load(fh)
        index = os.path.join(self.path, INDEX)
        if os.path.isfile(index):
            with open(index) as fh:
                weight_map: dict[str, str] = json.load(fh)["weight_map"]
            files = sorted(set(weight_map.values()))
        elif os.path.isfile(os.path.join(self.path, SINGLE)):
            files = [SINGLE]
        else:
            raise ValueError(
                f"{self.path!r} has no safetensors weights ({SINGLE} or {INDEX}); hp-models "
                "loads the safetensors hub layout only"
            )
        self.files: dict[str, str] = {}
        self.meta: dict[str, dict[str, Any]] = {}
        for name in files:
            full = os.path.join(self.path, name)
            if not os.path.isfile(full):
                raise ValueError(f"{self.path!r}: {name}, named by {INDEX}, is missing")
            for key, info in _header(full).items():
                self.files[key] = name
                self.meta[key] = info
        q = self.config.get("quantization_config") or {}
        self.fp8_block: tuple[int, int] | None = None
        if q.get("quant_method") == "fp8":
            block = q.get("weight_block_size") or [128, 128]
            self.fp8_block = (int(block[0]), int(block[1]))
        self.stats = ReadStats()
        self._handles: dict[str, Any] = {}

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.meta[key]["shape"])

    def stored_dtype(self, key: str) -> str:
        return str(self.meta[key]["dtype"])

    def nbytes(self, key: str) -> int:
        n = _ITEMSIZE.get(self.stored_dtype(key), 4)
        for s in self.shape(key):
            n *= s
        return n

    def check(self, piece: Piece, runtime_key: str) -> str | None:
        """Why ``piece`` cannot be read from this folder (``None`` when it can)."""
        if piece.key not in self.meta:
            return f"{piece.key} (for {runtime_key}) is missing"
        if self.shape(piece.key) != piece.hub_shape:
            return (
                f"{piece.key} (for {runtime_key}) has shape {list(self.shape(piece.key))}, "
                f"the model needs {list(piece.hub_shape)}"
            )
        if self.stored_dtype(piece.key).startswith("F8"):
            scale = piece.key + SCALE_SUFFIX
            if self.fp8_block is None:
                return f"{piece.key} is float8 but config.json has no fp8 quantization_config"
            if len(piece.hub_shape) != 2:
                return f"{piece.key}: float8 blocks are supported for 2-D weights only"
            want = [-(-n // b) for n, b in zip(piece.hub_shape, self.fp8_block)]
            if scale not in self.meta:
                return f"{piece.key} is float8 but its {scale} is missing"
            if list(self.shape(scale)) != want:
                return f"{scale} has shape {list(self.shape(scale))}, blocks need {want}"
        return None

    def _slice(self, key: str, region: tuple[slice, ...]) -> Tensor:
        from safetensors import safe_open

        name = self.files[key]
        handle = self._handles.get(name)
        if handle is None:
            handle = safe_open(os.path.join(self.path, name), framework="pt")
            self._handles[name] = handle
        t = handle.get_slice(key)[region] if region else handle.get_tensor(key)
        self.stats.bytes += t.numel() * t.element_size()
        self.stats.regions += 1
        self.stats.tensors.add(key)
        return t

    def read(self, key: str, region: tuple[slice, ...], dtype: torch.dtype) -> Tensor:
        """``tensor[region]`` of hub tensor ``key`` as ``dtype`` (float8 blocks dequantised:
        ``w · scale_inv`` of the block each element falls in, in float32)."""
        t = self._slice(key, region)
        if not self.stored_dtype(key).startswith("F8"):
            return t.to(dtype)
        assert self.fp8_block is not None
        (r, c), (br, bc) = region, self.fp8_block
        s0, s1 = r.start // br, c.start // bc
        e0, e1 = -(-r.stop // br), -(-c.stop // bc)
        scale = self._slice(key + SCALE_SUFFIX, (slice(s0, e0), slice(s1, e1))).float()
        full = scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)
        full = full[r.start - s0 * br : r.stop - s0 * br, c.start - s1 * bc : c.stop - s1 * bc]
        return (t.float() * full).to(dtype)

    def close(self) -> None:
        self._handles.clear()


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint holds, by state-dict key: every parameter (a tied one once) and
    every persistent buffer."""
    out: dict[str, torch.Tensor] = dict(model.named_parameters())
    for mod_name, mod in model.named_modules():
        for name, buf in mod.named_buffers(recurse=False):
            if buf is not None and name not in mod._non_persistent_buffers_set:
                out[f"{mod_name}.{name}" if mod_name else name] = buf
    return out
