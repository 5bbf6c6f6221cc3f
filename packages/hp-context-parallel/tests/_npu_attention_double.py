"""A test double of ``torch_npu.npu_fusion_attention``, for driving the npu attention branch
on CPU.

It computes the attention itself from its arguments with plain torch math (explicit scores,
mask, softmax; autograd gives the backward), following the op's documented contract for what
the package uses, and rejects what the package must not pass:

- ``input_layout`` ``"BSND"`` (``[B, S, N, D]``) or ``"TND"`` (``[T, N, D]``, the tokens of
  all sequences back to back) with ``head_num == N``; q, k, v of one head dim and dtype.
- ``"TND"`` needs ``actual_seq_qlen`` / ``actual_seq_kvlen``: host-side int lists (tuple or
  list of Python ints) of **cumulative end** offsets, strictly increasing, the last equal to
  T (lengths 2, 2, 2 are passed as 2, 4, 6); each sequence attends only to itself.
- ``sparse_mode=3`` (rightDownCausal): query i of a sequence sees key j iff
  ``j <= i + Skv - Sq``; it takes the optimised ``atten_mask``, the ``2048 × 2048`` bool
  matrix that is True above the diagonal. ``sparse_mode=0`` without a mask: full attention.
- ``keep_prob`` must be 1 (no dropout here). Returns the op's 7-tuple, the output first (in
  the input's layout, ``[..., dv]``).

Unlike the device op it also takes float64 (so a test can compare at 1e-10). Every call is
recorded in ``calls``.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

MASK_SIDE = 2048


@dataclass
class Call:
    layout: str
    head_num: int
    shapes: tuple[tuple[int, ...], ...]
    scale: float
    sparse_mode: int
    actual_seq_qlen: list[int] | None
    actual_seq_kvlen: list[int] | None


@dataclass
class NpuFusionAttentionDouble:
    calls: list[Call] = field(default_factory=list)

    def module(self) -> types.ModuleType:
        """A ``torch_npu`` module object holding this double's op."""
        mod = types.ModuleType("torch_npu")
        mod.npu_fusion_attention = self.npu_fusion_attention  # type: ignore[attr-defined]
        return mod

    def install(self) -> None:
        """Put :meth:`module` in ``sys.modules`` (inside a spawned test rank)."""
        sys.modules["torch_npu"] = self.module()

    def npu_fusion_attention(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        head_num: int,
        input_layout: str,
        *,
        pse: Tensor | None = None,
        padding_mask: Tensor | None = None,
        atten_mask: Tensor | None = None,
        scale: float = 1.0,
        keep_prob: float = 1.0,
        pre_tockens: int = 2147483647,
        next_tockens: int = 2147483647,
        inner_precise: int = 0,
        prefix: list[int] | None = None,
        actual_seq_qlen: Any = None,
        actual_seq_kvlen: Any = None,
        sparse_mode: int = 0,
        gen_mask_parallel: bool = True,
        sync: bool = False,
    ) -> tuple[Any, ...]:
        def fail(msg: str) -> RuntimeError:
            return RuntimeError(f"npu_fusion_attention: {msg}")

        self.calls.append(
            Call(
                input_layout,
                head_num,
                tuple(tuple(t.shape) for t in (query, key, value)),
                scale,
                sparse_mode,
                None if actual_seq_qlen is None else list(actual_seq_qlen),
                None if actual_seq_kvlen is None else list(actual_seq_kvlen),
            )
        )
        if pse is not None or padding_mask is not None or prefix is not None:
            raise fail("pse, padding_mask and prefix are not modelled by the double")
        if keep_prob != 1.0:
            raise fail(f"keep_prob={keep_prob}: dropout is not modelled by the double")
        if not (query.dtype == key.dtype == value.dtype):
            raise fail(f"q, k, v dtypes differ: {query.dtype}, {key.dtype}, {value.dtype}")
        dims = {"BSND": 4, "TND": 3}
        if input_layout not in dims:
            raise fail(f"input_layout {input_layout!r} is not modelled (BSND, TND)")
        if any(t.dim() != dims[input_layout] for t in (query, key, value)):
            raise fail(f"{input_layout} needs {dims[input_layout]}-D q, k, v")
        if not (query.shape[-1] == key.shape[-1] == value.shape[-1]):
            raise fail("q, k and v must share the head dim D")
        if not (query.shape[-2] == key.shape[-2] == value.shape[-2] == head_num):
            raise fail(f"head_num={head_num} but q, k, v have N = {query.shape[-2]}")
        if sparse_mode == 3:
            want = torch.ones(MASK_SIDE, MASK_SIDE, dtype=torch.bool).triu(1)
            if (
                not isinstance(atten_mask, Tensor)
                or atten_mask.dtype != torch.bool
                or not torch.equal(atten_mask.cpu(), want)
            ):
                raise fail("sparse_mode=3 takes the 2048x2048 compressed causal atten_mask")
        elif sparse_mode != 0 or atten_mask is not None:
            raise fail(f"sparse_mode={sparse_mode} with a mask is not modelled (0 unmasked, 3)")

        if input_layout == "BSND":
            if actual_seq_qlen is not None or actual_seq_kvlen is not None:
                raise fail("actual_seq_qlen/kvlen are for the TND layout")
            rows = [(query[b], key[b], value[b]) for b in range(query.shape[0])]
            outs = [self._attend(*row, scale, sparse_mode) for row in rows]
            out = torch.stack(outs)
        else:
            q_ends = _ends(actual_seq_qlen, query.shape[0], "actual_seq_qlen", fail)
            kv_ends = _ends(actual_seq_kvlen, key.shape[0], "actual_seq_kvlen", fail)
            if len(q_ends) != len(kv_ends):
                raise fail("actual_seq_qlen and actual_seq_kvlen list different batch sizes")
            outs = []
            for qa, qb, ka, kb in zip([0, *q_ends], q_ends, [0, *kv_ends], kv_ends):
                outs.append(
                    self._attend(query[qa:qb], key[ka:kb], value[ka:kb], scale, sparse_mode)
                )
            out = torch.cat(outs)
        empty = query.new_empty(0)
        return out, empty, empty, empty, 0, 0, 0

    @staticmethod
    def _attend(q: Tensor, k: Tensor, v: Tensor, scale: float, sparse_mode: int) -> Tensor:
        """One sequence, ``[S, N, D]``: softmax(scale · q kᵀ, masked) v per head."""
        sq, skv = q.shape[0], k.shape[0]
        scores = torch.einsum("snd,tnd->nst", q, k) * scale
        if sparse_mode == 3:
            i = torch.arange(sq)[:, None]
            j = torch.arange(skv)[None, :]
            scores = scores.masked_fill(j > i + (skv - sq), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.einsum("nst,tnd->snd", probs, v)


def _ends(values: Any, total: int, name: str, fail: Any) -> list[int]:
    if not isinstance(values, (list, tuple)) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in values
    ):
        raise fail(f"TND needs {name} as a host int list, got {type(values).__name__}")
    ends = list(values)
    if not ends or any(b <= a for a, b in zip([0, *ends], ends)) or ends[-1] != total:
        raise fail(f"{name} must be strictly increasing cumulative ends up to T={total}: {ends}")
    return ends
