"""Admission of one call of a context-parallel MLA forward: checked, and agreed by every rank.

Every check that can reject a call runs before the first collective of the schedule. Each
rank first judges its own call (no communication): ``hidden_states`` is ``[B, S/P, D]``,
``past_key_values`` is None, the attention mask is None or plain causal, the caller's
``(cos, sin)`` cover this rank's S/P tokens, a packed-documents table (``cu_seqlens``, or HF's
``cu_seq_lens_q``/``cu_seq_lens_k``) if any is 1-D integer ``[0, …, S]`` strictly increasing
with ``B == 1``, no attention dropout in training, and no collective leaked by an earlier call
of a block. Then the ranks agree: one small all-reduce (sum) of a ``[P, 4]`` int64 table —
row r holds rank r's verdict code, its ``(B, S/P)`` and a fingerprint of its documents table
— so that every rank raises when any rank rejects its call (a padding mask present on one
rank's block only, a past_key_values on one rank), when the ranks' blocks differ in shape or
their tables differ, instead of some ranks entering the all-to-alls alone. This
all-reduce is the only communication before the schedule; it runs on every call (P > 1) and is
not counted by the event recorder.

"Plain causal" masks (HF builds one per call, depending on the attention implementation):
None (HF's sdpa / flash paths for a causal block), or a 4-D ``[1 or B, 1 or H, S/P, L]``
tensor whose allowed entries are exactly the causal pattern with ``L = S/P`` (the mask HF's
eager path builds for the local block: query i sees keys j <= i, its global meaning is
plain causal) or ``L = S`` (this rank's rows of the global causal mask: query ``r·S/P + i``
sees keys ``j <= r·S/P + i``). Boolean masks: True = attend. Float (additive) masks: 0 where
allowed, at most half the dtype's lowest value (HF writes exactly the lowest) or -inf elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from hyper_parallel.context_parallel.families import MLACall, MLAFamily
from hyper_parallel.context_parallel.mla import MLAConfig
from hyper_parallel.context_parallel.transport import BLOCK_OWNER, leak_message, leaked_by
from hyper_parallel.dtensor import check_consistent
from hyper_parallel.dtensor.consistency import consistency_enabled

__all__ = ["admit", "check_call_consistent", "mask_problem"]

# verdict codes, in priority order (the lowest non-zero code on any rank names the error)
OK, LEAK, HIDDEN, CACHE, MASK, ROPE, PACKED, DROPOUT, TABLES = range(9)
_ERRORS: dict[int, tuple[type[Exception], str]] = {
    LEAK: (RuntimeError, "collectives launched by an earlier call were never waited"),
    HIDDEN: (ValueError, "hidden_states is not this rank's [B, S/P, hidden_size] block"),
    CACHE: (ValueError, "past_key_values is set"),
    MASK: (ValueError, "attention_mask is neither None nor plain causal"),
    ROPE: (ValueError, "position_embeddings do not cover this rank's tokens"),
    PACKED: (ValueError, "its cu_seqlens table is malformed"),
    DROPOUT: (ValueError, "attention dropout is active"),
    TABLES: (ValueError, "the ranks' cu_seqlens tables differ"),
}
_TABLE_KEYS = ("cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k")  # ours, then HF's flash names


@dataclass(frozen=True)
class Admission:
    """What the schedule needs from an admitted call: B, S/P and the packed documents' global
    offsets ``[0, …, S]`` (int64, on the block's device) or None."""

    batch: int
    s_local: int
    documents: Tensor | None = None


def admit(
    module: Any,
    family: MLAFamily,
    dims: MLAConfig,
    call: MLACall,
    pg: Any,
    size: int,
    rank: int,
    device_type: str,
) -> Admission:
    """Judge ``call`` on this rank, agree with the other ranks, raise on every rank if any
    rank rejects (same exception type; the rejecting rank's own message, or one naming the
    rejecting ranks on the others)."""
    code, message = _judge(module, family, dims, call, size, rank)
    x = call.hidden_states
    b, s = _shape_or_zero(x)
    documents = _table(call) if code == OK else None
    mark = _fingerprint(documents)
    table: list[tuple[int, ...]]
    if size == 1:
        table = [(code, b, s, mark)]
    else:
        device = x.device if isinstance(x, Tensor) else torch.device(device_type)
        t = torch.zeros(size, 4, dtype=torch.int64, device=device)
        t[rank] = torch.tensor([code, b, s, mark], dtype=torch.int64)
        dist.all_reduce(t, group=pg)
        table = [tuple(int(v) for v in row) for row in t.tolist()]
    codes = [row[0] for row in table]
    if code != OK:
        raise _ERRORS[code][0](message)
    if any(codes):
        first = min(c for c in codes if c)
        ranks = [r for r, c in enumerate(codes) if c]
        exc, what = _ERRORS[first]
        raise exc(
            f"context-parallel MLA forward: rank(s) {ranks} rejected their call ({what}); "
            "no rank communicated"
        )
    shapes = [row[1:3] for row in table]
    if len(set(shapes)) != 1:
        raise ValueError(
            "context-parallel MLA forward: the ranks' hidden_states blocks differ in (B, S/P): "
            f"{shapes}; every rank must hold an equal contiguous block of the same batch"
        )
    if len({row[3] for row in table}) != 1:
        raise ValueError(
            "context-parallel MLA forward: the ranks' cu_seqlens tables differ (or only some "
            "ranks passed one); every rank must pass the same global table; no rank "
            "communicated"
        )
    if documents is not None:
        documents = documents.to(device=x.device, dtype=torch.int64)
    return Admission(b, s, documents)


def _table(call: MLACall) -> Tensor | None:
    """The packed documents' table of a judged call (its first table argument), or None."""
    for key in _TABLE_KEYS:
        value = call.kwargs.get(key)
        if value is not None:
            return value
    return None


def _fingerprint(documents: Tensor | None) -> int:
    """A number that differs, in practice, between different tables (0: no table)."""
    if documents is None:
        return 0
    values = [int(v) for v in documents.tolist()]
    h = len(values)
    for v in values:
        h = (h * 1000003 + v + 1) % (1 << 61)
    return h + 1


def table_problem(tables: dict[str, Any], b: int, s_full: int) -> str | None:
    """None if the given tables (``cu_seqlens`` and/or HF's ``cu_seq_lens_q``/``_k``) are one
    valid packed-documents table for a ``[b, s_full]`` sequence, else the reason."""
    first: list[int] | None = None
    for key, cu in tables.items():
        if not isinstance(cu, Tensor) or cu.dim() != 1 or cu.numel() < 2:
            got = tuple(cu.shape) if isinstance(cu, Tensor) else type(cu).__name__
            return f"{key} must be a 1-D tensor [0, …, S] with at least 2 entries, got {got}"
        if cu.dtype.is_floating_point or cu.dtype.is_complex or cu.dtype == torch.bool:
            return f"{key} must be an integer tensor, got {cu.dtype}"
        values = [int(v) for v in cu.tolist()]
        if values[0] != 0:
            return f"{key} must start at 0, got {values[0]}"
        if values[-1] != s_full:
            return f"{key} must end at the sequence length S={s_full}, got {values[-1]}"
        if any(q <= p for p, q in zip(values, values[1:])):
            return f"{key} must be strictly increasing (every document non-empty), got {values}"
        if first is not None and values != first:
            return f"{' and '.join(tables)} give different tables"
        first = values
    if b != 1:
        names = ", ".join(tables)
        return f"packed documents ({names}) need batch size 1 (one packed row), got B={b}"
    return None


def check_call_consistent(
    module: Any, family: MLAFamily, dims: MLAConfig, call: MLACall, pg: Any, options: dict
) -> None:
    """Consistency mode only (``HP_CHECK_CONSISTENCY=1`` or ``consistency_checks()``; off: no
    work, no communication): before :func:`admit` and the schedule, every rank of ``pg``
    compares ``options`` (the rewrite's ``strategy`` and ``overlap``) and what the rewritten
    forward decides from its call: the family, the MLA sizes, ``hidden_states``,
    ``attention_mask`` and ``position_embeddings`` (shape, dtype, device type; never values),
    the RoPE layout, ``past_key_values``' type, the names of the other arguments given,
    training mode and dropout, and whether autograd records (the backward collectives). Every
    rank raises ``InconsistentRanksError`` naming the first differing field and the ranks."""
    if not consistency_enabled():
        return
    config = getattr(module, "config", None)
    check_consistent(
        pg,
        f"context-parallel {family.class_name} forward",
        **options,
        family=family.class_name,
        dims=dims,
        hidden_states=call.hidden_states,
        attention_mask=call.attention_mask,
        position_embeddings=call.position_embeddings,
        rope_interleave=bool(getattr(config, "rope_interleave", False)),
        past_key_values=type(call.past_key_values).__name__,
        kwargs=sorted(k for k, v in call.kwargs.items() if v is not None),
        cu_seqlens=[
            tuple(int(v) for v in t.tolist()) if isinstance(t, Tensor) else type(t).__name__
            for t in (call.kwargs.get(key) for key in _TABLE_KEYS)
            if t is not None
        ],
        training=bool(getattr(module, "training", False)),
        dropout=family.dropout(module),
        grad_enabled=torch.is_grad_enabled(),
    )


def _shape_or_zero(x: Any) -> tuple[int, int]:
    if isinstance(x, Tensor) and x.dim() == 3:
        return int(x.shape[0]), int(x.shape[1])
    return 0, 0


def _judge(
    module: Any, family: MLAFamily, c: MLAConfig, call: MLACall, size: int, rank: int
) -> tuple[int, str]:
    leaked = leaked_by(BLOCK_OWNER)
    if leaked:
        return LEAK, leak_message("context-parallel MLA forward", leaked)
    x = call.hidden_states
    if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != c.hidden_size:
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        return HIDDEN, (
            f"hidden_states must be this rank's sequence block [B, S/P, {c.hidden_size}], got {got}"
        )
    if call.past_key_values is not None:
        return CACHE, (
            "past_key_values must be None: context-parallel attention keeps no KV cache. "
            "Hugging Face models create a DynamicCache whenever use_cache is on (the config "
            "default, also in training): call the model with use_cache=False"
        )
    problem = mask_problem(call.attention_mask, x.shape[0], x.shape[1], c.num_heads, size, rank)
    if problem is not None:
        return MASK, problem
    if family.rope_source == "caller":
        problem = _rope_problem(call.position_embeddings, x, c)
        if problem is not None:
            return ROPE, problem
    tables = {k: call.kwargs[k] for k in _TABLE_KEYS if call.kwargs.get(k) is not None}
    if tables:
        problem = table_problem(tables, x.shape[0], x.shape[1] * size)
        if problem is not None:
            return PACKED, problem
    p = family.dropout(module)
    if p > 0:
        return DROPOUT, (
            f"attention dropout {p} is not supported in training; set "
            "config.attention_dropout = 0.0 or call module.eval()"
        )
    return OK, ""


def _rope_problem(pe: Any, x: Tensor, c: MLAConfig) -> str | None:
    b, s, dr = x.shape[0], x.shape[1], c.qk_rope_head_dim
    ok = (
        isinstance(pe, (tuple, list))
        and len(pe) == 2
        and all(isinstance(t, Tensor) for t in pe)
        and pe[0].shape == pe[1].shape
        and pe[0].dim() in (2, 3)
        and tuple(pe[0].shape[-2:]) == (s, dr)
        and (pe[0].dim() == 2 or pe[0].shape[0] in (1, b))
    )
    if ok:
        return None
    got = (
        [tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__ for t in pe]
        if isinstance(pe, (tuple, list))
        else type(pe).__name__
    )
    return (
        f"position_embeddings must be (cos, sin) of this rank's {s} tokens, each "
        f"[1 or {b}, {s}, {dr}] (computed from the global position_ids), got {got}"
    )


def mask_problem(mask: Any, b: int, s_local: int, heads: int, size: int, rank: int) -> str | None:
    """None if ``mask`` is None or plain causal for this rank's block (see the module
    docstring), else the reason."""
    if mask is None:
        return None
    prefix = "attention_mask must be None or plain causal (padding, packing and custom masks "
    prefix += "are not supported): "
    if not isinstance(mask, Tensor) or mask.dim() != 4:
        shape = tuple(mask.shape) if hasattr(mask, "shape") else None
        return prefix + f"expected a 4-D tensor, got {type(mask).__name__} {shape}"
    s_full = s_local * size
    mb, mh, lq, lk = mask.shape
    if mb not in (1, b) or mh not in (1, heads) or lq != s_local or lk not in (s_local, s_full):
        return prefix + (
            f"shape {tuple(mask.shape)} is not [1 or {b}, 1 or {heads}, {s_local}, "
            f"{s_local} or {s_full}]"
        )
    q0 = rank * s_local if lk == s_full else 0
    q = torch.arange(q0, q0 + s_local, device=mask.device)
    allowed = torch.arange(lk, device=mask.device)[None, :] <= q[:, None]
    if mask.dtype == torch.bool:
        ok = bool(torch.equal(mask, allowed.expand_as(mask)))
    elif mask.is_floating_point():
        low = torch.finfo(mask.dtype).min / 2
        ok = bool(torch.where(allowed, mask == 0, mask <= low).all())
    else:
        return prefix + f"dtype {mask.dtype} (expected bool or floating point)"
    return None if ok else prefix + "its entries are not the causal pattern"
