"""Affine folds of packed chunk summaries: the forward prefix and the backward transposed suffix.

A rank's chunk is the affine map ``h_out = M h_in + S``. ``affine_merge`` folds the summaries of
every earlier rank (forward: ``acc = 0; for j < r: acc = M_j acc + S_j``) or the gradients of
every later rank (backward: ``acc = 0; for j = P-1 … r+1: acc = M_jᵀ acc + G_j``).
``affine_scan`` folds an ordered ``range`` of group slots from an incoming state and can return
the intermediate prefix too (the grouped exchange needs both). Two fold kernels share one
signature, chosen with ``kernel=``: ``"torch"`` (batched matmuls, always available) and
``"triton"`` (one kernel, fp32 accumulation, exact fp32 dots); ``"auto"`` takes Triton only on
CUDA/NPU when it is importable, K and V are supported and (CUDA) the kernel fits the device's
shared memory, and :func:`choose_kernel` says why. (``backend=``, the keyword's earlier name,
still works with a ``DeprecationWarning``.)
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from ._checks import check_kernel_dims, check_summary_pair
from ._renamed import accepts_backend

__all__ = [
    "KERNELS",
    "affine_merge",
    "affine_scan",
    "choose_backend",
    "choose_kernel",
    "triton_fold_shared_memory",
]

KERNELS = ("auto", "torch", "triton")
"""The values of ``kernel=``: the merge/scan fold kernel."""


def triton_fold_shared_memory(K: int, V: int) -> int:
    """Bytes of shared memory the Triton fold kernel needs on a CUDA device (an estimate).

    The exact-fp32 dots stage both operands in shared memory: one ``KB×KB`` by ``KB×BV`` dot
    per step for K ≤ 64, four of them (the 64-row halves of K = 128) otherwise, plus one
    ``KB×BV`` tile of layout-conversion scratch and 3 KiB of bookkeeping. At K = 128, BV = 64
    that is 147 KiB, what the compiled kernel asks for: more than the 99 KiB of sm_86/sm_89
    cards or the 64 KiB of sm_75, within the 227 KiB of sm_90.
    """
    KB, BV = min(64, K), min(64, V)
    dots = (K // KB) ** 2
    return 4 * (dots * (KB * KB + KB * BV) + KB * BV) + 3 * 1024


def _device_shared_memory(dev: torch.device) -> int | None:
    """Opt-in shared memory per block of a CUDA device in bytes, or None when unknown."""
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return _query_shared_memory(index)


@functools.cache
def _query_shared_memory(index: int) -> int | None:
    try:
        value = getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin", 0)
        if value:
            return int(value)
        import triton

        return int(
            triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]
        )
    except Exception:
        return None


def choose_kernel(
    device: torch.device | str, K: int, V: int, kernel: str = "auto"
) -> tuple[str, str]:
    """Resolve ``kernel`` (the merge/scan fold kernel: ``"auto"``, ``"torch"`` or
    ``"triton"``) for summaries on ``device`` with dims ``K, V``: ``(name, reason)``, ``name``
    ``"torch"`` or ``"triton"``.

    ``"auto"`` takes Triton only on CUDA/NPU when it is importable, K and V are supported and,
    on CUDA, the kernel's shared memory (:func:`triton_fold_shared_memory`) fits the device's
    opt-in limit; otherwise torch, and the reason says why. Raises ``ValueError`` for an
    unknown kernel or an explicit ``"triton"`` that cannot run. Imports Triton only to read a
    CUDA device's limit when torch does not report it.
    """
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNELS}")
    dev = torch.device(device)
    bad_dims = check_kernel_dims(K, V)
    has_triton = importlib.util.find_spec("triton") is not None
    if kernel == "torch":
        return "torch", "requested"
    if kernel == "triton":
        if bad_dims:
            raise ValueError(f"kernel 'triton' does not support these dims: {bad_dims}")
        if not has_triton:
            raise ValueError("kernel 'triton' requested but triton is not installed")
        if dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("kernel 'triton' on CPU tensors needs TRITON_INTERPRET=1")
        if dev.type == "cuda" and (too_big := _shared_memory_problem(dev, K, V)):
            raise ValueError(f"kernel 'triton' cannot run here: {too_big}")
        return "triton", "requested"
    if dev.type not in ("cuda", "npu"):
        return "torch", f"device {dev.type}: the Triton kernels target CUDA/NPU"
    if bad_dims:
        return "torch", bad_dims
    if not has_triton:
        return "torch", "triton is not installed"
    if dev.type == "cuda" and (too_big := _shared_memory_problem(dev, K, V)):
        return "torch", too_big
    return "triton", f"{dev.type} device, triton importable, K={K} and V={V} supported"


@accepts_backend("choose_backend")
def choose_backend(
    device: torch.device | str, K: int, V: int, kernel: str = "auto"
) -> tuple[str, str]:
    """:func:`choose_kernel` under its earlier name (kept; ``backend=`` is accepted with a
    ``DeprecationWarning``)."""
    return choose_kernel(device, K, V, kernel)


def _shared_memory_problem(dev: torch.device, K: int, V: int) -> str | None:
    need, have = triton_fold_shared_memory(K, V), _device_shared_memory(dev)
    if have is None:
        return f"the shared memory of {dev} is unknown; the Triton fold needs {need} B"
    if need > have:
        return (
            f"the Triton fold needs {need // 1024} KiB of shared memory at K={K}, V={V}; "
            f"{dev} allows {have // 1024} KiB per block"
        )
    return None


def _check_index(value: object, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")
    return value


def _fold(
    states: torch.Tensor,
    matrices: torch.Tensor,
    incoming: torch.Tensor | None,
    start: int,
    step: int,
    count: int,
    forward: bool,
    prefix_count: int | None,
    kernel: str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    *_, K, V = states.shape
    name, _ = choose_kernel(states.device, K, V, kernel)
    if name == "triton":
        from ._triton_fold import affine_fold

        if incoming is not None and incoming.stride(-1) != 1:
            incoming = incoming.contiguous()
        return affine_fold(states, matrices, incoming, start, step, count, forward, prefix_count)
    return _torch_fold(states, matrices, incoming, start, step, count, forward, prefix_count)


def _torch_fold(
    states: torch.Tensor,
    matrices: torch.Tensor,
    incoming: torch.Tensor | None,
    start: int,
    step: int,
    count: int,
    forward: bool,
    prefix_count: int | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    _, B, H, K, V = states.shape
    if incoming is None:
        acc = states.new_zeros(B, H, K, V)
    else:
        acc = incoming.to(torch.float32).clone(memory_format=torch.contiguous_format)
    prefix = acc.clone() if prefix_count == 0 else None
    for i in range(count):
        j = start + i * step
        m = matrices[j] if forward else matrices[j].transpose(-1, -2)
        acc = torch.baddbmm(
            states[j].reshape(B * H, K, V), m.reshape(B * H, K, K), acc.reshape(B * H, K, V)
        ).view(B, H, K, V)
        if prefix_count is not None and i + 1 == prefix_count:
            prefix = acc
    return acc.contiguous(), prefix


@accepts_backend("affine_merge")
def affine_merge(
    states: torch.Tensor,
    matrices: torch.Tensor,
    rank: int,
    *,
    forward: bool = True,
    kernel: str = "auto",
) -> torch.Tensor:
    """Fold the gathered summaries of every rank before (forward) or after (backward) ``rank``.

    ``states: [P, B, H, K, V]`` (``S_j`` forward, ``G_j`` backward) and ``matrices:
    [P, B, H, K, K]`` (``M_j``), fp32, unit column stride; views of packed storage are fine.
    Forward returns ``Σ`` folded as ``acc = M_j acc + S_j`` for ``j = 0 … rank-1``; backward
    returns ``acc = M_jᵀ acc + G_j`` for ``j = P-1 … rank+1``. The result is a new contiguous
    ``[B, H, K, V]`` fp32 tensor, zeros when the fold is empty (rank 0 forward, rank P-1
    backward). Not differentiable (the exchange defines its own backward). ``kernel``: the
    fold kernel (:func:`choose_kernel`).
    """
    P = check_summary_pair(states, matrices, lead=1, what="affine_merge")[0]
    rank = _check_index(rank, "rank")
    if not 0 <= rank < P:
        raise ValueError(f"affine_merge: rank {rank} outside [0, {P})")
    if forward:
        start, step, count = 0, 1, rank
    else:
        start, step, count = P - 1, -1, P - 1 - rank
    with torch.no_grad():
        out, _ = _fold(states, matrices, None, start, step, count, forward, None, kernel)
    return out


@accepts_backend("affine_scan")
def affine_scan(
    maps: tuple[torch.Tensor, torch.Tensor],
    incoming: torch.Tensor | None,
    indices: range,
    *,
    forward: bool = True,
    prefix_count: int | None = None,
    kernel: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Fold the group slots ``indices`` (in that order) starting from ``incoming``.

    ``maps = (states [w, B, H, K, V], matrices [w, B, H, K, K])`` (fp32, unit column stride);
    ``incoming: [B, H, K, V]`` or None (zeros); ``indices`` a ``range`` with step +1 or -1 whose
    values lie in ``[0, w)``. Each step is ``acc = M_i acc + S_i`` (forward) or
    ``acc = M_iᵀ acc + S_i`` (backward). Returns the final ``[B, H, K, V]``; with
    ``prefix_count = c`` returns ``(acc after c steps, final)``, ``0 <= c <= len(indices)``.
    ``kernel``: the fold kernel (:func:`choose_kernel`).
    """
    if not isinstance(maps, (tuple, list)) or len(maps) != 2:
        raise ValueError("affine_scan: maps must be a pair (states, matrices)")
    states, matrices = maps
    w, B, H, K, V = check_summary_pair(states, matrices, lead=1, what="affine_scan")
    if not isinstance(indices, range) or indices.step not in (1, -1):
        raise ValueError(f"affine_scan: indices must be a range with step 1 or -1, got {indices!r}")
    if len(indices) and not (0 <= min(indices) and max(indices) < w):
        raise ValueError(f"affine_scan: indices {indices!r} outside the {w} group slots")
    if incoming is not None:
        if not isinstance(incoming, torch.Tensor) or tuple(incoming.shape) != (B, H, K, V):
            raise ValueError(f"affine_scan: incoming must be [B, H, K, V] = {(B, H, K, V)}")
        if incoming.dtype != torch.float32 or incoming.device != states.device:
            raise ValueError("affine_scan: incoming must be float32 on the summaries' device")
    if prefix_count is not None:
        _check_index(prefix_count, "prefix_count")
        if not 0 <= prefix_count <= len(indices):
            raise ValueError(
                f"affine_scan: prefix_count {prefix_count} outside [0, {len(indices)}]"
            )
    start = indices.start if len(indices) else 0
    with torch.no_grad():
        out, prefix = _fold(
            states, matrices, incoming, start, indices.step, len(indices), forward,
            prefix_count, kernel,
        )  # fmt: skip
    if prefix_count is None:
        return out
    assert prefix is not None
    return prefix.contiguous(), out
