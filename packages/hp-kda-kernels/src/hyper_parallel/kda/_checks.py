"""Input validation shared by the references, the summaries, the merges and the layer.

Every check here is local and depends only on shapes, dtypes and devices, so ranks that pass
the same kind of input raise the same ``ValueError`` before any communication.
"""

from __future__ import annotations

from typing import Any

import torch

from hyper_parallel.dtensor import check_documents

SUPPORTED_KERNEL_DIMS = (16, 32, 64, 128)
"""K and V values the Triton kernels compile for (powers of two, 16..128)."""


def state_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 state for fp32/bf16/fp16 inputs; fp64 inputs keep fp64 (used by references)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def check_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
) -> tuple[int, int, int, int, int]:
    """Validate the flash-linear-attention layouts; return ``(B, T, H, K, V)``."""
    named = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    for name, x in named.items():
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if k.dim() != 4:
        raise ValueError(f"k must be [B, T, H, K], got shape {tuple(k.shape)}")
    B, T, H, K = k.shape
    for name in ("q", "g"):
        if named[name].shape != k.shape:
            raise ValueError(
                f"{name} must have k's shape [B, T, H, K] = {tuple(k.shape)}, got "
                f"{tuple(named[name].shape)}"
            )
    if v.dim() != 4 or tuple(v.shape[:3]) != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    V = v.shape[3]
    if tuple(beta.shape) != (B, T, H):
        raise ValueError(f"beta must be [B, T, H] = [{B}, {T}, {H}], got {tuple(beta.shape)}")
    if K < 1 or V < 1:
        raise ValueError(f"K and V must be positive, got K={K}, V={V}")
    devices = {x.device for x in named.values()}
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor) or not initial_state.is_floating_point():
            raise ValueError("initial_state must be a floating-point tensor [B, H, K, V]")
        if tuple(initial_state.shape) != (B, H, K, V):
            raise ValueError(
                f"initial_state must be [B, H, K, V] = [{B}, {H}, {K}, {V}], got "
                f"{tuple(initial_state.shape)}"
            )
        devices.add(initial_state.device)
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")
    return B, T, H, K, V


def check_chunk_size(chunk_size: object) -> int:
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    return chunk_size


def check_summary_pair(
    states: torch.Tensor, matrices: torch.Tensor, *, lead: int, what: str = "S/M"
) -> tuple[int, ...]:
    """Validate ``states [*lead, B, H, K, V]`` and ``matrices [*lead, B, H, K, K]`` (fp32,
    one device, unit column stride); return the shared leading dims plus ``(B, H, K, V)``."""
    for name, x in (("states", states), ("matrices", matrices)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{what}: {name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype != torch.float32:
            raise ValueError(f"{what}: {name} must be float32 (fp32 summaries only), got {x.dtype}")
        if x.dim() != lead + 4:
            raise ValueError(
                f"{what}: {name} must have {lead + 4} dims, got shape {tuple(x.shape)}"
            )
        if x.shape[-1] > 1 and x.stride(-1) != 1:
            raise ValueError(
                f"{what}: {name} must have unit column stride, got strides {x.stride()}"
            )
    if states.device != matrices.device:
        raise ValueError(f"{what}: states on {states.device} but matrices on {matrices.device}")
    *lead_s, B, H, K, V = states.shape
    *lead_m, Bm, Hm, K1, K2 = matrices.shape
    if lead_s != lead_m or (B, H, K) != (Bm, Hm, K1) or K1 != K2:
        raise ValueError(
            f"{what}: states {tuple(states.shape)} and matrices {tuple(matrices.shape)} do not "
            "match ([..., B, H, K, V] and [..., B, H, K, K])"
        )
    return (*lead_s, B, H, K, V)


def check_kernel_dims(K: int, V: int) -> str | None:
    """Why the Triton kernels cannot serve these dims, or None when they can."""
    if K not in SUPPORTED_KERNEL_DIMS or V not in SUPPORTED_KERNEL_DIMS:
        return f"K={K}, V={V}: the Triton kernels need K and V in {SUPPORTED_KERNEL_DIMS}"
    return None


def check_cu_seqlens(cu_seqlens: object, B: int, T: int | None, what: str) -> list[int]:
    """A packed-documents table (flash-linear-attention's ``cu_seqlens``) checked by hp-dtensor's
    one validator (:func:`~hyper_parallel.dtensor.check_documents`: 1-D integer ``[0, …, T]``
    strictly increasing, ``B == 1``; ``T`` None: the end is checked by the caller). Returns the
    offsets as ints."""
    return list(check_documents(cu_seqlens, total=T, batch=B, what=f"{what}: cu_seqlens"))


def document_resets(offsets: list[int], start: int, T: int, device: torch.device) -> torch.Tensor:
    """``[1, T]`` 0/1 float32: 1 at the tokens of the block ``[start, start + T)`` where a
    document other than the first begins (the state is zeroed before their update)."""
    r = torch.zeros(1, T, dtype=torch.float32)
    for o in offsets[1:-1]:
        if start <= o < start + T:
            r[0, o - start] = 1.0
    return r.to(device)


def table_values(cu_seqlens: Any) -> Any:
    """A ``cu_seqlens`` table as compared across ranks in consistency mode: its values (None
    for none). Only reads (hp-dtensor's ``checked_entry`` guards it)."""
    if cu_seqlens is None:
        return None
    return tuple(int(x) for x in cu_seqlens.reshape(-1).tolist())
