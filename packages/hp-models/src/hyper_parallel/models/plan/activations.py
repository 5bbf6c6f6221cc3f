"""Activation bytes of one rank: a cost model per block, written from what each parallel
layer's forward keeps for its backward (and what its backward adds at its peak), validated
against measured steps (the tracker of :mod:`hyper_parallel.models.plan.measure`: tests, and
benchmarks/bench_delta_rule_layers.py at real head sizes; tolerance in the tests).

Notation (one rank): ``B`` rows (``batch/dp``), ``T`` tokens a sequence, ``P = cp·tp``,
``n = B·T/P`` tokens the rank holds, ``b`` bytes an element (the plan's dtype; norms, the
router, the loss, the delta-rule state and kernel run in float32: 4 bytes), ``u = b`` where
``b < 4`` else 0 (a float32 copy's cast back), ``D`` hidden size, ``V`` vocabulary.

- each RMSNorm: ``n·D·(4 + b + u) + 4n`` bytes (its float32 values, the cast back where
  ``b < 4``, the output) and two residual adds ``2·n·D·b``, two norms a layer;
- MLA (hp-context-parallel, ``h = H/P`` heads over all ``B·T`` tokens, the latent gathered):
  ``n·(q_lora + kv_lora)·(4 + b) + n·rope·b`` (the latents' norms) and
  ``(2·B·T·h·(d_nope + d_v + d_qk) + n·H·d_v)·b`` (the expanded k/v heads and their split,
  the kernel's q and k, the output back), plus the attention core;
- the attention core, ``h`` heads over ``B·T`` tokens: a fused kernel (``"flash"``/``"sdpa"``)
  its output ``B·T·h·d_v·b`` and float32 log-sum-exps; the unfused math (``"eager"``/
  ``"sdpa-math"``; CPU sdpa also takes it where the q/k and v head dims differ, as MLA's do)
  the float32 probabilities ``4·B·h·T²``, and its backward adds twice that at its peak;
- gated GQA attention (hp-context-parallel's ``parallelize_attention``, Qwen3-Next: ``H``
  query heads, ``Hkv`` key/value heads of ``d``, ``h = H/P``, ``h_kv = max(1, Hkv/P)``):
  ``(n·(1 + g)·H·d + n·Hkv·d + B·T·(h + 2·h_kv)·d + n·(1 + g)·H·d)·b`` (q_proj's output
  with its gate, k_proj's, the exchanged q, k, v, the output back and the gate's sigmoid;
  ``g`` = 1 for the gated layer) and the q/k norms ``n·(H + Hkv)·d·(4 + 4·[b < 4])``, plus
  the core;
- KDA (hp-kda-kernels' ``parallelize_kda`` over ``P`` ranks, ``H`` heads of ``K``, convolution
  ``W``): ``n·H·K·(7·b + 53)`` bytes (the convolution's rows and output and o_proj's input in
  ``b``; in float32 the convolution's activated output or its copies, the l2-normalised q and
  k, the forget gate's four tensors and its mask byte, the gated norm's four) plus
  ``B·(W−1)·3HK·b`` (the halo rows), ``n·(2K + H)·b + 4nH·[b < 4]`` (the low-rank gates,
  beta), plus the chunk kernel over ``B·H`` sequences;
- Gated DeltaNet (``parallelize_gated_deltanet``, ``Hk`` key heads of ``K``, ``Hv`` value
  heads of ``V``, ``c = 2·Hk·K + Hv·V`` convolution channels): ``(2n + B·(W−1))·c·b + 4·n·c``
  (rows, convolution and its activated output or copies), ``8·n·Hv·K`` (q, k normalised and
  repeated to the value heads), ``3·n·Hv·V·(4 + b)`` (z, the gated norm, out_proj's input),
  ``n·Hv·(16 + u)`` (beta and the gate), plus the chunk kernel over ``B·Hv`` sequences (the
  scalar gate broadcast over ``K``: the same kernel as KDA's, counted once);
- the chunk kernel (:func:`kernel_profile`; chunks of ``C = min(64, T/P)`` tokens):
  ``kda_kernel="torch"``, hp-kda-kernels' lean path (what ``parallelize_kda`` and
  ``parallelize_gated_deltanet`` run): measured on the CPU at the real ``K, V`` (up to 8
  sequences over 4 and 8 chunks; a case that small run as it is): it keeps ``U, W, Q_eff``,
  ``C·(2K + V)·4`` bytes a chunk of a sequence, and two float32 states a sequence; its
  backward adds float32 gradient buffers a chunk and a recompute workspace the kernel bounds
  (its blocks of heads and chunks). How much depends on the gates (which of the kernel's
  forms a chunk takes): the probe's log-decays reach twice the fastest the family's
  initialisation allows (:data:`GATES`: Kimi-Linear's ``1.6`` a token, sub-chunked factors in
  a 64-token chunk; Qwen3-Next's ``20``, pairwise decays inside its 16-token sub-chunks).
  ``"fused"``: a kernel that
  keeps its inputs and one float32 ``K×V`` state a chunk, as flash-linear-attention's does,
  and nothing more at backward's peak;
- dense gated MLP (hp-mc2 over ``tp``): ``2·n·I·b`` (the gate and up projections' outputs;
  the gathered input is gathered again in backward, not kept);
- MoE (top-``k`` of ``E``, ``R = n·k`` routed rows, balanced): ``8·n·E + 12·n·k`` bytes of
  router, ``R·(4·I + 4·D) + 4·n·I_s`` elements (``n·(D + 2)`` more for a gated shared
  expert's output, gate and sigmoid), and ``2·R·D`` more for the exchange buffers where
  ``ep > 1``;
- the head: the embedding's output ``n·D·b``, the final norm, and ``n·V·(b + 8 + 4·[b < 4])``
  bytes of logits, their float32 log-softmax and loss.

The peak: the head's backward first (the logits' gradient ``n·V·(4 + b)`` beside everything
kept), then each layer's from the last, where a block's own extra (the delta-rule kernel's,
the attention math's ``T×T``) stands beside the layers below it, its own block (its MLP part
freed by then) and the embedding: the larger of the two.

Activation checkpointing (Hugging Face's ``gradient_checkpointing_enable``): each layer keeps
only its input ``n·D·b``; the peak adds a layer's recompute and its backward: the larger of
``5/4`` of the layer (its gradients beside part of it, measured: 1.13 for DeepSeek-V3's MLA +
MoE layer on the tests' tiny model) and its block's kept bytes plus that block's extra.

Validated (float32, the tracker, parameters and their gradients left out): one real-size
KDA and Gated DeltaNet layer at 512 and 2048 tokens a rank and a 4-layer Kimi-Linear with the
real KDA and MLA head sizes at 8192 tokens over cp = 4 (benchmarks/bench_delta_rule_layers.py),
the tests' tiny models with and without cp and checkpointing (tests/test_models_plan.py).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "KDA_KERNELS",
    "LayerShape",
    "activation_bytes",
    "layer_bytes",
    "layer_shape",
    "mixer_bytes",
    "stage_activation_bytes",
]

ATTN_IMPLEMENTATIONS = ("flash", "sdpa", "eager", "sdpa-math")  # sdpa: its fused kernels
KDA_KERNELS = ("torch", "fused")
KDA_CHUNK = 64  # hp-kda-kernels' chunk size under parallelize_kda


@dataclass(frozen=True)
class LayerShape:
    """One decoder layer's blocks as the cost model needs them: ``attn`` is ``"mla"``,
    ``"kda"``, ``"gqa"`` or ``"gdn"``, ``mlp`` ``"dense"`` or ``"moe"``; ``dims`` their sizes."""

    attn: str
    mlp: str
    dims: tuple[tuple[str, int], ...]

    def get(self, name: str) -> int:
        return dict(self.dims)[name]


def _out(linear: Any) -> int:
    return int(linear.weight.shape[0])


def layer_shape(layer: nn.Module, config: Any) -> LayerShape:
    """The :class:`LayerShape` of a stock decoder layer (built on any device, meta too)."""
    mixer = "self_attn" if hasattr(layer, "self_attn") else "linear_attn"  # Qwen3-Next's GDN
    attn: Any = layer.get_submodule(mixer)
    mlp: Any = layer.get_submodule("mlp")
    dims: dict[str, int] = {"D": int(config.hidden_size)}
    if hasattr(attn, "kv_a_proj_with_mqa"):
        kind = "mla"
        q_lora = getattr(attn, "q_lora_rank", None)
        dims.update(
            H=int(attn.num_heads),
            q_lora=int(q_lora or 0),
            kv_lora=int(attn.kv_lora_rank),
            rope=int(attn.qk_rope_head_dim),
            nope=int(attn.qk_nope_head_dim),
            dv=int(attn.v_head_dim),
        )
    elif hasattr(attn, "in_proj_qkvz"):
        kind = "gdn"
        dims.update(
            conv=int(attn.conv_kernel_size),
            Hk=int(attn.num_k_heads),
            Hv=int(attn.num_v_heads),
            K=int(attn.head_k_dim),
            V=int(attn.head_v_dim),
        )
    elif hasattr(attn, "conv_kernel_size") and hasattr(attn, "head_dim"):
        kind = "kda"
        dims.update(H=int(attn.num_heads), K=int(attn.head_dim), conv=int(attn.conv_kernel_size))
    elif all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
        kind = "gqa"
        h, hd = int(config.num_attention_heads), int(attn.head_dim)
        dims.update(
            H=h,
            Hkv=int(config.num_key_value_heads),
            d=hd,
            gated=int(_out(attn.q_proj) == 2 * h * hd),
        )
    else:
        raise TypeError(f"the planner has no cost model for {type(attn).__name__}")
    if hasattr(mlp, "experts"):
        mkind = "moe"
        experts: Any = mlp.get_submodule("experts")
        e, two_i, _ = experts.gate_up_proj.shape
        top_k = getattr(config, "num_experts_per_tok", None) or config.num_experts_per_token
        shared = getattr(mlp, "shared_experts", None) or getattr(mlp, "shared_expert", None)
        dims.update(
            E=int(e),
            I=int(two_i) // 2,
            k=int(top_k),
            Is=_out(shared.gate_proj) if shared is not None else 0,
            Ig=int(hasattr(mlp, "shared_expert_gate")),
        )
    elif hasattr(mlp, "gate_proj"):
        mkind = "dense"
        dims.update(I=_out(mlp.gate_proj))
    else:
        raise TypeError(f"the planner has no cost model for {type(mlp).__name__}")
    return LayerShape(kind, mkind, tuple(sorted(dims.items())))


@dataclass(frozen=True)
class KernelProfile:
    """What the delta-rule chunk kernel keeps and what its backward adds at its peak, in bytes:
    ``kept_*`` per ``(row, head)`` sequence and per ``(row, head, chunk)``; ``extra_chunk``
    per ``(row, head, chunk)`` (the gradient buffers), ``extra_fixed`` once (the recompute
    workspace, which hp-kda-kernels' lean path bounds)."""

    kept_head: int
    kept_chunk: int
    extra_fixed: int
    extra_chunk: int


PROBE_HEADS = 8  # heads of the measured runs (enough to fill the lean path's recompute blocks)
PROBE_CHUNKS = (4, 8)
# the probe's gates: a token's log-decay uniform in [0, GATES[kind]], twice the fastest the
# family's initialisation allows (Kimi-Linear's KDA: exp(A_log) <= 16 times softplus <= 0.1;
# Qwen3-Next's Gated DeltaNet: exp(A_log) <= 16 times softplus(a + 1), about 1.3): which of
# hp-kda-kernels' forms a chunk takes (a 64-token chunk spanning past 60: sub-chunked factors;
# a 16-token sub-chunk past 60 too: pairwise decays) and so what its backward holds
GATES = {"kda": 3.2, "gdn": 40.0}


def _probe(
    k_dim: int, v_dim: int, heads: int, chunks: int, chunk: int, gate: float
) -> tuple[int, int]:
    """``(kept, backward's extra at its peak)`` of one run of hp-kda-kernels' lean path, float32
    on the CPU: ``heads`` heads of ``chunks`` chunks, log-decays uniform in ``[0, gate]``."""
    from hyper_parallel.kda.lean import lean_output_terms, lean_outputs, lean_summary
    from hyper_parallel.models.plan.measure import track_activations

    t = chunks * chunk
    gen = torch.Generator().manual_seed(0)
    q, k = (F.normalize(torch.randn(1, t, heads, k_dim, generator=gen), dim=-1) for _ in "qk")
    v = torch.randn(1, t, heads, v_dim, generator=gen)
    g = -torch.rand(1, t, heads, k_dim, generator=gen) * gate
    beta = torch.rand(1, t, heads, generator=gen)
    h0 = torch.zeros(1, heads, k_dim, v_dim)
    do = torch.randn(1, t, heads, v_dim, generator=gen)
    for x in (q, k, v, g, beta, h0):
        x.requires_grad_(True)
    with track_activations() as trace:
        S, M, terms = lean_summary(k, v, g, beta, chunk)
        local = lean_output_terms(terms, q, k_dim**-0.5)
        # as the exchange does: the incoming state depends on the summary (S, M get gradients)
        o, _ = lean_outputs(terms, local, h0 + 0 * (S.sum() + M.sum()))
        del S, M, terms, local
        out = o.numel() * o.element_size()
        kept = trace.live_bytes() - out
        torch.autograd.backward([o], [do])
    return kept, trace.peak() - out - kept


_probe_cached = functools.lru_cache(maxsize=64)(_probe)


@functools.lru_cache(maxsize=32)
def kernel_profile(
    k_dim: int, v_dim: int, kernel: str, chunk: int, heads: int, gate: float = GATES["kda"]
) -> KernelProfile:
    """The :class:`KernelProfile` of the chunk kernel for ``heads`` heads (rows × heads) of
    ``k_dim × v_dim`` and chunks of ``chunk`` tokens.

    ``"torch"``: measured on hp-kda-kernels' lean path (``lean_summary``, ``lean_output_terms``,
    ``lean_outputs``: what ``parallelize_kda`` and ``parallelize_gated_deltanet`` run) by
    :func:`_probe` on ``min(heads, PROBE_HEADS)`` heads over 4 and 8 chunks: what is kept and
    backward's extra grow linearly with the chunks (per head: the slope over the probe's
    heads), the rest of the extra is the workspace of the recompute blocks, bounded by the
    kernel, not by the length. ``"fused"``: a kernel that keeps its inputs and one float32
    state a chunk, as flash-linear-attention's does, and nothing more at backward's peak (not
    measured)."""
    if kernel == "fused":
        return KernelProfile(0, chunk * (3 * k_dim + v_dim + 1) * 4 + 4 * k_dim * v_dim, 0, 0)
    h = min(heads, PROBE_HEADS)
    (k1, e1), (k2, e2) = (_probe_cached(k_dim, v_dim, h, c, chunk, gate) for c in PROBE_CHUNKS)
    span = PROBE_CHUNKS[1] - PROBE_CHUNKS[0]
    kept_chunk = (k2 - k1) // (span * h)
    extra_chunk = max(0, e2 - e1) // (span * h)
    kept_head = max(0, k1 // h - PROBE_CHUNKS[0] * kept_chunk)
    fixed = max(0, e1 - PROBE_CHUNKS[0] * h * extra_chunk)
    return KernelProfile(kept_head, kept_chunk, fixed, extra_chunk)


def _attention_core_bytes(
    rows: int, heads: int, seq: int, dv: int, b: int, impl: str
) -> tuple[int, int]:
    """``(kept, backward's extra at its peak)`` of the attention kernel over ``heads`` heads of
    ``rows × seq`` tokens, beside its ``q, k, v`` (the caller's): a fused kernel (flash, sdpa's
    fused ones) keeps its output and float32 log-sum-exps; the unfused math (eager,
    sdpa-math, and CPU sdpa where the q/k and v head dims differ, as MLA's do) keeps the
    float32 softmax probabilities, and its backward adds two more ``T×T`` (their gradient and
    the softmax's)."""
    if impl in ("eager", "sdpa-math"):
        probs = rows * heads * seq * seq * 4
        return probs, 2 * probs
    return rows * seq * heads * (dv * b + 4), 0


def _kernel(
    rows: int, local: int, heads: int, k: int, v: int, kernel: str, gate: float
) -> tuple[int, int]:
    """``(kept, backward's extra at its peak)`` of the delta-rule chunk kernel for ``rows ×
    heads`` sequences of ``local`` tokens (:func:`kernel_profile`; hp-kda-kernels' rule: one
    short chunk below ``KDA_CHUNK`` tokens)."""
    if local == 0:
        return 0, 0
    chunk = min(KDA_CHUNK, local)
    seqs, chunks = rows * heads, -(-local // chunk)
    if kernel == "torch" and seqs <= PROBE_HEADS and chunks <= PROBE_CHUNKS[-1]:
        return _probe_cached(k, v, seqs, chunks, chunk, gate)  # small enough to run as it is
    prof = kernel_profile(k, v, kernel, chunk, seqs, gate)
    kept = seqs * (prof.kept_head + chunks * prof.kept_chunk)
    return kept, prof.extra_fixed + seqs * chunks * prof.extra_chunk


def _norm_bytes(n: int, d: int, b: int) -> int:
    """An RMSNorm over ``n × d`` (input not counted): the float32 copy where ``b < 4`` and the
    normalised float32 values (or their cast back), the output, the float32 ``rsqrt``."""
    return n * d * (4 + b + (b if b < 4 else 0)) + 4 * n


def _mixer(
    shape: LayerShape,
    *,
    rows: int,
    seq: int,
    p: int,
    b: int,
    attn_implementation: str,
    kda_kernel: str,
) -> tuple[int, int]:
    """``(kept, backward's extra at its peak)`` of the layer's attention or delta-rule block on
    one rank (module docstring); the extra is the delta-rule kernel's, 0 for attention."""
    g = shape.get
    n = rows * seq // p
    if shape.attn == "mla":
        h, hl, dv = g("H"), g("H") // p, g("dv")
        dqk = g("nope") + g("rope")
        # the latents' norms (q's where q is low-rank), the rope part; for every token of the
        # rank's heads the expanded k/v heads (kv_b_proj's output and its split) and the
        # kernel's q and k (or the math's scaled ones); the output back (o_proj's input)
        out = n * (g("q_lora") + g("kv_lora")) * (4 + b) + n * g("rope") * b
        out += (2 * rows * seq * hl * (g("nope") + dv + dqk) + n * h * dv) * b
        core, extra = _attention_core_bytes(rows, hl, seq, dv, b, attn_implementation)
        return out + core, extra
    if shape.attn == "gqa":
        h, hkv, hd = g("H"), g("Hkv"), g("d")
        hl, kvl = h // p, max(1, hkv // p)
        gated = g("gated")
        # q_proj's output (with its gate), k_proj's, the exchanged q, k, v of every token, the
        # output back and (gated) the gate's sigmoid
        elems = n * (1 + gated) * h * hd + n * hkv * hd + rows * seq * (hl + 2 * kvl) * hd
        elems += n * h * hd * (1 + gated)
        out = elems * b + n * (h + hkv) * hd * (4 + (4 if b < 4 else 0))  # the q/k norms
        core, extra = _attention_core_bytes(rows, hl, seq, hd, b, attn_implementation)
        return out + core, extra
    up = b if b < 4 else 0  # a float32 copy's own bytes beside the b-byte original
    halo = rows * (g("conv") - 1)
    if shape.attn == "gdn":
        hk, hv, k, v = g("Hk"), g("Hv"), g("K"), g("V")
        qkv = 2 * hk * k + hv * v
        out = (2 * n + halo) * qkv * b + n * qkv * 4  # rows, convolution; its output in fp32
        out += 2 * n * hv * k * 4  # q, k (l2-normalised, repeated to the value heads)
        out += 3 * n * hv * v * (4 + b)  # z, the gated norm and out_proj's input
        out += n * hv * (16 + up)  # beta, the gate
        kept, extra = _kernel(rows, seq // p, hv, k, v, kda_kernel, GATES["gdn"])
        return out + kept, extra
    h, k = g("H"), g("K")
    u = n * h * k
    out = (7 * u + halo * 3 * h * k) * b  # rows, convolution, o_proj's input
    out += 13 * u * 4 + u  # conv output or its fp32 copies, q/k, the gate (and its mask), o_norm
    out += n * (2 * k + h) * b + 4 * n * h * (up > 0)  # the low-rank gates, beta
    kept, extra = _kernel(rows, seq // p, h, k, k, kda_kernel, GATES["kda"])
    return out + kept, extra


def mixer_bytes(
    shape: LayerShape,
    *,
    rows: int,
    seq: int,
    p: int,
    b: int,
    attn_implementation: str,
    kda_kernel: str,
    peak: bool = False,
) -> int:
    """Bytes the layer's attention (or delta-rule) block alone keeps for backward on one rank
    (its share of :func:`layer_bytes`: no norms, no MLP); ``peak``: with what its backward adds
    at its peak (the delta-rule kernel's recompute and gradients): the block's own peak over
    one forward + backward."""
    kept, extra = _mixer(
        shape, rows=rows, seq=seq, p=p, b=b, attn_implementation=attn_implementation,
        kda_kernel=kda_kernel,
    )  # fmt: skip
    return kept + extra if peak else kept


def layer_bytes(
    shape: LayerShape,
    *,
    rows: int,
    seq: int,
    p: int,
    ep: int,
    b: int,
    attn_implementation: str,
    kda_kernel: str,
) -> int:
    """Bytes one decoder layer keeps for backward on one rank (module docstring)."""
    g = shape.get
    d = g("D")
    n = rows * seq // p
    out = 2 * _norm_bytes(n, d, b) + 2 * n * d * b
    out += mixer_bytes(
        shape, rows=rows, seq=seq, p=p, b=b, attn_implementation=attn_implementation,
        kda_kernel=kda_kernel,
    )  # fmt: skip
    if shape.mlp == "dense":
        out += 2 * n * g("I") * b  # hp-mc2 keeps the gate and up projections' outputs
    else:
        r = n * g("k")
        out += 8 * n * g("E") + 12 * n * g("k")
        elems = r * (4 * g("I") + 4 * d) + 4 * n * g("Is")
        elems += n * (d + 2) * g("Ig")  # the gated shared expert's output, its gate, sigmoid
        if ep > 1:
            elems += 2 * r * d
        out += elems * b
    return out


@dataclass
class Activations:
    """``peak``: the most bytes of activations live at once in one forward + backward;
    ``saved``: what the forward leaves for backward; ``by_layer``: each layer kind's bytes a
    layer (as :func:`layer_bytes`) and count."""

    peak: int
    saved: int
    by_layer: list[tuple[LayerShape, int, int]]


def _checked(attn_implementation: str, kda_kernel: str, seq: int, p: int) -> None:
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"attn_implementation must be one of {ATTN_IMPLEMENTATIONS}, got "
            f"{attn_implementation!r}"
        )
    if kda_kernel not in KDA_KERNELS:
        raise ValueError(f"kda_kernel must be one of {KDA_KERNELS}, got {kda_kernel!r}")
    if seq % p:
        raise ValueError(f"seq_len {seq} is not divisible by cp·tp = {p}")


def activation_bytes(
    shapes: list[tuple[LayerShape, int]],
    config: Any,
    *,
    rows: int,
    seq: int,
    p: int,
    ep: int,
    dtype: torch.dtype,
    attn_implementation: str,
    kda_kernel: str,
    checkpointing: bool,
    order: Sequence[int] | None = None,
) -> Activations:
    """One rank's :class:`Activations` for the layer kinds ``shapes`` (each with its count),
    ``rows`` rows of ``seq`` tokens over ``p = cp·tp`` ranks (module docstring)."""
    _checked(attn_implementation, kda_kernel, seq, p)
    kw: dict[str, Any] = dict(
        rows=rows, seq=seq, p=p, b=dtype.itemsize, attn_implementation=attn_implementation,
        kda_kernel=kda_kernel,
    )  # fmt: skip
    if order is None:  # no order known: each kind's layers last (the most kept below them)
        extras = [_mixer(s, **kw)[1] for s, _ in shapes]
        order = [i for i in sorted(range(len(shapes)), key=extras.__getitem__) for _ in
                 range(shapes[i][1])]  # fmt: skip
    return stage_activation_bytes(
        shapes, config, order, first=True, last=True, ep=ep, checkpointing=checkpointing, **kw
    )


def stage_activation_bytes(
    shapes: list[tuple[LayerShape, int]],
    config: Any,
    order: Sequence[int],
    *,
    first: bool,
    last: bool,
    rows: int,
    seq: int,
    p: int,
    ep: int,
    b: int,
    attn_implementation: str,
    kda_kernel: str,
    checkpointing: bool,
) -> Activations:
    """One forward + backward of ``rows`` rows through the decoder layers of kinds ``order``
    (indices into ``shapes``, in model order) alone: the whole model where ``first`` and
    ``last``, else one pipeline stage. The first stage keeps the embedding's output, the last
    the final norm, the logits and the loss, and its backward starts with the logits'
    gradient; another stage's input and incoming gradient live in the pipeline's receive
    buffers (counted by the planner beside the activations), so it keeps neither.
    ``by_layer``: each kind's bytes a layer and how many of the stage's layers are of it."""
    _checked(attn_implementation, kda_kernel, seq, p)
    d, v = int(config.hidden_size), int(config.vocab_size)
    n = rows * seq // p
    kw: dict[str, Any] = dict(
        rows=rows, seq=seq, p=p, b=b, attn_implementation=attn_implementation,
        kda_kernel=kda_kernel,
    )  # fmt: skip
    counts = [0] * len(shapes)
    for i in order:
        counts[i] += 1
    per = [(s, layer_bytes(s, ep=ep, **kw), c) for (s, _), c in zip(shapes, counts, strict=True)]
    mixers = [_mixer(s, **kw) for s, _ in shapes]  # (kept, extra) of each kind's block
    c_up = 4 if b < 4 else 0
    emb = n * d * b if first else 0  # the embedding's output (the first norm's input)
    head = emb
    transient = 0
    if last:  # the final norm, the logits and their float32 log-softmax and loss
        head += _norm_bytes(n, d, b) + n * v * (b + 8 + c_up)
        transient = n * v * (4 + b)  # the logits' gradient
    used = [i for i, c in enumerate(counts) if c]
    if checkpointing:
        saved = head + len(order) * n * d * b
        # a layer's recompute, and its backward: its gradients beside a quarter of it
        # (measured), or, once the MLP's backward has freed its part, the attention (or
        # delta-rule) block's own extra beside that block (the math's T×T, the chunk kernel's)
        recompute = max(
            (max(5 * per[i][1] // 4, mixers[i][0] + mixers[i][1]) for i in used), default=0
        )
        peak = saved + max(recompute, transient)
    else:
        saved = head + sum(x * c for _, x, c in per)
        # the head's backward first (the logits' gradient beside everything kept), then each
        # layer's from the last: its block's extra beside the layers below it (those above
        # and the head are freed by then)
        below, bwd = emb, 0
        for i in order:  # at its block's backward the layer's MLP part is freed
            bwd = max(bwd, below + mixers[i][0] + mixers[i][1])
            below += per[i][1]
        peak = max(saved + transient, bwd)
    return Activations(peak, saved, per)
