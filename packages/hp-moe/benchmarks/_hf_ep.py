"""transformers' own expert parallelism (``AllToAllEP``) on ONE stock experts module, as a
baseline for the hp-moe benchmarks.

:func:`hf_all_to_all_ep` applies, to a single ``DeepseekV3Experts`` (or any experts module
built with ``@use_experts_implementation``: 3-D ``gate_up_proj`` / ``down_proj`` and
``num_experts``), exactly what ``from_pretrained(..., distributed_config=DistributedConfig(
ep_size=..., ep_implementation="all_to_all"))`` applies to each ``layers.*.mlp.experts``:
``transformers.distributed.expert_parallel.apply_expert_parallelism`` with the model's
``base_model_ep_plan`` (``grouped_gemm`` on both weights, then ``ep_dispatch_experts`` on the
module), here with the plan rooted at the module itself.

Run this file for the self-check (2 and 4 gloo ranks on the CPU, float32 and float64, uniform,
uneven and skewed routing, forward and every gradient against the serial stock module)::

    python packages/hp-moe/benchmarks/_hf_ep.py

What transformers 5.23 does, read from its code and checked by the self-check:

- Layout. ``MoEParamShard(Shard(0))`` (``grouped_gemm``) turns ``gate_up_proj`` [E, 2I, H] and
  ``down_proj`` [E, H, I] into ``nn.Parameter``s wrapping **DTensors** on the ep mesh with
  placement ``Shard(0)``: rank r holds the contiguous block of experts
  ``[r * E / ep, (r + 1) * E / ep)`` as its local tensor (``distribute_tensor(...,
  src_data_rank=None)``: no communication, each rank keeps its chunk of the full tensor it
  already had, so every rank must have built identical weights). ``E % ep != 0`` raises. The
  local tensor is a copy of the chunk (its own storage, E/ep experts' worth), so the full
  weights are freed once nothing else holds them. It also sets ``experts.num_experts =
  E / ep`` and ``experts._is_expert_parallel = True`` (the grouped_mm / batched_mm forwards
  then mask ids ``>= num_experts`` as sentinels; AllToAllEP never sends any).
- Forward. ``EpDispatchExpertsParallel`` replaces ``experts.forward`` with a closure
  ``forward(hidden_states [N, H], top_k_index [N, K] int64, global expert ids,
  top_k_weights [N, K]) -> [N, H]`` (keyword names as in the stock forward; no other
  arguments; an int32 ``top_k_index`` fails in AllToAllEP's ``scatter_add_``). Each rank
  passes its OWN tokens (``N`` may differ between ranks, and may be 0).
  Inside, the DTensor parameters are swapped for their local tensors for the duration of the
  call (``_use_local_dtensor_params``), and ``AllToAllEP`` runs the module's own class forward
  (whichever ``config._experts_implementation`` names: ``"eager"``, ``"grouped_mm"``,
  ``"batched_mm"``, ...) on the rows it receives, top-1 with unit weights and local expert ids;
  the routing weights are applied on the sender after the return trip.
- Gradients. The weight gradients land on the DTensor parameters as DTensor ``Shard(0)``
  gradients whose local tensor is the owner's experts' full gradient (summed over every rank's
  tokens, since every (token, expert) pair is computed on the expert's owner); there is no
  gradient collective. ``hidden_states.grad`` and ``top_k_weights.grad`` are per rank, for
  that rank's own tokens.
- Cost per forward (tp mesh of size 1): one blocking ``all_to_all_single`` of the per-expert
  counts (an [ep, E/ep] int64 tensor), ONE host sync (``.tolist()`` of the send / receive
  split sizes, read every layer, so no CUDA graph capture), one autograd all-to-all of the
  token rows (``[N*K, H]`` out, the received rows in), the experts on the received rows, one
  autograd all-to-all of the output rows back. Backward: the two all-to-alls reversed (no
  further host sync in the exchange). Counted at the dispatcher (self-check, ep=4): forward
  ``c10d.alltoall_base_`` x1 + ``_c10d_functional.all_to_all_single`` x2, backward
  ``_c10d_functional.all_to_all_single`` x2; no all-reduce / all-gather anywhere. The
  experts' own forward may add syncs: the eager one reads ``nonzero()`` and loops over the
  hit experts in Python; grouped_mm has none. The tokens are sent once per (token, expert)
  pair (``N*K`` rows), not once per (token, rank): a token whose K experts share a rank
  crosses the wire K times.
- tp mesh. ``AllToAllEP`` also takes the mesh of the ranks that hold the same batch
  (transformers' ``tp`` mesh). Here every rank's tokens are its own, so it is a mesh of size 1
  per rank: :func:`self_mesh` (one ``new_subgroups(group_size=1)``, created once per
  process group and cached). With a size-1 tp mesh ``AllToAllEP`` never touches it in the
  forward (it only compares its ranks with the ep mesh's at construction).
- CPU / gloo. All of it runs on gloo. float64 runs with the ``"eager"`` and ``"batched_mm"``
  experts implementations, but not with ``"grouped_mm"`` (transformers' default for a model):
  on CPU torch 2.13 ``transformers.integrations.moe._can_use_grouped_mm`` says yes for every
  dtype and ``torch.nn.functional.grouped_mm`` then raises "Expected mat_a to be Float32,
  BFloat16 or Float16 matrix, got Double". That is the experts' kernel, not the EP: setting
  ``config._experts_implementation = "eager"`` keeps it transformers' own AllToAllEP. A
  standalone ``DeepseekV3Config`` has ``_experts_implementation = None`` (only
  ``PreTrainedModel`` resolves it, to ``"grouped_mm"`` or ``"eager"``), which makes the
  experts warn once and run the eager forward: set it explicitly.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._python_dispatch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["hf_all_to_all_ep", "self_mesh", "tiny_experts"]

_SELF_MESHES: dict[Any, DeviceMesh] = {}


def self_mesh(device_type: str = "cpu") -> DeviceMesh:
    """A 1-D mesh of this rank alone (named ``"tp"``): the tp mesh ``AllToAllEP`` needs when each
    rank's tokens are its own. Collective over the default group the first time (every rank
    creates all world_size one-rank groups, in the same order); cached per default group and
    device type afterwards."""
    key = (dist.distributed_c10d._get_default_group(), device_type)
    if key not in _SELF_MESHES:
        group, _ = dist.new_subgroups(group_size=1)
        _SELF_MESHES[key] = DeviceMesh.from_group(group, device_type, mesh_dim_names=("tp",))
    return _SELF_MESHES[key]


def hf_all_to_all_ep(
    experts: nn.Module, ep_mesh: DeviceMesh, tp_mesh: DeviceMesh | None = None
) -> nn.Module:
    """Apply transformers' ``AllToAllEP`` to ``experts`` in place and return it.

    ``experts``: a stock experts module (e.g. ``DeepseekV3Experts``) holding all E experts,
    built identically (same weights) on every rank of ``ep_mesh``; E must divide by
    ``ep_mesh.size()``. ``ep_mesh``: a 1-D mesh; every rank of it must call this, and with
    ``tp_mesh=None`` every rank of the default group (see :func:`self_mesh`). ``tp_mesh``: the
    ranks that share one batch; default a mesh of this rank alone (each rank's tokens are its
    own).

    Afterwards (see the module docstring for the details):

    - ``experts.gate_up_proj`` / ``experts.down_proj`` are ``nn.Parameter``s wrapping DTensors,
      ``Shard(0)`` on ``ep_mesh``, global shape unchanged; rank r's local tensor is experts
      ``[r*E/ep, (r+1)*E/ep)``. ``experts.num_experts == E // ep``.
    - ``experts(hidden_states [N, H], top_k_index [N, K] int64 global ids, top_k_weights [N, K])``
      returns ``[N, H]`` (hidden's dtype) for this rank's own N tokens; autograd flows to all
      three float inputs' owners and to the local experts (gradients as DTensors, ``Shard(0)``).
    """
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    if ep_mesh.ndim != 1:
        raise ValueError(f"ep_mesh must be 1-D, got {ep_mesh.ndim}-D")
    if tp_mesh is None:
        tp_mesh = self_mesh(ep_mesh.device_type)
    # The model's base_model_ep_plan (DeepseekV3Config, Qwen3-MoE, ...) rooted at the experts:
    # the parameters first (they set num_experts, which the EP implementation reads), then the
    # module's dispatch.
    plan = {"gate_up_proj": "grouped_gemm", "down_proj": "grouped_gemm", "": "ep_dispatch_experts"}
    return apply_expert_parallelism(experts, ep_mesh, tp_mesh, plan, ep_implementation="all_to_all")


def tiny_experts(
    dtype: torch.dtype = torch.float32,
    implementation: str = "grouped_mm",
    *,
    hidden: int = 64,
    intermediate: int = 32,
    num_experts: int = 16,
    top_k: int = 4,
    seed: int = 0,
) -> nn.Module:
    """A stock ``DeepseekV3Experts`` from a tiny ``DeepseekV3Config``, weights drawn from
    ``seed`` (the same on every rank), its experts implementation set explicitly."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

    config = DeepseekV3Config(
        hidden_size=hidden,
        moe_intermediate_size=intermediate,
        n_routed_experts=num_experts,
        num_experts_per_tok=top_k,
        hidden_act="silu",
    )
    config._experts_implementation = implementation
    experts = DeepseekV3Experts(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in experts.parameters():  # created with torch.empty
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return experts.to(dtype)


# --------------------------------------------------------------------------------------------
# self-check


def _batch(
    n_tokens: list[int],
    e: int,
    ep: int,
    k: int,
    h: int,
    dtype: torch.dtype,
    skewed: bool,
    seed: int,
) -> tuple[torch.Tensor, ...]:
    """Every rank's tokens, concatenated: hidden, top_k_index (global ids), top_k_weights, and
    the output's cotangent. ``skewed``: every token picks among rank 0's experts only."""
    g = torch.Generator().manual_seed(seed)
    n = sum(n_tokens)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64).to(dtype)
    pool = e // ep if skewed else e
    index = torch.rand(n, pool, generator=g).topk(k, dim=-1).indices  # distinct experts
    weights = torch.randn(n, k, generator=g, dtype=torch.float64).softmax(-1).to(dtype)
    cotangent = torch.randn(n, h, generator=g, dtype=torch.float64).to(dtype)
    return hidden, index, weights, cotangent


class _CollectiveCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the c10d ops (functional or not) that reach the dispatcher."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if "c10d" in name:
            self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _check_rank(
    dtype_name: str, implementation: str, skewed: bool, n_tokens: list[int]
) -> dict[str, Any]:
    """One rank of one self-check case: max abs errors against the serial stock module."""
    from torch.distributed.tensor import DTensor, Shard

    dtype = getattr(torch, dtype_name)
    rank, ep = dist.get_rank(), dist.get_world_size()
    e, k, h = 16, 4, 64
    mesh = DeviceMesh("cpu", torch.arange(ep), mesh_dim_names=("ep",))
    experts = tiny_experts(dtype, implementation, hidden=h, num_experts=e, top_k=k)
    reference = copy.deepcopy(experts)
    reference.config = copy.deepcopy(experts.config)
    reference.config._experts_implementation = "eager"  # the stock per-expert loop
    full = {name: p.detach().clone() for name, p in experts.named_parameters()}

    hidden, index, weights, cotangent = _batch(n_tokens, e, ep, k, h, dtype, skewed, seed=1)
    ref_h = hidden.clone().requires_grad_()
    ref_w = weights.clone().requires_grad_()
    ref_out = reference(ref_h, index, ref_w)
    (ref_out * cotangent).sum().backward()

    hf_all_to_all_ep(experts, mesh)
    per = e // ep
    mine = slice(rank * per, (rank + 1) * per)
    layout_ok = experts.num_experts == per
    for name, p in experts.named_parameters():
        layout_ok &= isinstance(p, DTensor) and tuple(p.placements) == (Shard(0),)
        layout_ok &= tuple(p.shape) == tuple(full[name].shape)
        layout_ok &= torch.equal(p.to_local(), full[name][mine])
        layout_ok &= p.to_local().untyped_storage().nbytes() == p.to_local().nbytes  # a copy

    start = sum(n_tokens[:rank])
    rows = slice(start, start + n_tokens[rank])
    h_in = hidden[rows].clone().requires_grad_()
    w_in = weights[rows].clone().requires_grad_()
    with _CollectiveCounter() as fwd_ops:
        out = experts(h_in, index[rows], w_in)
    with _CollectiveCounter() as bwd_ops:
        (out * cotangent[rows]).sum().backward()

    def err(a: torch.Tensor, b: torch.Tensor) -> float:
        return (a - b).abs().max().item() if a.numel() else 0.0

    errors = {
        "out": err(out, ref_out[rows]),
        "d_hidden": err(h_in.grad, ref_h.grad[rows]),
        "d_weights": err(w_in.grad, ref_w.grad[rows]),
    }
    for name, p in experts.named_parameters():
        assert isinstance(p.grad, DTensor) and tuple(p.grad.placements) == (Shard(0),)
        ref_grad = dict(reference.named_parameters())[name].grad[mine]
        errors[f"d_{name}"] = err(p.grad.to_local(), ref_grad)
    scale = max(ref_out.abs().max().item(), ref_h.grad.abs().max().item(), 1.0)
    return {
        "errors": errors,
        "scale": scale,
        "layout_ok": bool(layout_ok),
        "out_dtype": str(out.dtype),
        "fwd_ops": fwd_ops.ops,
        "bwd_ops": bwd_ops.ops,
    }


def _self_check() -> int:
    from hyper_parallel.dtensor.testing import run_distributed

    tolerance = {"float32": 2e-5, "float64": 1e-12}
    cases = []
    for ep in (2, 4):
        for dtype_name, impl in (
            ("float32", "grouped_mm"),
            ("float32", "eager"),
            ("float64", "eager"),
            ("float64", "batched_mm"),
        ):
            cases.append((ep, dtype_name, impl, False, [8] * ep))
        uneven = [5 + 3 * r for r in range(ep)]
        uneven[-1] = 0  # a rank with no tokens of its own
        cases.append((ep, "float32", "grouped_mm", False, uneven))
        cases.append((ep, "float32", "grouped_mm", True, [8] * ep))
        cases.append((ep, "float64", "eager", True, uneven))
    failed = 0
    for ep, dtype_name, impl, skewed, n_tokens in cases:
        results = run_distributed(_check_rank, ep, dtype_name, impl, skewed, n_tokens, timeout=120)
        worst: dict[str, float] = {}
        for r in results:
            for name, v in r["errors"].items():
                worst[name] = max(worst.get(name, 0.0), v / r["scale"])
        ok = all(r["layout_ok"] for r in results) and all(
            v <= tolerance[dtype_name] for v in worst.values()
        )
        failed += not ok
        routing = "skewed" if skewed else "uniform"
        print(
            f"{'ok  ' if ok else 'FAIL'} ep={ep} {dtype_name:7s} {impl:10s} {routing:7s} "
            f"tokens={n_tokens}: max rel err "
            + " ".join(f"{name}={v:.1e}" for name, v in worst.items())
        )
        if ep == 4 and not skewed and impl == "grouped_mm" and n_tokens == [8] * ep:
            print(f"     rank 0 c10d ops: forward {results[0]['fwd_ops']}")
            print(f"                      backward {results[0]['bwd_ops']}")
    print("self-check", "FAILED" if failed else "passed", f"({len(cases) - failed}/{len(cases)})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(_self_check())
