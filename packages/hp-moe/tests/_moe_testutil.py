"""Shared helpers of the hp-moe tests: stock experts modules, seeded routings, and the serial
reference (the stock module with every expert, run on the tokens of every rank)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hyper_parallel.dtensor import init_device_mesh

TIMEOUT = 120.0
H, I, E, K = 16, 8, 8, 2  # hidden, expert intermediate, experts, experts per token
FAMILIES = ("deepseek", "kimi", "qwen3-next")


def stock_config(family: str = "deepseek", experts: int = E) -> tuple[Any, Any, Any]:
    """A tiny transformers config of ``family`` (``deepseek``, ``kimi``, ``qwen3-next``) with
    ``experts`` routed experts, top-``K`` routing and one shared expert, run by the eager
    experts implementation (the only one with float64 on CPU); with its experts and MoE block
    classes."""
    if family == "deepseek":
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as mod

        cfg: Any = DeepseekV3Config(
            hidden_size=H, moe_intermediate_size=I, n_routed_experts=experts, hidden_act="silu",
            num_experts_per_tok=K, n_group=2, topk_group=1, n_shared_experts=1,
        )  # fmt: skip
        classes = (mod.DeepseekV3Experts, mod.DeepseekV3MoE)
    elif family == "kimi":
        from transformers import KimiLinearConfig
        from transformers.models.kimi_linear import modeling_kimi_linear as mod

        cfg = KimiLinearConfig(
            hidden_size=H, moe_intermediate_size=I, num_experts=experts, hidden_act="silu",
            num_experts_per_tok=K, n_group=2, topk_group=1, num_shared_experts=1,
        )  # fmt: skip
        classes = (mod.KimiLinearExperts, mod.KimiLinearMoE)
    elif family == "qwen3-next":
        from transformers import Qwen3NextConfig
        from transformers.models.qwen3_next import modeling_qwen3_next as mod

        cfg = Qwen3NextConfig(
            hidden_size=H, moe_intermediate_size=I, num_experts=experts, hidden_act="silu",
            num_experts_per_tok=K, shared_expert_intermediate_size=12,
        )  # fmt: skip
        classes = (mod.Qwen3NextExperts, mod.Qwen3NextSparseMoeBlock)
    else:
        raise ValueError(family)
    cfg._experts_implementation = "eager"
    return cfg, classes[0], classes[1]


def _seeded(module: nn.Module, dtype: torch.dtype, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3)
    return module.to(dtype)


def stock_experts(
    family: str = "deepseek", experts: int = E, dtype: torch.dtype = torch.float64, seed: int = 0
) -> nn.Module:
    """A stock transformers experts module with seeded weights (the same on every rank)."""
    cfg, cls, _ = stock_config(family, experts)
    return _seeded(cls(cfg), dtype, seed)


def stock_block(
    family: str = "deepseek", experts: int = E, dtype: torch.dtype = torch.float64, seed: int = 0
) -> nn.Module:
    """A stock transformers MoE block (router, experts, shared expert) with seeded weights (the
    same on every rank): ``DeepseekV3MoE``, ``KimiLinearMoE``, ``Qwen3NextSparseMoeBlock``."""
    cfg, _, cls = stock_config(family, experts)
    return _seeded(cls(cfg), dtype, seed)


def routing(
    rank: int, n: int, experts: int = E, k: int = K, *, only: list[int] | None = None, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens: ``hidden [n, H]`` float64, ``top_k_index [n, k]`` (distinct
    experts per token, from ``only`` if given), ``top_k_weights [n, k]``."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    hidden = torch.randn(n, H, generator=g, dtype=torch.float64)
    pool = torch.tensor(only if only is not None else list(range(experts)))
    rows = [pool[torch.randperm(len(pool), generator=g)[:k]] for _ in range(n)]
    idx = (torch.stack(rows) if rows else torch.zeros(0, k)).reshape(n, k).to(torch.int64)
    weights = torch.rand(n, k, generator=g, dtype=torch.float64)
    return hidden, idx, weights


def ep_mesh(size: int | None = None, groups: int = 1) -> Any:
    """A 1-D ep mesh over this rank's block of ``size`` consecutive ranks (``groups`` of them
    in the world)."""
    world = dist.get_world_size()
    size = size or world
    if groups == 1 and size == world:
        return init_device_mesh("cpu", (size,), mesh_dim_names=("ep",))
    mesh = init_device_mesh("cpu", (world // size, size), mesh_dim_names=("edp", "ep"))
    return mesh["ep"]


def serial_reference(
    module: nn.Module,
    inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    grads: list[torch.Tensor],
) -> dict[str, Any]:
    """The stock module (a copy, every expert) on the concatenated tokens of every rank:
    outputs per rank, input and routing-weight gradients per rank, weight gradients."""
    ref = copy.deepcopy(module)
    hs = [h.clone().requires_grad_(True) for h, _, _ in inputs]
    ws = [w.clone().requires_grad_(True) for _, _, w in inputs]
    out = ref(torch.cat(hs), torch.cat([i for _, i, _ in inputs]), torch.cat(ws))
    out.backward(torch.cat(grads))
    sizes = [h.shape[0] for h in hs]
    return {
        "out": list(out.detach().split(sizes)),
        "dh": [h.grad for h in hs],
        "dw": [w.grad for w in ws],
        "gate_up_proj": ref.gate_up_proj.grad,
        "down_proj": ref.down_proj.grad,
    }


def local_grad(p: torch.Tensor) -> torch.Tensor:
    g = p.grad
    return g.to_local() if hasattr(g, "to_local") else g


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-10) -> None:
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)
