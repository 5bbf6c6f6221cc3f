"""A small Kimi-Linear-style hybrid stack built from plain PyTorch modules, and the function
that parallelises it from outside with all four layers of this repository.

Serial model (no communication anywhere in it):

- ``KDAMixer``: KDA token mixing (q, k, v, g, beta projections, the gated delta-rule recurrence
  through ``hyper_parallel.kda.chunk_kda``, output projection);
- ``MultiHeadLatentAttention`` from ``hyper_parallel.context_parallel`` (DeepSeek MLA);
- ``SiluMLP``: up / SiLU / down;
- each of them inside a ``Residual`` (pre-RMSNorm + residual add); ``HybridStack`` is a list of
  residual layers and a final norm, ``HybridLM`` adds an embedding and an LM head.

``parallelize_hybrid(model, mesh)`` takes a 2-D mesh with dims ``("tp", "cp")`` (for example
``unflatten(init_device_mesh("cpu", (4,), mesh_dim_names=("world",)), "world", (2, 2),
("tp", "cp"))``) and rewrites the model in place:

- MLPs: ``MC2ColwiseParallel`` / ``MC2RowwiseParallel`` (hp-mc2) over ``tp``, sequence dim 1;
- MLA: ``parallelize_mla`` (hp-context-parallel) over ``cp``;
- KDA: ``kda_context_parallel`` (hp-kda-kernels) over ``cp``.

Sequence layout. ``cp`` splits the sequence into ``cp`` contiguous chunks (rank with cp
coordinate ``c`` holds chunk ``c``); sequence parallelism over ``tp`` splits each chunk again,
so the rank with coordinates ``(t, c)`` holds the contiguous block ``c * tp + t`` of ``tp * cp``
equal blocks (:func:`token_block`). The residual stream, the norms and the MLPs work on that
block directly (the MC2 column layer all-gathers the chunk over ``tp`` and the row layer
reduce-scatters it back). A token mixer needs the whole chunk of its cp rank: the input is
all-gathered over ``tp`` (backward: reduce-scatter, sum), both tp ranks run the cp-parallel
mixer on the chunk, and each keeps its own block of the output. Parameters of the mixers, the
norms and the embeddings stay replicated; their gradients on each rank are partial sums and
:func:`sync_gradients` adds them up over the whole mesh. MC2 weights are ``DTensor`` shards
over ``tp``; their local gradients are partial over ``cp`` and are summed over ``cp``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor.parallel import parallelize_module

from hyper_parallel.context_parallel import MLAConfig, MultiHeadLatentAttention, parallelize_mla
from hyper_parallel.dtensor import DeviceMesh, DTensor, flatten
from hyper_parallel.kda import chunk_kda, kda_context_parallel
from hyper_parallel.mc2 import MC2ColwiseParallel, MC2RowwiseParallel

__all__ = [
    "HybridConfig",
    "HybridLM",
    "HybridStack",
    "KDAMixer",
    "Residual",
    "RMSNorm",
    "SiluMLP",
    "full_gradients",
    "parallelize_hybrid",
    "shard_tokens",
    "sync_gradients",
    "token_block",
]

LAYER_KINDS = ("kda", "mla", "mlp")

# torch >= 2.11 names them *_single; older versions only have the *_tensor spellings
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class HybridConfig:
    hidden: int = 64
    ffn: int = 128
    layers: tuple[str, ...] = ("kda", "mlp", "mla", "mlp")
    kda_heads: int = 4
    kda_head_dim: int = 16
    kda_chunk_size: int = 16
    mla_heads: int = 4
    q_lora_rank: int | None = None
    kv_lora_rank: int = 16
    qk_nope_head_dim: int = 8
    qk_rope_head_dim: int = 8
    v_head_dim: int = 8
    vocab: int = 64

    def __post_init__(self) -> None:
        bad = [k for k in self.layers if k not in LAYER_KINDS]
        if bad or not self.layers:
            raise ValueError(f"layers must be a non-empty sequence of {LAYER_KINDS}, got {bad}")

    def mla_config(self) -> MLAConfig:
        return MLAConfig(
            hidden_size=self.hidden,
            num_heads=self.mla_heads,
            q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class SiluMLP(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, ffn)
        self.down = nn.Linear(ffn, hidden)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.up(x)))


class KDAMixer(nn.Module):
    """KDA token mixing: ``x [B, S, D] -> [B, S, D]`` (causal, recurrent state per head).

    q and k are L2-normalised per head, the per-channel decay is ``logsigmoid(g_proj x) / 16``
    (log space) and ``beta = sigmoid(b_proj x)``, as in Kimi-Linear. Serial: ``chunk_kda``.
    After :meth:`context_parallel` the recurrence runs through ``kda_context_parallel`` over a
    1-D cp mesh and ``forward`` takes this rank's contiguous chunk of the sequence.
    """

    def __init__(self, hidden: int, heads: int, head_dim: int, chunk_size: int = 64) -> None:
        super().__init__()
        self.heads, self.head_dim, self.chunk_size = heads, head_dim, chunk_size
        width = heads * head_dim
        self.q_proj = nn.Linear(hidden, width, bias=False)
        self.k_proj = nn.Linear(hidden, width, bias=False)
        self.v_proj = nn.Linear(hidden, width, bias=False)
        self.g_proj = nn.Linear(hidden, width)
        self.b_proj = nn.Linear(hidden, heads)
        self.o_proj = nn.Linear(width, hidden, bias=False)
        self.cp_mesh: DeviceMesh | None = None
        self.protocol = "auto"

    def context_parallel(self, cp_mesh: DeviceMesh, protocol: str = "auto") -> KDAMixer:
        if cp_mesh.ndim != 1:
            raise ValueError(f"KDA context parallelism needs a 1-D mesh, got {cp_mesh.ndim}-D")
        self.cp_mesh, self.protocol = cp_mesh, protocol
        return self

    def forward(self, x: Tensor) -> Tensor:
        B, S, _ = x.shape
        shape = (B, S, self.heads, self.head_dim)
        q = F.normalize(self.q_proj(x).view(shape), dim=-1)
        k = F.normalize(self.k_proj(x).view(shape), dim=-1)
        v = self.v_proj(x).view(shape)
        g = F.logsigmoid(self.g_proj(x).view(shape)) / 16.0
        beta = torch.sigmoid(self.b_proj(x))
        if self.cp_mesh is None:
            o, _ = chunk_kda(q, k, v, g, beta, chunk_size=self.chunk_size)
        else:
            o, _ = kda_context_parallel(
                q, k, v, g, beta, self.cp_mesh, protocol=self.protocol, chunk_size=self.chunk_size
            )
        return self.o_proj(o.reshape(B, S, -1))


class Residual(nn.Module):
    """``x + inner(norm(x))``; ``kind`` is one of ``kda``, ``mla``, ``mlp``."""

    def __init__(self, kind: str, inner: nn.Module, hidden: int) -> None:
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(hidden)
        self.inner = inner

    def forward(self, x: Tensor) -> Tensor:
        return x + self.inner(self.norm(x))


def _make_inner(kind: str, c: HybridConfig) -> nn.Module:
    if kind == "kda":
        return KDAMixer(c.hidden, c.kda_heads, c.kda_head_dim, c.kda_chunk_size)
    if kind == "mla":
        return MultiHeadLatentAttention(c.mla_config())
    return SiluMLP(c.hidden, c.ffn)


class HybridStack(nn.Module):
    """``[B, S, D] -> [B, S, D]``: the residual layers of ``config.layers`` and a final norm."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(
            Residual(kind, _make_inner(kind, config), config.hidden) for kind in config.layers
        )
        self.norm = RMSNorm(config.hidden)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class HybridLM(nn.Module):
    """Token ids ``[B, S] -> logits [B, S, vocab]`` (embedding, :class:`HybridStack`, head)."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(config.vocab, config.hidden)
        self.stack = HybridStack(config)
        self.head = nn.Linear(config.hidden, config.vocab, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.stack(self.embed(tokens)))


# ---- parallel glue ----------------------------------------------------------------------
def _mesh_dims(mesh: DeviceMesh) -> tuple[int, int]:
    names = mesh.mesh_dim_names
    if mesh.ndim != 2 or names is None or tuple(names) != ("tp", "cp"):
        raise ValueError(f"expected a 2-D mesh with dims ('tp', 'cp'), got dims {names}")
    return int(mesh.size(0)), int(mesh.size(1))


def token_block(mesh: DeviceMesh) -> tuple[int, int]:
    """``(index, count)``: this rank holds contiguous block ``index`` of ``count`` equal blocks
    of the sequence (``index = cp_coord * tp + tp_coord``)."""
    tp, cp = _mesh_dims(mesh)
    t, c = mesh.get_local_rank("tp"), mesh.get_local_rank("cp")
    return c * tp + t, tp * cp


def shard_tokens(x: Tensor, mesh: DeviceMesh, dim: int = 1) -> Tensor:
    """This rank's block of a full-sequence tensor (see :func:`token_block`)."""
    index, count = token_block(mesh)
    if x.size(dim) % count:
        raise ValueError(f"sequence length {x.size(dim)} is not divisible by tp * cp = {count}")
    return x.chunk(count, dim)[index]


class _GatherSeq(torch.autograd.Function):
    """All-gather ``[B, s, D]`` along dim 1 over a group (rank order); backward: reduce-scatter
    (sum) of the gradient, so every rank gets its block's gradient summed over the group."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, size: int) -> Tensor:  # type: ignore[override]
        ctx.group, ctx.size = group, size
        xs = x.transpose(0, 1).contiguous()  # [s, B, D]: each rank's block is contiguous
        out = xs.new_empty((size * xs.shape[0], *xs.shape[1:]))
        _all_gather(out, xs, group=group)
        return out.transpose(0, 1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:  # type: ignore[override]
        gs = grad.transpose(0, 1).contiguous()
        out = gs.new_empty((gs.shape[0] // ctx.size, *gs.shape[1:]))
        _reduce_scatter(out, gs, op=dist.ReduceOp.SUM, group=ctx.group)
        return out.transpose(0, 1), None, None


def _install_tp_glue(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Make a cp-parallel mixer take and return this rank's tp block of its cp chunk."""
    group, size, index = tp_mesh.get_group(), int(tp_mesh.size()), tp_mesh.get_local_rank()

    def gather(_mod: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (_GatherSeq.apply(args[0], group, size), *args[1:])

    def keep_block(_mod: nn.Module, _args: tuple[Any, ...], out: Tensor) -> Tensor:
        return out.chunk(size, dim=1)[index]

    module.register_forward_pre_hook(gather)
    module.register_forward_hook(keep_block)


def parallelize_hybrid(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    mla_strategy: str = "expanded",
    mla_overlap: bool = True,
    kda_protocol: str = "auto",
    mc2_chunks: int | None = None,
) -> nn.Module:
    """Parallelise every :class:`Residual` of ``model`` in place on the 2-D ``("tp", "cp")``
    mesh (see the module docstring); afterwards the model takes this rank's token block
    (:func:`shard_tokens`) and returns the same block of the serial output."""
    tp, cp = _mesh_dims(mesh)
    residuals = [m for m in model.modules() if isinstance(m, Residual)]
    for layer in residuals:  # validate everything before touching anything
        inner = layer.inner
        if layer.kind == "mlp" and (inner.up.out_features % tp or inner.down.out_features % tp):
            raise ValueError(f"MLP sizes must be divisible by tp={tp}")
        if layer.kind == "mla" and inner.config.num_heads % cp:
            raise ValueError(f"MLA heads {inner.config.num_heads} not divisible by cp={cp}")
    tp_mesh, cp_mesh = mesh["tp"], mesh["cp"]
    for layer in residuals:
        inner = layer.inner
        if layer.kind == "mlp":
            if tp > 1:
                parallelize_module(
                    inner,
                    tp_mesh,
                    {
                        "up": MC2ColwiseParallel(sequence_dim=1, chunks=mc2_chunks),
                        "down": MC2RowwiseParallel(sequence_dim=1, chunks=mc2_chunks),
                    },
                )
            continue
        if cp > 1:
            if layer.kind == "mla":
                parallelize_mla(inner, cp_mesh, strategy=mla_strategy, overlap=mla_overlap)
            else:
                inner.context_parallel(cp_mesh, kda_protocol)
        if tp > 1:
            _install_tp_glue(inner, tp_mesh)
    return model


def sync_gradients(model: nn.Module, mesh: DeviceMesh) -> None:
    """Sum the partial gradients: replicated parameters over the whole mesh, MC2 ``DTensor``
    shards (already complete over ``tp``) over ``cp``."""
    _mesh_dims(mesh)
    world_group = flatten(mesh).get_group()
    cp_group = mesh.get_group("cp")
    for p in model.parameters():
        if p.grad is None:
            continue
        if isinstance(p.grad, DTensor):
            if mesh.size(1) > 1:
                dist.all_reduce(p.grad._local_tensor, group=cp_group)
        else:
            dist.all_reduce(p.grad, group=world_group)


def full_gradients(model: nn.Module) -> dict[str, Tensor]:
    """``{name: full gradient}`` on CPU (``DTensor`` shards gathered: collective over tp)."""
    out: dict[str, Tensor] = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            g = g.full_tensor()
        out[name] = g.detach().cpu()
    return out
