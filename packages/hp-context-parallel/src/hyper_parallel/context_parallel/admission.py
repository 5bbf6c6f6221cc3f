"""Admission of one call of a context-parallel attention forward (MLA, or grouped-query
attention): checked before the schedule.

Every check that can reject a call runs before the first collective of the schedule, on each
rank, on its own call, without communicating (consistency mode off, the default): ``hidden_states``
is ``[B, S/P, D]``, ``past_key_values`` is None, the attention mask is None or plain causal,
the caller's ``(cos, sin)`` cover this rank's S/P tokens, a packed-documents table
(``cu_seqlens``, or HF's ``cu_seq_lens_q``/``cu_seq_lens_k``) if any is 1-D integer
``[0, …, S]`` strictly increasing with ``B == 1``, no attention dropout in training, and no
collective leaked by an earlier call of a block. These checks read shapes, Python values, the
mask and the tables, which are the same on every rank when the inputs are symmetric, so every
rank raises the same error, and a call that passes issues only the schedule's own
collectives: no agreement collective on the hot path (nor in an activation-checkpointing
recompute).

Cross-rank agreement is consistency mode's job (``HP_CHECK_CONSISTENCY=1`` or
``consistency_checks()``): :func:`check_call_consistent` compares, with hp-dtensor's
``check_consistent`` (two small all-gathers, the only communication before the schedule), the
call's signature — shapes, dtypes, options, the tables' values — and each rank's verdict
(``"ok"`` or its error), so that asymmetric inputs (a mask on one rank only, a padding mask
on the one block that has padding, tables or blocks that differ, a collective leaked on one
rank) make every rank raise the same ``InconsistentRanksError`` instead of some ranks
entering the all-to-alls alone. With consistency mode off such inputs are not detected: ranks
whose blocks differ in shape, or of which only some reject, hang or fail in the first
collective. Ranks whose tables differ (the exchanges do not depend on the table) are caught
with consistency mode off too: the call's sequence context (hp-dtensor's
:class:`~hyper_parallel.dtensor.SequenceContext`, built here from the table, or the caller's)
carries the table's fingerprint, which the schedule folds into its first exchange if the ranks
have not compared it yet (``pipeline.run_pipeline``), and every rank raises the same
``SequenceMismatchError`` before the forward returns.

Host syncs before the schedule (consistency mode off), all local, none added by admission:

- a 4-D ``attention_mask`` tensor (HF's eager path; sdpa and flash pass None): its entries are
  compared with the causal pattern on its device and the result read (one device-to-host sync
  per call when the mask is on an accelerator; none for None or a CPU mask);
- a packed-documents table given as ``cu_seqlens`` (or HF's names): validated by hp-dtensor's
  ``check_documents``, its values read to the host once (``tolist()``) while building the
  call's sequence context; a CPU table costs no device sync; a table on an accelerator costs
  one (unavoidable when validating locally, and the NPU fused attention's ``TND`` form takes
  the offsets as host ints anyway: the context hands it this host copy, so the attention reads
  nothing back). A CPU table is then copied to the accelerator without blocking on CUDA (a
  fresh pageable tensor, staged at once); elsewhere the copy is blocking;
- a ``sequence_context`` (the caller's, e.g. hp-models' one per forward): nothing is read; it
  must describe this rank's block of this group (equal blocks) and come without a table.

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
from torch import Tensor

from hyper_parallel.context_parallel.families import AttentionFamily, MLACall
from hyper_parallel.context_parallel.transport import BLOCK_OWNER, Group, leak_message, leaked_by
from hyper_parallel.dtensor import (
    SequenceContext,
    check_consistent,
    check_documents,
    sequence_context,
)
from hyper_parallel.dtensor.consistency import consistency_enabled

__all__ = ["Admission", "admit", "check_call_consistent", "mask_problem", "table_problem"]

_TABLE_KEYS = ("cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k")  # ours, then HF's flash names
_CONTEXT_KEY = "sequence_context"  # hp-dtensor's SequenceContext, e.g. hp-models' per forward


def _context_fields(ctx: Any) -> Any:
    """A sequence context as compared across ranks (its table, whether unchecked, the block
    lengths), None for none."""
    if ctx is None:
        return None
    try:
        return (ctx.offsets, ctx.needs_check, ctx.lengths)
    except AttributeError:
        return type(ctx).__name__


@dataclass(frozen=True)
class Admission:
    """What the schedule needs from an admitted call: B, S/P and its sequence context (the
    packed documents' global offsets ``[0, …, S]`` on the block's device and as host ints,
    their fingerprint), or None for a call without documents or context."""

    batch: int
    s_local: int
    context: SequenceContext | None = None

    @property
    def documents(self) -> Tensor | None:
        """The documents' offsets, int64 on the block's device (None: one document)."""
        return None if self.context is None else self.context.documents

    @property
    def offsets(self) -> tuple[int, ...] | None:
        """The same values as host ints (None: one document)."""
        return None if self.context is None else self.context.offsets


def admit(
    module: Any,
    family: AttentionFamily,
    dims: Any,
    call: MLACall,
    group: Group,
    options: dict[str, Any],
) -> Admission:
    """Judge ``call`` on this rank and raise if it is rejected (``ValueError``; a leaked
    collective of an earlier call: ``RuntimeError``), with no communication. In consistency
    mode the ranks first compare their calls and verdicts (:func:`check_call_consistent`):
    ranks that disagree raise ``InconsistentRanksError`` on every rank, naming the field."""
    error, context = _judge(module, family, dims, call, group)
    verdict = "ok" if error is None else f"{type(error).__name__}: {error}"
    check_call_consistent(module, family, dims, call, group.pg, options, verdict)
    if error is not None:
        raise error
    x: Tensor = call.hidden_states
    return Admission(int(x.shape[0]), int(x.shape[1]), context)


def table_problem(tables: dict[str, Any], b: int, s_full: int) -> tuple[str | None, list[int]]:
    """``(None, offsets)`` if the given tables (``cu_seqlens`` and/or HF's
    ``cu_seq_lens_q``/``_k``) are one valid packed-documents table for a ``[b, s_full]``
    sequence (hp-dtensor's ``check_documents``; ``offsets``: its values, read to the host once
    per table), else ``(reason, [])``."""
    first: tuple[int, ...] | None = None
    for key, cu in tables.items():
        try:
            values = check_documents(cu, total=s_full, batch=b, what=key, length_name="S")
        except ValueError as exc:
            return str(exc), []
        if first is not None and values != first:
            return f"{' and '.join(tables)} give different tables", []
        first = values
    return None, list(first or ())


def check_call_consistent(
    module: Any,
    family: AttentionFamily,
    dims: Any,
    call: MLACall,
    pg: Any,
    options: dict[str, Any],
    verdict: str = "ok",
) -> None:
    """Consistency mode only (``HP_CHECK_CONSISTENCY=1`` or ``consistency_checks()``; off: no
    work, no communication): before the schedule, every rank of ``pg`` compares ``options``
    (the rewrite's ``strategy``, ``overlap`` and CP size), what the rewritten forward decides
    from its call — the family, the MLA sizes, ``hidden_states``, ``attention_mask`` and
    ``position_embeddings`` (shape, dtype, device type; never values), the RoPE layout,
    ``past_key_values``' type, the names of the other arguments given, the packed-documents
    tables' values, training mode and dropout, whether autograd records (the backward
    collectives) — and ``verdict``, this rank's judgement of its call (``"ok"`` or
    ``"<ExceptionType>: <message>"``, from :func:`admit`): a rank that rejects what the others
    accept (a padding mask on its block only, a leaked collective) is a disagreement too.
    Every rank raises ``InconsistentRanksError`` naming the first differing field (in name
    order) and which ranks hold which value."""
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
            tuple(int(v) for v in t.reshape(-1).tolist())
            if isinstance(t, Tensor)
            else type(t).__name__
            for t in (call.kwargs.get(key) for key in _TABLE_KEYS)
            if t is not None
        ],
        sequence_context=_context_fields(call.kwargs.get(_CONTEXT_KEY)),
        training=bool(getattr(module, "training", False)),
        dropout=family.dropout(module),
        grad_enabled=torch.is_grad_enabled(),
        verdict=verdict,
    )


def _judge(
    module: Any, family: AttentionFamily, c: Any, call: MLACall, group: Group
) -> tuple[Exception | None, SequenceContext | None]:
    """This rank's verdict on its own call, without communicating: ``(None, context)`` if
    admitted (``context``: the caller's sequence context, one built from its table, or None),
    else ``(error, None)`` with the error to raise."""
    size, rank = group.size, group.rank
    leaked = leaked_by(BLOCK_OWNER)
    if leaked:
        return RuntimeError(leak_message(f"context-parallel {family.what} forward", leaked)), None
    x = call.hidden_states
    if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != c.hidden_size:
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        return ValueError(
            f"hidden_states must be this rank's sequence block [B, S/P, {c.hidden_size}], got {got}"
        ), None
    if call.past_key_values is not None:
        return ValueError(
            "past_key_values must be None: context-parallel attention keeps no KV cache. "
            "Hugging Face models create a DynamicCache whenever use_cache is on (the config "
            "default, also in training): call the model with use_cache=False"
        ), None
    problem = mask_problem(call.attention_mask, x.shape[0], x.shape[1], c.num_heads, size, rank)
    if problem is not None:
        return ValueError(problem), None
    if family.rope_source == "caller":
        problem = _rope_problem(call.position_embeddings, x, family.rope_width(c))
        if problem is not None:
            return ValueError(problem), None
    try:
        context = _context(call, group, x, family.what)
    except ValueError as exc:
        return exc, None
    p = family.dropout(module)
    if p > 0:
        return ValueError(
            f"attention dropout {p} is not supported in training; set "
            "config.attention_dropout = 0.0 or call module.eval()"
        ), None
    return None, context


def _context(call: MLACall, group: Group, x: Tensor, what: str) -> SequenceContext | None:
    """The call's sequence context: the caller's (checked against the block: equal blocks of
    this group, no table besides), or one built from its table(s) (validated; several must be
    equal), or None. ``ValueError`` for a bad table or context."""
    b, s = int(x.shape[0]), int(x.shape[1])
    tables = {k: call.kwargs[k] for k in _TABLE_KEYS if call.kwargs.get(k) is not None}
    given = call.kwargs.get(_CONTEXT_KEY)
    if given is not None:
        if not isinstance(given, SequenceContext):
            raise ValueError(
                f"{_CONTEXT_KEY} must be a hyper_parallel.dtensor.SequenceContext, got "
                f"{type(given).__name__}"
            )
        if tables:
            raise ValueError(
                f"give the documents either as {' / '.join(tables)} or in {_CONTEXT_KEY}, not both"
            )
        given.check_block(group.size, group.rank, s, f"context-parallel {what} forward")
        if any(n != s for n in given.lengths):
            raise ValueError(
                f"context-parallel {what} needs equal blocks of S/P tokens, but the sequence "
                f"context's blocks are {list(given.lengths)}"
            )
        if given.packed and b != 1:
            raise ValueError(
                f"packed documents ({_CONTEXT_KEY}) need batch size 1 (one packed row), got B={b}"
            )
        return given
    context = None
    for key, cu in tables.items():
        mine = sequence_context(
            group, s, cu_seqlens=cu, batch=b, device=x.device, what=key, length_name="S"
        )
        if context is not None and mine.offsets != context.offsets:
            raise ValueError(f"{' and '.join(tables)} give different tables")
        context = context or mine
    return context


def _rope_problem(pe: Any, x: Tensor, dr: int) -> str | None:
    b, s = x.shape[0], x.shape[1]
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
