"""``parallelize_attention``: Ulysses context parallelism for grouped-query attention.

The stock Hugging Face ``Qwen3NextAttention`` (gated: ``q_proj`` gives the query and an
output gate, ``o_proj`` takes ``o · sigmoid(gate)``; q/k RMSNorms per head; partial rotary),
``Qwen3Attention`` and ``LlamaAttention`` (``num_key_value_heads <= num_attention_heads``),
recognised by class name (:mod:`~hyper_parallel.context_parallel.gqa`). Rank r of the P-rank
CP mesh holds tokens ``[r·S/P, (r+1)·S/P)``; the rewritten forward takes ``[B, S/P, D]`` and
returns ``(the same rows of the serial output, None)``.

The schedule is MLA's pipeline (``pipeline.run_pipeline``, G ≥ 1 head groups, overlap on or
off) with grouped-query attention's K/V side (``gqa.GroupedKV``: one all-to-all of
``[k | v]`` carrying each rank the key/value heads its query heads use, each sent once);
admission (``admission.admit``) and the rewrite (hp-dtensor's ``install_forward``) are the
same as ``parallelize_mla``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from torch import Tensor, nn

from hyper_parallel.context_parallel.admission import admit
from hyper_parallel.context_parallel.families import MLACall
from hyper_parallel.context_parallel.gqa import (
    GQAConfig,
    GQAFamily,
    GroupedKV,
    find_attention_family,
)
from hyper_parallel.context_parallel.head_groups import (
    HeadGroups,
    check_head_groups,
    choose_head_groups,
)
from hyper_parallel.context_parallel.parallel_mla import ATTENTION_LAYER as LAYER
from hyper_parallel.context_parallel.pipeline import Pipeline, run_pipeline
from hyper_parallel.context_parallel.transport import Group, resolve_group
from hyper_parallel.dtensor import DeviceMesh
from hyper_parallel.dtensor.rewrite import (
    install_forward,
    is_parallelized,
    parallel_state,
    uninstall_forward,
)

__all__ = ["attention_head_groups", "parallelize_attention", "unparallelize_attention"]

_M = TypeVar("_M", bound=nn.Module)


@dataclass(frozen=True)
class _State:
    mesh: DeviceMesh
    group: Group
    overlap: bool
    family: GQAFamily
    dims: GQAConfig
    head_groups: int | str = "auto"


def _run(m: Any, call: MLACall) -> Tensor:
    """The rewritten forward: ``call.hidden_states [B, S/P, D] -> [B, S/P, D]``."""
    st: _State = parallel_state(m, LAYER)
    c, fam = st.dims, st.family
    options = {"overlap": st.overlap, "cp_size": st.group.size, "head_groups": st.head_groups}
    adm = admit(m, fam, c, call, st.group, options)  # local; agreement in consistency mode
    x: Tensor = call.hidden_states
    rope = fam.rope(m, call, st.group.rank * adm.s_local, c)
    groups = _head_groups(st, x).count
    check = adm.context if adm.context is not None and adm.context.needs_check else None
    pl = Pipeline(m, c, st.group, groups, st.overlap, check, what=fam.what)
    return run_pipeline(pl, GroupedKV, x, rope, fam.scale(m), adm)


def _head_groups(st: _State, x: Tensor) -> HeadGroups:
    if st.head_groups != "auto":
        return HeadGroups(int(st.head_groups), "set by parallelize_attention(head_groups=...)")
    c, p = st.dims, st.group.size
    return choose_head_groups(
        c.num_heads // p, x.shape[1], x.shape[0], c.head_dim, x.element_size(), p,
        x.device.type, st.overlap,
    )  # fmt: skip


def _check_module(module: Any, c: GQAConfig) -> None:
    """Sizes the schedule relies on: heads, rotary width, projection shapes, no sliding
    window (``ValueError``)."""
    if c.num_kv_heads < 1 or c.num_heads % c.num_kv_heads:
        raise ValueError(
            f"num_attention_heads ({c.num_heads}) must be a multiple of num_key_value_heads "
            f"({c.num_kv_heads})"
        )
    if c.rotary_dim % 2 or not 0 < c.rotary_dim <= c.head_dim:
        raise ValueError(f"rotary width {c.rotary_dim} must be even and in (0, {c.head_dim}]")
    d, hidden = c.head_dim, c.hidden_size
    expected = [
        ("q_proj", (c.num_heads * d * (2 if c.gated else 1), hidden)),
        ("k_proj", (c.num_kv_heads * d, hidden)),
        ("v_proj", (c.num_kv_heads * d, hidden)),
        ("o_proj", (hidden, c.num_heads * d)),
    ]
    for name, shape in expected:
        weight = getattr(getattr(module, name, None), "weight", None)
        if not isinstance(weight, Tensor) or tuple(weight.shape) != shape:
            got = tuple(weight.shape) if isinstance(weight, Tensor) else None
            raise ValueError(f"{name}.weight must have shape {shape} for this attention, got {got}")
    if getattr(module, "sliding_window", None) is not None:
        raise ValueError(
            f"sliding-window attention (sliding_window={module.sliding_window}) is not "
            "supported: context-parallel attention is full causal"
        )


def _validate(module: Any, cp_mesh: Any, overlap: Any, head_groups: Any) -> _State:
    if is_parallelized(module):
        raise RuntimeError(
            "this module is already rewritten (parallelize_attention was already applied); "
            "undo it first"
        )
    family = find_attention_family(module)  # TypeError listing the supported classes
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be a bool, got {overlap!r}")
    if not isinstance(cp_mesh, DeviceMesh):
        raise TypeError(f"cp_mesh must be a 1-D torch DeviceMesh, got {type(cp_mesh).__name__}")
    g = resolve_group(cp_mesh)  # ValueError for n-D meshes or a differing rank order
    dims = family.dims(module)
    _check_module(module, dims)
    if dims.num_heads % g.size:
        raise ValueError(
            f"num_attention_heads ({dims.num_heads}) is not divisible by the CP size {g.size}"
        )
    check_head_groups(head_groups, dims.num_heads // g.size, overlap)
    return _State(cp_mesh, g, overlap, family, dims, head_groups)


def parallelize_attention(
    module: _M, cp_mesh: DeviceMesh, *, overlap: bool = True, head_groups: int | str = "auto"
) -> _M:
    """Rewrite ``module`` in place for Ulysses context parallelism over the 1-D ``cp_mesh``.

    ``module``: a Hugging Face ``Qwen3NextAttention``, ``Qwen3Attention`` or
    ``LlamaAttention`` (``SUPPORTED_ATTENTION_CLASSES``; by class name and attributes).
    ``cp_mesh``: any 1-D mesh of P ranks (e.g. flattened from ``(cp, tp)``); rank r holds
    tokens ``[r·S/P, (r+1)·S/P)``.

    Afterwards ``module(hidden_states, position_embeddings, attention_mask,
    past_key_values=None, **kwargs)`` keeps the stock signature and returns ``(output,
    None)``: ``hidden_states [B, S/P, D]`` is this rank's block, ``position_embeddings`` the
    ``(cos, sin)`` of its tokens (from the global ``position_ids``; ``[1 or B, S/P, dr]``),
    ``output`` its rows of the serial output; the input's gradient and every parameter's
    gradient summed over ranks equal the serial module's (its own Parameters, whole).
    ``attention_mask`` None or plain causal, ``past_key_values`` None, no attention dropout in
    training (``ValueError`` on every rank given the same bad call, before any collective).
    Packed documents: ``cu_seqlens`` (or HF's ``cu_seq_lens_q``/``_k``) — the global offsets
    ``[0, …, S]``, ``B == 1`` — or ``sequence_context=``, exactly as ``parallelize_mla``: the
    attention never crosses a document boundary (the stock module run on each document alone,
    per-document positions in the caller's tables).

    The key/value heads: each rank receives, in one all-to-all of ``[k | v]``, the ``m``
    key/value heads its ``H/P`` query heads use (``m = Hkv/P`` when P divides ``Hkv``, 1
    when ``Hkv`` divides P), each head's sequence block sent once to every rank that needs it
    (``gqa`` module docstring: the plan and the bytes). ``overlap`` and ``head_groups``: as
    ``parallelize_mla`` (the same pipeline).

    Errors, identical on every rank before any communication, module untouched:
    ``TypeError`` (no supported class, ``overlap`` not a bool, ``cp_mesh`` not a DeviceMesh),
    ``RuntimeError`` (already rewritten), ``ValueError`` (mesh not 1-D, ``num_attention_heads``
    not divisible by P or by ``num_key_value_heads``, projection shapes not matching, a
    sliding window, bad ``head_groups``).
    """
    state = _validate(module, cp_mesh, overlap, head_groups)
    family = state.family
    install_forward(
        module, LAYER, state, lambda _cls: family.forward(_run), prefix="ContextParallel"
    )
    return module


def unparallelize_attention(module: _M) -> _M:
    """Undo :func:`parallelize_attention` (``RuntimeError`` if it was not applied)."""
    if not is_parallelized(module, LAYER):
        raise RuntimeError("module is not rewritten by parallelize_attention")
    uninstall_forward(module, LAYER)
    return module


def attention_head_groups(module: nn.Module, hidden_states: Tensor) -> HeadGroups:
    """The head-group count a forward of the rewritten ``module`` on this rank's
    ``hidden_states [B, S/P, D]`` uses, and why. Communicates nothing."""
    state = parallel_state(module, LAYER)
    if state is None:
        raise RuntimeError("module is not rewritten by parallelize_attention")
    return _head_groups(state, hidden_states)
