"""Activation bytes of one rank: a cost model per block, written from what each parallel
layer's forward keeps for its backward, validated against measured steps (the tracker of
:mod:`hyper_parallel.models.plan.measure`; ratios in docs/benchmarks.md, tolerance in the
tests).

Notation (one rank): ``B`` rows (``batch/dp``), ``T`` tokens a sequence, ``P = cp·tp``,
``n = B·T/P`` tokens the rank holds, ``b`` bytes an element (the plan's dtype; norms, the
router, the loss and KDA's state run in float32: 4 bytes), ``D`` hidden size, ``V``
vocabulary.

- norms and residual adds, per layer: ``2·(n·D·(4 + c) + 4n) + 2·n·D·b`` with ``c = 4 + b``
  where ``b < 4`` (the float32 copy and the cast back), else 0;
- MLA (hp-context-parallel, ``H/P`` heads over all ``B·T`` tokens, the latent gathered):
  ``n·(2·q_lora + 2·kv_lora + rope) + 4·n·H·d_qk + B·T·(kv_lora + rope)
  + B·T·(H/P)·(d_nope + 4·d_v + 2·d_qk) + n·H·d_v + 2·n·D`` elements, plus ``B·(H/P)·T``
  float32 log-sum-exps; ``attn_implementation="eager"``/``"sdpa-math"`` adds the softmax
  probabilities ``B·(H/P)·T²`` elements (flash-style kernels keep none);
- KDA (hp-kda-kernels over ``P`` ranks, ``H`` heads of ``K``): ``23·n·H·K + n·(2K + 4H) + n·D``
  elements around the kernel, plus the kernel's own: ``B·H·⌈(T/P)/C⌉`` chunks of ``C = 64``
  tokens, each what the chunk kernel keeps (``kda_kernel="torch"``: hp-kda-kernels' reference
  chunk path, measured here by running it on one chunk pair of the real ``K, V`` on the CPU;
  ``"fused"``: a kernel that keeps its inputs and one float32 ``K×V`` state a chunk, as
  flash-linear-attention's does);
- gated GQA attention (hp-context-parallel's ``parallelize_attention``, Qwen3-Next: ``H``
  query heads, ``Hkv`` key/value heads of ``d``, ``H/P`` heads a rank over all ``B·T`` tokens,
  ``max(1, Hkv/P)`` key/value heads a rank): ``n·(2Hd + 2Hkv·d) + 2n·(H + Hkv)·d`` (projections,
  per-head norms and rotary) ``+ B·T·(2H/P + 2·max(1, Hkv/P))·d`` (the exchanged heads and the
  output) ``+ 3n·H·d`` (the output back, its gate and their product) elements, plus the
  log-sum-exps (and the probabilities under eager/sdpa-math, as MLA);
- Gated DeltaNet (hp-kda-kernels' ``parallelize_gated_deltanet`` over ``P`` ranks, ``Hk`` key
  heads of ``K``, ``Hv`` value heads of ``V``): projections ``n·(2HkK + 2HvV + 2Hv)``, the
  short convolution's input, output and activation ``3n·(2HkK + HvV)``, the normalised and
  repeated ``q, k`` ``2n·(Hk + Hv)·K``, the output and the gated norm ``5n·Hv·V`` elements, the
  float32 gates and the norm's float32 copy ``8n·Hv + 4n·Hv·V`` bytes; then the KDA path it runs
  through (q, k repeated to the value heads, the scalar gate broadcast over ``K``): KDA's
  ``23·n·Hv·K`` elements around the kernel and twice the chunk kernel's bytes for
  ``B·Hv·⌈(T/P)/C⌉`` chunks. The factor 2 is measured, not derived: the stock layer under
  ``parallelize_gated_deltanet`` on the tests' model keeps 423 KB, 2.30 MB and 9.10 MB at 64,
  256 and 1024 tokens over 4 ranks; this model says 421 KB, 2.26 MB and 9.05 MB (with the
  kernel counted once it says 0.6 of the measured bytes);
- dense gated MLP (hp-mc2 over ``tp``): ``4·n·I + n·D`` elements (the gathered input is
  gathered again in backward, not kept);
- MoE (top-``k`` of ``E``, ``R = n·k`` routed rows, balanced): ``8·n·E + 12·n·k`` bytes of
  router, ``R·(4·I + 2·D) + n·k·D + 2·n·D + 4·n·I_s`` elements (``2n`` more for a gated shared
  expert's gate), and ``2·R·D`` more for the
  exchange buffers where ``ep > 1``;
- the head: the final norm, and ``n·V·(b + 8 + c')`` bytes of logits, their float32
  log-softmax and loss (``c' = 4`` where ``b < 4``); the embedding ``n·D``;
- backward's own transient at the peak: the logits' gradient ``n·V·(4 + b)``.

Activation checkpointing (Hugging Face's ``gradient_checkpointing_enable``): each layer keeps
only its input ``n·D``; the peak adds one and a half layers' activations: its recompute, and
its backward's gradients, which at their peak stand beside about half of the recomputed
tensors (the factor is measured: 1.93 for Kimi-Linear's KDA layer, 1.34 for DeepSeek-V3's MLA +
MoE layer on the tests' tiny models; 1.5 keeps both within the tests' tolerance).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["ATTN_IMPLEMENTATIONS", "KDA_KERNELS", "LayerShape", "activation_bytes", "layer_shape"]

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


@functools.lru_cache(maxsize=32)
def kda_chunk_bytes(k_dim: int, v_dim: int, dtype: torch.dtype, kernel: str, chunk: int) -> int:
    """Bytes one ``(row, head, chunk)`` of ``chunk`` tokens keeps for backward in the KDA chunk
    kernel: ``"torch"``: measured, hp-kda-kernels' ``chunk_kda`` run on the CPU over two chunks
    and over one (the difference); ``"fused"``: its inputs and one float32 state."""
    if kernel == "fused":
        return chunk * (3 * k_dim + v_dim + 1) * dtype.itemsize + 4 * k_dim * v_dim
    from hyper_parallel.kda.chunk import chunk_kda
    from hyper_parallel.models.plan.measure import track_activations

    def kept(chunks: int) -> int:
        t = chunks * chunk
        gen = torch.Generator().manual_seed(0)
        q, k = (torch.randn(1, t, 1, k_dim, generator=gen, dtype=dtype) for _ in range(2))
        v = torch.randn(1, t, 1, v_dim, generator=gen, dtype=dtype)
        g = -torch.rand(1, t, 1, k_dim, generator=gen, dtype=dtype)
        beta = torch.rand(1, t, 1, generator=gen, dtype=dtype)
        for x in (q, k, v, g, beta):
            x.requires_grad_(True)
        with track_activations() as trace:
            out, _ = chunk_kda(q, k, v, g, beta, chunk_size=chunk)
            nbytes = trace.live_bytes() - out.numel() * out.element_size()
        return nbytes

    return kept(2) - kept(1)


def _attention_core_bytes(rows: int, heads: int, seq: int, b: int, impl: str) -> int:
    """The float32 log-sum-exps of ``heads`` heads over ``rows × seq`` tokens, and the softmax
    probabilities where the kernel keeps them (eager / sdpa-math)."""
    probs = rows * heads * seq * seq * b if impl in ("eager", "sdpa-math") else 0
    return 4 * rows * heads * seq + probs


def _chunk_kernel_bytes(
    rows: int, local: int, heads: int, k: int, v: int, dtype: torch.dtype, kernel: str
) -> int:
    """What the delta-rule chunk kernel keeps for ``rows × heads`` sequences of ``local``
    tokens: :func:`kda_chunk_bytes` per chunk (hp-kda-kernels' rule: one short chunk below
    ``KDA_CHUNK`` tokens)."""
    chunk = min(KDA_CHUNK, local)
    return rows * heads * -(-local // chunk) * kda_chunk_bytes(k, v, dtype, kernel, chunk)


def _norm_bytes(n: int, d: int, b: int) -> int:
    c = 4 + b if b < 4 else 0
    return n * d * (4 + c) + 4 * n


def layer_bytes(
    shape: LayerShape,
    *,
    rows: int,
    seq: int,
    p: int,
    ep: int,
    b: int,
    dtype: torch.dtype,
    attn_implementation: str,
    kda_kernel: str,
) -> int:
    """Bytes one decoder layer keeps for backward on one rank (module docstring)."""
    g = shape.get
    d = g("D")
    n = rows * seq // p
    out = 2 * _norm_bytes(n, d, b) + 2 * n * d * b
    if shape.attn == "mla":
        h, hl = g("H"), g("H") // p
        dqk = g("nope") + g("rope")
        elems = (
            n * (2 * g("q_lora") + 2 * g("kv_lora") + g("rope"))
            + 4 * n * h * dqk
            + rows * seq * (g("kv_lora") + g("rope"))
            + rows * seq * hl * (g("nope") + 4 * g("dv") + 2 * dqk)
            + n * h * g("dv")
            + 2 * n * d
        )
        out += elems * b + _attention_core_bytes(rows, hl, seq, b, attn_implementation)
    elif shape.attn == "gqa":
        h, hkv, hd = g("H"), g("Hkv"), g("d")
        hl, kvl = h // p, max(1, hkv // p)
        elems = (
            n * (2 * h * hd if g("gated") else h * hd)
            + 2 * n * hkv * hd
            + 2 * n * (h + hkv) * hd
            + rows * seq * (2 * hl + 2 * kvl) * hd
            + n * h * hd * (3 if g("gated") else 1)
        )
        out += elems * b + _attention_core_bytes(rows, hl, seq, b, attn_implementation)
    elif shape.attn == "gdn":
        hk, hv, k, v = g("Hk"), g("Hv"), g("K"), g("V")
        qkv = 2 * hk * k + hv * v
        elems = n * (2 * hk * k + 2 * hv * v + 2 * hv) + 3 * n * qkv + 2 * n * (hk + hv) * k
        out += (elems + 5 * n * hv * v + 23 * n * hv * k) * b + 8 * n * hv + 4 * n * hv * v
        out += 2 * _chunk_kernel_bytes(rows, seq // p, hv, k, v, dtype, kda_kernel)
    else:
        h, k = g("H"), g("K")
        out += (23 * n * h * k + n * (2 * k + 4 * h) + n * d) * b
        out += _chunk_kernel_bytes(rows, seq // p, h, k, k, dtype, kda_kernel)
    if shape.mlp == "dense":
        out += (4 * n * g("I") + n * d) * b
    else:
        r = n * g("k")
        out += 8 * n * g("E") + 12 * n * g("k")
        elems = r * (4 * g("I") + 2 * d) + n * g("k") * d + 2 * n * d + 4 * n * g("Is")
        elems += 2 * n * g("Ig")  # the gated shared expert's gate and its sigmoid
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
) -> Activations:
    """One rank's :class:`Activations` for the layer kinds ``shapes`` (each with its count),
    ``rows`` rows of ``seq`` tokens over ``p = cp·tp`` ranks (module docstring)."""
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"attn_implementation must be one of {ATTN_IMPLEMENTATIONS}, got "
            f"{attn_implementation!r}"
        )
    if kda_kernel not in KDA_KERNELS:
        raise ValueError(f"kda_kernel must be one of {KDA_KERNELS}, got {kda_kernel!r}")
    if seq % p:
        raise ValueError(f"seq_len {seq} is not divisible by cp·tp = {p}")
    b = dtype.itemsize
    d, v = int(config.hidden_size), int(config.vocab_size)
    n = rows * seq // p
    kw = dict(rows=rows, seq=seq, p=p, ep=ep, b=b, dtype=dtype)
    per = [
        (s, layer_bytes(s, attn_implementation=attn_implementation, kda_kernel=kda_kernel, **kw), c)  # type: ignore[arg-type]
        for s, c in shapes
    ]
    c_up = 4 if b < 4 else 0
    head = n * d * b + _norm_bytes(n, d, b) + n * v * (b + 8 + c_up)
    transient = n * v * (4 + b)
    if checkpointing:
        saved = head + sum(c for _, _, c in per) * n * d * b
        # a layer's recompute, and its backward's gradients beside half of it (measured)
        peak = saved + max(3 * max(x for _, x, _ in per) // 2, transient)
    else:
        saved = head + sum(x * c for _, x, c in per)
        peak = saved + transient
    return Activations(peak, saved, per)
