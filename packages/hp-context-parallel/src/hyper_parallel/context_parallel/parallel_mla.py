"""``parallelize_mla``: Ulysses context parallelism for an MLA block, applied from outside.

Rank r of the P-rank CP mesh holds tokens ``[r·S/P, (r+1)·S/P)``; the rewritten forward takes
``[B, S/P, D]`` and returns the same rows of the serial output (RoPE at global positions).
The module may be this package's ``MultiHeadLatentAttention`` or a Hugging Face
``DeepseekV3Attention`` / ``KimiLinearAttention``: a family adapter (``families.py``) says how
to call and rotate it; the schedule is the same for all of them. Each call is first admitted
by every rank on its own, without communicating (``admission.py``; the ranks compare their
calls only in consistency mode), so a forward issues only the schedule's collectives.

The schedule is one pipeline for G ≥ 1 head groups (``pipeline.py``, its order described
there), with the strategy's K/V side — ``expanded`` or ``latent``, the classes of
``strategies.STRATEGY_CLASSES`` — plugged in; this module admits the call, picks G and
installs / undoes the rewrite.

Partial ``torch.autograd.grad`` calls that prune one node of an overlapped launch/wait pair are
unsupported; the leaked collective is reported at the next forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from torch import Tensor, nn
from torch.distributed.tensor.parallel import ParallelStyle

from hyper_parallel.context_parallel.admission import admit
from hyper_parallel.context_parallel.families import MLACall, MLAFamily, find_family
from hyper_parallel.context_parallel.head_groups import (
    HeadGroups,
    check_head_groups,
    choose_head_groups,
)
from hyper_parallel.context_parallel.mla import MLAConfig
from hyper_parallel.context_parallel.pipeline import Pipeline, run_pipeline
from hyper_parallel.context_parallel.strategies import STRATEGY_CLASSES
from hyper_parallel.context_parallel.transport import Group, resolve_group
from hyper_parallel.dtensor import DeviceMesh
from hyper_parallel.dtensor.rewrite import (
    install_forward,
    is_parallelized,
    parallel_state,
    uninstall_forward,
)

__all__ = [
    "STRATEGIES",
    "ContextParallelMLA",
    "is_context_parallel",
    "mla_head_groups",
    "parallelize_mla",
    "unparallelize_mla",
]

STRATEGIES = tuple(STRATEGY_CLASSES)  # ("expanded", "latent"): strategies.py is the registry
_M = TypeVar("_M", bound=nn.Module)
LAYER = "parallelize_mla"  # the name this rewrite is installed under (hp-dtensor's rewrite)
ATTENTION_LAYER = "parallelize_attention"  # parallel_attention.py's (grouped-query attention)


@dataclass(frozen=True)
class _CPState:
    mesh: DeviceMesh
    group: Group
    strategy: str
    overlap: bool
    family: MLAFamily
    dims: MLAConfig
    head_groups: int | str = "auto"

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def rank(self) -> int:
        return self.group.rank


# ---- the forward --------------------------------------------------------------------------
def _run(m: Any, call: MLACall) -> Tensor:
    """The rewritten forward of every family: ``call.hidden_states [B, S/P, D] -> [B, S/P, D]``."""
    st: _CPState = parallel_state(m, LAYER)
    c, fam = st.dims, st.family
    options = {
        "strategy": st.strategy,
        "overlap": st.overlap,
        "cp_size": st.size,
        "head_groups": st.head_groups,
    }
    adm = admit(m, fam, c, call, st.group, options)  # local; agreement in consistency mode
    x: Tensor = call.hidden_states
    rope = fam.rope(m, call, st.rank * adm.s_local, c)
    groups = _head_groups(st, x, c).count
    check = adm.context if adm.context is not None and adm.context.needs_check else None
    pl = Pipeline(m, c, st.group, groups, st.overlap, check)
    return run_pipeline(pl, st.strategy, x, rope, fam.scale(m), adm)


def _head_groups(st: _CPState, x: Tensor, c: MLAConfig) -> HeadGroups:
    """The head-group count of this forward: the fixed one, or the ``"auto"`` rule's
    (shapes, CP size and device type only: the same on every rank)."""
    if st.head_groups != "auto":
        return HeadGroups(int(st.head_groups), "set by parallelize_mla(head_groups=...)")
    return choose_head_groups(
        c.num_heads // st.size,
        x.shape[1],
        x.shape[0],
        c.qk_head_dim,
        x.element_size(),
        st.size,
        x.device.type,
        st.overlap,
    )


# ---- the transactional rewrite ------------------------------------------------------------
def _check_weights(module: Any, c: MLAConfig) -> None:
    """The projections must have the shapes the schedule slices (a fork that changed them is
    rejected here rather than computing something else)."""
    h, dq, width = c.num_heads, c.qk_head_dim, c.qk_nope_head_dim + c.v_head_dim
    q = (
        [("q_proj", (h * dq, c.hidden_size))]
        if c.q_lora_rank is None
        else [("q_a_proj", (c.q_lora_rank, c.hidden_size)), ("q_b_proj", (h * dq, c.q_lora_rank))]
    )
    expected = q + [
        ("kv_a_proj_with_mqa", (c.kv_lora_rank + c.qk_rope_head_dim, c.hidden_size)),
        ("kv_b_proj", (h * width, c.kv_lora_rank)),
        ("o_proj", (c.hidden_size, h * c.v_head_dim)),
    ]
    for name, shape in expected:
        weight = getattr(getattr(module, name, None), "weight", None)
        if not isinstance(weight, Tensor) or tuple(weight.shape) != shape:
            got = tuple(weight.shape) if isinstance(weight, Tensor) else None
            raise ValueError(f"{name}.weight must have shape {shape} for this MLA, got {got}")
    if getattr(module.kv_b_proj, "bias", None) is not None:
        raise ValueError("kv_b_proj must have no bias (the latent strategy slices its rows)")


def _validate(module: Any, cp_mesh: Any, strategy: Any, overlap: Any, head_groups: Any) -> _CPState:
    if is_parallelized(module, LAYER):
        raise RuntimeError(
            "parallelize_mla was already applied to this module; call unparallelize_mla first"
        )
    family = find_family(module)  # TypeError listing the supported classes
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be a bool, got {overlap!r}")
    if not isinstance(cp_mesh, DeviceMesh):
        raise TypeError(f"cp_mesh must be a 1-D torch DeviceMesh, got {type(cp_mesh).__name__}")
    g = resolve_group(
        cp_mesh
    )  # ValueError for n-D meshes or a rank order differing from the group's
    dims = family.dims(module)
    _check_weights(module, dims)
    if dims.num_heads % g.size:
        raise ValueError(f"num_heads ({dims.num_heads}) is not divisible by the CP size {g.size}")
    check_head_groups(head_groups, dims.num_heads // g.size, overlap)
    return _CPState(cp_mesh, g, strategy, overlap, family, dims, head_groups)


def parallelize_mla(
    module: _M,
    cp_mesh: DeviceMesh,
    *,
    strategy: str = "expanded",
    overlap: bool = True,
    head_groups: int | str = "auto",
) -> _M:
    """Rewrite ``module`` in place for Ulysses context parallelism over the 1-D ``cp_mesh``.

    ``module``: this package's ``MultiHeadLatentAttention``, or a Hugging Face
    ``DeepseekV3Attention`` / ``KimiLinearAttention`` (q LoRA or not), recognised by class
    name and attributes. ``cp_mesh``: any 1-D mesh of P ranks, e.g. one flattened from a
    ``(cp, tp)`` mesh; rank r of it holds tokens ``[r·S/P, (r+1)·S/P)``.

    Afterwards the forward keeps the module's own signature and return value —
    ``module(hidden_states) -> Tensor`` for ours, ``(output, None)`` for the HF modules — with
    ``hidden_states [B, S/P, D]`` this rank's block; it returns rows ``[r·S/P, (r+1)·S/P)`` of
    the serial output, and the input's gradient and every parameter's gradient summed over
    ranks equal the serial module's (the module's own Parameters are used and stay whole:
    the latent strategy reads only its rows of ``kv_b_proj``, so that parameter's gradient is
    non-zero only in those rows on each rank). RoPE: ours rotates at global positions itself;
    ``DeepseekV3Attention`` takes ``position_embeddings = (cos, sin)`` of this rank's tokens
    (from the global ``position_ids``) in the layout of ``config.rope_interleave``;
    ``KimiLinearAttention`` has none. Softmax scale: ``module.scaling`` for the HF modules.
    ``attention_mask`` must be None or plain causal and ``past_key_values`` None (every rank
    checks its own call before the first collective, without communicating: ``ValueError``
    on every rank given the same bad input; the ranks compare in consistency mode).

    Packed documents (HF modules): ``cu_seqlens`` (1-D integer, the global document offsets
    ``[0, …, S]``, identical on every rank, ``B == 1``; Hugging Face's ``cu_seq_lens_q`` /
    ``cu_seq_lens_k``, equal, are taken as the same table) makes the attention after the
    exchange document-causal in both strategies: query ``i`` sees the keys ``j <= i`` of its
    own document, the serial module run on each document alone (the caller's
    ``position_embeddings`` come from per-document positions). The exchanges are unchanged.
    A table not starting at 0, not ending at S, not strictly increasing, or given with
    ``B > 1`` raises ``ValueError`` before the schedule's first collective (on every rank
    given it). ``sequence_context=ctx`` instead (hp-dtensor's ``SequenceContext`` over
    ``cp_mesh``, equal blocks, e.g. hp-models' one per forward) hands the documents over
    validated: nothing is read back to the host. Tables differing across ranks raise
    ``SequenceMismatchError`` on every rank before the forward returns, also with consistency
    mode off: the first exchange carries the table's fingerprint unless the context was
    already compared (see ``pipeline.py``).

    ``strategy``: ``"expanded"`` (a2a of Q, K and V) or ``"latent"`` (a2a of Q, all-gather of
    the ``kv_lora_rank + qk_rope_head_dim`` latent; ``strategies.py``). ``overlap``: overlap
    collectives with projection and attention compute (the schedule: ``pipeline.py``) or run
    them blocking.
    ``head_groups``: ``"auto"`` (the default), ``1`` (one exchange per tensor), an int ``G``
    dividing ``num_heads / P``
    (the head-group pipeline, ``overlap=True`` only: the exchanges of each group of heads are
    in flight under the attention of the others, forward and backward; the same outputs and
    gradients as ``G = 1``, to rounding); ``"auto"`` decides per forward from shapes, the CP
    size and the device type only (``head_groups.choose_head_groups``; 1 with
    ``overlap=False``): :func:`mla_head_groups` tells which count a call gets, and why.

    Consistency mode (hp-dtensor's README, "Ranks that disagree"): each forward first
    compares, over the CP group, ``strategy``, ``overlap``, the CP size, what the forward
    decides from its call (family, sizes, ``hidden_states``/mask/RoPE shapes and dtypes, the
    packed-documents tables, training mode) and each rank's verdict on its call (see
    ``admission.check_call_consistent``).

    Errors, raised identically on every rank before any communication, leaving the module
    untouched: ``TypeError`` (a module of no supported family — the message lists them —,
    ``overlap`` not a bool, ``cp_mesh`` not a DeviceMesh), ``RuntimeError`` (already
    parallelized), ``ValueError`` (unknown strategy, mesh not 1-D or with a rank order
    differing from its group's, heads not divisible by the CP size, projection shapes that
    do not match the module's sizes, ``head_groups`` not ``"auto"`` nor a positive int
    dividing ``num_heads / P``, or above 1 with ``overlap=False``).
    """
    state = _validate(module, cp_mesh, strategy, overlap, head_groups)
    family = state.family
    install_forward(
        module, LAYER, state, lambda _cls: family.forward(_run), prefix="ContextParallel"
    )
    return module


def unparallelize_mla(module: _M) -> _M:
    """Undo :func:`parallelize_mla` (``RuntimeError`` if it was not applied): the module gets
    its own class and forward back; its Parameters were never replaced."""
    if not is_parallelized(module, LAYER):
        raise RuntimeError("module is not context-parallel")
    uninstall_forward(module, LAYER)
    return module


def is_context_parallel(module: nn.Module) -> bool:
    """Whether ``module`` is rewritten by :func:`parallelize_mla` or
    :func:`~hyper_parallel.context_parallel.parallelize_attention`."""
    return is_parallelized(module, LAYER) or is_parallelized(module, ATTENTION_LAYER)


def mla_head_groups(module: nn.Module, hidden_states: Tensor) -> HeadGroups:
    """The head-group count a forward of the rewritten ``module`` on this rank's
    ``hidden_states [B, S/P, D]`` uses, with the reason (``RuntimeError`` if ``module`` is
    not context-parallel). Computes nothing and communicates nothing."""
    state = parallel_state(module, LAYER)
    if state is None:
        raise RuntimeError("module is not context-parallel")
    return _head_groups(state, hidden_states, state.dims)


class ContextParallelMLA(ParallelStyle):
    """torch ``ParallelStyle`` form of :func:`parallelize_mla`, for ``parallelize_module``::

    parallelize_module(model, cp_mesh, {"layers.0.attn": ContextParallelMLA("latent")})
    """

    def __init__(
        self, strategy: str = "expanded", *, overlap: bool = True, head_groups: int | str = "auto"
    ) -> None:
        super().__init__()
        self.strategy, self.overlap, self.head_groups = strategy, overlap, head_groups

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return parallelize_mla(
            module,  # type: ignore[arg-type]  # validated: TypeError unless MLA
            device_mesh,
            strategy=self.strategy,
            overlap=self.overlap,
            head_groups=self.head_groups,
        )
