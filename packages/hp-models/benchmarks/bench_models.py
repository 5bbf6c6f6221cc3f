"""A stock Kimi-Linear model (KDA + MLA layers, dense MLPs), one training step (forward,
backward, gradient reduction) on 4 ranks, side by side in one run, interleaved:

- ``hp_models``: ``parallelize_model`` on cp=2 × tp=2: every mixer context-parallel over all
  4 ranks, MLPs TP + SP over tp; each rank holds T/4 tokens;
- ``hf_tp``: the model's own tensor-parallel plan (``config.base_model_tp_plan``: MLP
  projections colwise/rowwise) applied with torch's ``parallelize_module`` over 4 ranks, which
  is what transformers' ``tp_plan="auto"`` does; attention and KDA are not in the plan, so they
  run on the full sequence on every rank;
- ``mixers_over_cp``: the previous composition: mixers context-parallel over cp only, their
  input all-gathered over tp and both tp ranks computing the same mixer (then keeping their
  own block), MLPs TP + SP over tp.

Reported per case: step time (median, slowest rank), peak tensor memory per rank and bytes
moved per rank per step (counted with ``simulated_link`` at zero latency and unbounded
bandwidth, which changes no timing).

    python packages/hp-models/benchmarks/bench_models.py --out bench-results/models.json [--quick]
"""

from __future__ import annotations

from typing import Any

import _kimi  # the shared setup, beside this script
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from hyper_parallel.context_parallel import parallelize_mla
from hyper_parallel.dtensor import all_gather_single, reduce_scatter_single
from hyper_parallel.dtensor.benchmarking import (
    bench_record,
    bytes_per_call,
    interleaved_timing,
    peak_memory_bytes,
    run_ranks,
    summary_line,
    write_records,
)
from hyper_parallel.kda import parallelize_kda
from hyper_parallel.mc2 import MC2GatedMLPParallel
from hyper_parallel.models import parallelize_model, sync_gradients


class _GatherTp(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        send = x.transpose(0, 1).contiguous()
        out = send.new_empty((size * send.shape[0], *send.shape[1:]))
        all_gather_single(out, send, group=group)
        return out.transpose(0, 1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        full = grad.transpose(0, 1).contiguous()
        out = full.new_empty((full.shape[0] // ctx.size, *full.shape[1:]))
        reduce_scatter_single(out, full, group=ctx.group)
        return out.transpose(0, 1), None, None


class _MixerOverCp(nn.Module):
    """The previous composition: gather the tp blocks (the cp chunk), run the cp-parallel
    mixer on it on every tp rank, keep this rank's block of the output."""

    def __init__(self, mixer: nn.Module, tp_group: Any, tp_size: int, tp_rank: int) -> None:
        super().__init__()
        self.mixer, self.group, self.size, self.rank = mixer, tp_group, tp_size, tp_rank

    def forward(self, hidden_states: torch.Tensor, **kwargs: Any) -> Any:
        full = _GatherTp.apply(hidden_states, self.group, self.size)
        out = self.mixer(hidden_states=full, **kwargs)
        y = out[0] if isinstance(out, tuple) else out
        s = hidden_states.shape[1]
        mine = y[:, self.rank * s : (self.rank + 1) * s]
        return (mine, None) if isinstance(out, tuple) else mine


def _mixers_over_cp(model: nn.Module, mesh: Any) -> nn.Module:
    tp = mesh["tp"]
    for layer in model.model.layers:
        attn = layer.self_attn
        if type(attn).__name__ == "KimiLinearDeltaAttention":
            parallelize_kda(attn, mesh["cp"])
        else:
            parallelize_mla(attn, mesh["cp"], strategy="latent", overlap=True)
        layer.self_attn = _MixerOverCp(attn, tp.get_group(), tp.size(), tp.get_local_rank())
        parallelize_module(layer.mlp, tp, MC2GatedMLPParallel())
    return model


def _hf_tp(model: nn.Module, mesh: Any) -> nn.Module:
    plan = {}
    for pattern, style in model.config.base_model_tp_plan.items():
        if (
            pattern.startswith("layers.*.mlp.")
            and pattern.endswith("_proj")
            and pattern.count(".") == 3
        ):
            plan["model." + pattern] = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}[
                style
            ]()
    return parallelize_module(model, mesh, plan)


def _body(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    env = _kimi.setup(cfg)
    device, world, mesh, build = env.device, env.world, env.mesh, env.build
    ws = dist.get_world_size()
    local, full = env.local, env.batch

    ours = parallelize_model(build(), mesh, mla_strategy="latent", overlap=True)
    hf = _hf_tp(build(), world)
    prev = _mixers_over_cp(build(), mesh)

    def ours_step() -> None:
        ours.zero_grad(set_to_none=True)
        ours(**local).loss.backward()
        sync_gradients(ours)

    def hf_step() -> None:
        hf.zero_grad(set_to_none=True)
        hf(**full, use_cache=False).loss.backward()  # same batch on every rank: no reduction

    def prev_step() -> None:
        prev.zero_grad(set_to_none=True)
        inputs = {k: local[k] for k in ("input_ids", "position_ids")}
        no_masks = {"full_attention": None, "linear_attention": None}
        logits = prev(**inputs, attention_mask=no_masks, use_cache=False).logits.float()
        target = local["shift_labels"]
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum")
        (loss / target.numel() / ws).backward()
        for p in prev.parameters():  # the old hand-written reduction, over the whole mesh
            if p.grad is not None and not hasattr(p.grad, "to_local"):
                dist.all_reduce(p.grad)

    cases = {"hp_models": ours_step, "hf_tp": hf_step, "mixers_over_cp": prev_step}
    times = interleaved_timing(cases, repeats=cfg["repeats"], warmup=1, device=device)
    mem = {name: peak_memory_bytes(fn, device) for name, fn in cases.items()}
    moved = {name: bytes_per_call(fn) for name, fn in cases.items()}
    extra = env.extra()
    return [
        bench_record(
            f"models_kimi_step/hp_models_vs_{base}",
            times["hp_models"],
            times[base],
            peak_mem_ours=mem["hp_models"],
            peak_mem_baseline=mem[base],
            device=device.type,
            bytes_ours=moved["hp_models"],
            bytes_baseline=moved[base],
            ours="hp_models",
            baseline=base,
            **extra,
        )
        for base in ("hf_tp", "mixers_over_cp")
    ]


def main(argv: list[str] | None = None) -> None:
    cfg, out = _kimi.config(__doc__, argv, quick=(512, 128, 2), full=(2048, 256, 3))
    records = run_ranks(_body, cfg, world_size=4, timeout=1800.0)
    if records is not None:
        write_records(out, records)
        for record in records:
            print(
                summary_line(record),
                f"bytes/rank {record['bytes_ours']} vs {record['bytes_baseline']}",
            )


if __name__ == "__main__":
    main()
