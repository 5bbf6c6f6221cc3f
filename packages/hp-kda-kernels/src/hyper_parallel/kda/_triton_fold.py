"""Triton kernel for the affine fold behind ``affine_merge`` and ``affine_scan``.

Imported lazily (only when the Triton backend is chosen), so the package imports without
Triton. One program per (value tile of ``BV`` columns, batch·head); the accumulator is fp32;
``start``, ``step``, ``count`` and ``prefix_count`` are runtime values, never specialised, so one
compiled kernel serves every rank and direction. The backward (transposed) fold swaps ``M``'s
row and column strides instead of materialising ``Mᵀ``.

On-chip footprint (Ascend: 192 KB unified buffer, loads double-buffered), fp32, BV = 64:
K ≤ 64: M 16 KB, acc/result 2·16 KB, S tile 16 KB → ≤ 64 KB single, ≤ 96 KB double-buffered.
K = 128 is split into two 64-row halves so no operand exceeds a 64×64 block: M blocks 16 KB
(×2 buffered), acc halves 32 KB, new halves 32 KB, S halves 2·16 KB (×2) → 160 KB < 192 KB.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GRID_LIMIT = 65535
"""Ascend's cap on the product of the grid dimensions."""


@triton.jit(do_not_specialize=["start", "step", "count", "prefix_count", "H", "bh_offset"])
def _affine_fold_kernel(
    S, M, X, OUT, PRE,
    start, step, count, prefix_count, H, bh_offset,
    s_p, s_b, s_h, s_k,
    m_p, m_b, m_h, m_r, m_c,
    x_b, x_h, x_k,
    o_b, o_h, o_k,
    K: tl.constexpr, BV: tl.constexpr, KB: tl.constexpr,
    HAS_X: tl.constexpr, HAS_PRE: tl.constexpr,
):  # fmt: skip
    pid_v = tl.program_id(0)
    pid_bh = tl.program_id(1) + bh_offset
    b = pid_bh // H
    h = pid_bh % H
    rb = tl.arange(0, KB)
    rv = pid_v * BV + tl.arange(0, BV)
    s_base = S + b * s_b + h * s_h
    m_base = M + b * m_b + h * m_h
    tile = rb[:, None] * o_k + rv[None, :]
    o_base = OUT + b * o_b + h * o_h
    p_base = PRE + b * o_b + h * o_h
    if KB == K:
        if HAS_X:
            acc = tl.load(X + b * x_b + h * x_h + rb[:, None] * x_k + rv[None, :]).to(tl.float32)
        else:
            acc = tl.zeros([KB, BV], dtype=tl.float32)
        if HAS_PRE:
            if prefix_count == 0:
                tl.store(p_base + tile, acc)
        for i in range(0, count):
            j = start + i * step
            m = tl.load(m_base + j * m_p + rb[:, None] * m_r + rb[None, :] * m_c)
            s = tl.load(s_base + j * s_p + rb[:, None] * s_k + rv[None, :])
            acc = tl.dot(m, acc, input_precision="ieee") + s
            if HAS_PRE:
                if i + 1 == prefix_count:
                    tl.store(p_base + tile, acc)
        tl.store(o_base + tile, acc)
    else:
        # K = 2·KB: the state as two row halves, M as four KB×KB blocks.
        if HAS_X:
            x_ptr = X + b * x_b + h * x_h + rb[:, None] * x_k + rv[None, :]
            lo = tl.load(x_ptr).to(tl.float32)
            hi = tl.load(x_ptr + KB * x_k).to(tl.float32)
        else:
            lo = tl.zeros([KB, BV], dtype=tl.float32)
            hi = tl.zeros([KB, BV], dtype=tl.float32)
        if HAS_PRE:
            if prefix_count == 0:
                tl.store(p_base + tile, lo)
                tl.store(p_base + KB * o_k + tile, hi)
        for i in range(0, count):
            j = start + i * step
            mj = m_base + j * m_p + rb[:, None] * m_r + rb[None, :] * m_c
            sj = s_base + j * s_p + rb[:, None] * s_k + rv[None, :]
            new_lo = tl.dot(tl.load(mj), lo, input_precision="ieee")
            new_lo = tl.dot(tl.load(mj + KB * m_c), hi, new_lo, input_precision="ieee")
            new_hi = tl.dot(tl.load(mj + KB * m_r), lo, input_precision="ieee")
            new_hi = tl.dot(tl.load(mj + KB * m_r + KB * m_c), hi, new_hi, input_precision="ieee")
            lo = new_lo + tl.load(sj)
            hi = new_hi + tl.load(sj + KB * s_k)
            if HAS_PRE:
                if i + 1 == prefix_count:
                    tl.store(p_base + tile, lo)
                    tl.store(p_base + KB * o_k + tile, hi)
        tl.store(o_base + tile, lo)
        tl.store(o_base + KB * o_k + tile, hi)


def affine_fold(
    states: torch.Tensor,
    matrices: torch.Tensor,
    incoming: torch.Tensor | None,
    start: int,
    step: int,
    count: int,
    forward: bool,
    prefix_count: int | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the fold; inputs are validated by the caller (fp32, unit column stride)."""
    _, B, H, K, V = states.shape
    out = states.new_empty(B, H, K, V)
    pre = states.new_empty(B, H, K, V) if prefix_count is not None else out
    x = incoming if incoming is not None else out
    BV = min(64, V)
    KB = min(64, K)
    m_r, m_c = matrices.stride(3), matrices.stride(4)
    if not forward:
        m_r, m_c = m_c, m_r
    n_v = V // BV
    per_launch = max(1, GRID_LIMIT // n_v)
    for offset in range(0, B * H, per_launch):
        n_bh = min(per_launch, B * H - offset)
        _affine_fold_kernel[(n_v, n_bh)](
            states, matrices, x, out, pre,
            start, step, count, -1 if prefix_count is None else prefix_count, H, offset,
            states.stride(0), states.stride(1), states.stride(2), states.stride(3),
            matrices.stride(0), matrices.stride(1), matrices.stride(2), m_r, m_c,
            x.stride(0), x.stride(1), x.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            K=K, BV=BV, KB=KB, HAS_X=incoming is not None, HAS_PRE=prefix_count is not None,
        )  # fmt: skip
    return out, (pre if prefix_count is not None else None)
