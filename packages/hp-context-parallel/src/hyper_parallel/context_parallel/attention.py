"""The attention after the Ulysses exchange, behind one seam.

After the sequence→head exchange each rank holds every token of its heads:
``q, k [B, S, h, dq]``, ``v [B, S, h, dv]``. :func:`attend` computes the causal softmax
attention over them — document-causal when a packed-documents table ``cu_seqlens`` (the
global offsets ``[0, …, S]``, ``B == 1``, validated by the caller) is given — with one of two
implementations of the same signature ``(q, k, v, scale, cu_seqlens) -> [B, S, h, dv]``:

- ``"sdpa"`` (:func:`sdpa_attention`, the reference): torch's
  ``scaled_dot_product_attention``, causal, or with the dense ``[S, S]`` document mask
  (:func:`~hyper_parallel.context_parallel.mla.document_mask`).
- ``"npu"`` (:func:`npu_attention`): Ascend's fused ``torch_npu.npu_fusion_attention``.
  Plain causal: layout ``"BSND"``. Packed documents: its variable-length form, layout
  ``"TND"`` (the row's ``S`` tokens, ``[T, h, d]``) with ``actual_seq_qlen`` =
  ``actual_seq_kvlen`` = the documents' cumulative end offsets ``cu_seqlens[1:]`` as a
  Python list (from ``offsets``, the host copy admission read, when the caller passes it:
  then nothing is read back from the device), so no ``S × S`` mask is built. Both use
  ``sparse_mode=3`` (causal, aligned bottom-right, which equals top-left causal since every
  document's query and key lengths are equal) with the ``2048 × 2048`` compressed
  upper-triangular ``atten_mask`` (True = masked) that mode takes. When ``dv != dq`` the
  narrower operand is zero-padded to the wider head dim and the output sliced (zero columns
  change neither ``q·k`` nor the kept output).

:func:`attention_backend` chooses from the tensors' device type and dtype only: ``"npu"`` for
float16/bfloat16/float32 tensors on an ``npu`` device (the dtypes the fused op takes), else
``"sdpa"``. The attention is local (no collective depends on the choice), and the device type
and dtype are the same on every rank, so every rank takes the same branch. ``torch_npu`` is
imported only when the npu branch runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from hyper_parallel.context_parallel.mla import causal_attention, document_causal_attention

__all__ = ["BACKENDS", "attend", "attention_backend", "npu_attention", "sdpa_attention"]

BACKENDS = ("sdpa", "npu")
NPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_COMPRESSED_MASK = 2048  # the side of the atten_mask sparse_mode 2/3 takes
_forced: str | None = None  # tests only: see _force_backend
_masks: dict[torch.device, Tensor] = {}


def attention_backend(device_type: str, dtype: torch.dtype) -> str:
    """``"npu"`` for ``NPU_DTYPES`` tensors on an ``npu`` device, else ``"sdpa"``."""
    if _forced is not None:
        return _forced
    return "npu" if device_type == "npu" and dtype in NPU_DTYPES else "sdpa"


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    cu_seqlens: Tensor | None = None,
    *,
    offsets: Sequence[int] | None = None,
) -> Tensor:
    """Causal (``cu_seqlens`` None) or document-causal attention on ``q, k [B, S, h, dq]``,
    ``v [B, S, h, dv]`` holding every token of the sequence -> ``[B, S, h, dv]``, by the
    implementation :func:`attention_backend` picks for ``q``. ``offsets``: optionally the
    values of ``cu_seqlens`` as host ints (the caller's validated copy), so that an
    implementation needing them on the host (npu) reads nothing back from the device."""
    impl = _IMPLEMENTATIONS[attention_backend(q.device.type, q.dtype)]
    return impl(q, k, v, scale, cu_seqlens, offsets=offsets)


def sdpa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    cu_seqlens: Tensor | None = None,
    *,
    offsets: Sequence[int] | None = None,
) -> Tensor:
    """The reference implementation (torch sdpa); the contract of :func:`attend` (the mask is
    built on the device from ``cu_seqlens``; ``offsets`` is not needed)."""
    if cu_seqlens is None:
        return causal_attention(q, k, v, scale)
    return document_causal_attention(q, k, v, scale, cu_seqlens)


def npu_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    cu_seqlens: Tensor | None = None,
    *,
    offsets: Sequence[int] | None = None,
) -> Tensor:
    """:func:`attend` through ``torch_npu.npu_fusion_attention`` (see the module docstring);
    the op's own autograd gives the backward. The ``TND`` form takes the offsets as host ints:
    ``offsets`` if given, else read from ``cu_seqlens`` (a device-to-host sync if it is on
    the device)."""
    import torch_npu  # only on the npu branch: never imported on other devices

    h, dq = q.shape[-2:]
    dv = v.shape[-1]
    d = max(dq, dv)
    if dq < d:
        q, k = F.pad(q, (0, d - dq)), F.pad(k, (0, d - dq))
    if dv < d:
        v = F.pad(v, (0, d - dv))
    kwargs: dict[str, Any] = {
        "atten_mask": _causal_mask(q.device),
        "scale": scale,
        "keep_prob": 1.0,
        "sparse_mode": 3,
    }
    if cu_seqlens is None:
        out = torch_npu.npu_fusion_attention(q, k, v, h, "BSND", **kwargs)[0]
    else:
        ends = [int(e) for e in (offsets[1:] if offsets is not None else cu_seqlens[1:].tolist())]
        kwargs.update(actual_seq_qlen=ends, actual_seq_kvlen=ends)
        out = torch_npu.npu_fusion_attention(q[0], k[0], v[0], h, "TND", **kwargs)[0][None]
    return out[..., :dv] if dv < d else out


def _causal_mask(device: torch.device) -> Tensor:
    """The compressed causal ``atten_mask`` (True above the diagonal), one per device."""
    mask = _masks.get(device)
    if mask is None:
        n = _COMPRESSED_MASK
        mask = torch.ones(n, n, dtype=torch.bool, device=device).triu_(1)
        _masks[device] = mask
    return mask


_IMPLEMENTATIONS: dict[str, Callable[..., Tensor]] = {
    "sdpa": sdpa_attention,
    "npu": npu_attention,
}


@contextlib.contextmanager
def _force_backend(name: str) -> Iterator[None]:
    """Tests only: route :func:`attend` to ``name`` whatever the device (e.g. the npu branch
    on CPU tensors with a ``torch_npu`` test double in ``sys.modules``)."""
    global _forced
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    previous, _forced = _forced, name
    try:
        yield
    finally:
        _forced = previous
