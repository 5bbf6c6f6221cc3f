"""A whole stock DeepSeek-V3 MoE model, one full training step (forward, backward,
``sync_gradients``, AdamW step) on 4 ranks, six configurations side by side in one run,
interleaved, median of the repetitions:

- ``hp_ep4``: ``parallelize_model(model, mesh, ep=4)``: every MoE layer's routed experts split
  over the 4 ranks (hp-moe, E/4 a rank), the rest as at ep = 1;
- ``hp_ep1``: ``parallelize_model(model, mesh, ep=1)``: the same, every expert whole on every
  rank (each rank runs its own tokens through its own copy), expert gradients all-reduced over
  all 4 ranks with the other whole parameters;
- ``hp_fb_ep4``: ``pipeline_model(model, mesh, microbatches=2, ep=4,
  overlap="forward_backward")`` at pp = 1 on the same mesh: the global batch in two
  micro-batches of one row, micro-batch 1's forward interleaved with micro-batch 0's backward
  at their exchanges, each layer's own overlap kept; its step is ``pm.step`` on the global
  batch, then ``sync_gradients`` and AdamW like the others. Its bytes are counted by
  the dispatcher-level counter like the others (a dispatch mode: the interleaved sides run
  under the caller's dispatch modes), ``simulated_link``'s count beside it;
- ``hp_mb2_ep4``: the same two micro-batches without the interleaving
  (``pipeline_model(..., microbatches=2, ep=4)``, torch's 1F1B over one stage: F0 B0 F1 B1,
  each layer's own overlap kept): what the micro-batching itself costs, apart from the
  interleaving;
- ``hf_ep4_mb2``: ``hf_ep4`` with the same two micro-batches by gradient accumulation (two
  forwards and backwards of one row, each loss halved): the baseline for the micro-batched
  steps;
- ``hf_ep4``: ``hp_ep1`` with every ``model.model.layers[i].mlp.experts`` then handed to
  transformers 5.23's own ``AllToAllEP`` over the same 4 ranks (``_hf_ep.hf_all_to_all_ep``
  from hp-moe's benchmarks: what the model's ``base_model_ep_plan`` entry
  ``"layers.*.mlp.experts": "ep_dispatch_experts"`` applies, with the ``grouped_gemm``
  ``Shard(0)`` layout of both weights). Its expert weights are DTensors whose gradients are
  already the full sums (every (token, expert) pair runs on the expert's owner), so they must
  NOT be summed again: ``sync_gradients`` would put them in its world bucket (it knows only
  hp-moe's split experts) and add four different ranks' experts together. The step therefore
  sets those gradients aside around ``sync_gradients`` (no rank then flags them, so no bucket
  holds them) and puts them back for the optimizer. hp-models' per-expert counting pre-hook
  (installed at every ep) stays on the module and still sees the global ids; it does not
  conflict.

Model: ``tiny_model("deepseek")`` in float32, hidden 128, 4 layers (``first_k_dense_replace=1``:
one dense MLP layer, 3 MoE layers), E = 16 routed experts, top-4, one shared expert; mesh
(cp, tp) = (2, 2), batch B = ``--bsz`` rows (default 2, for every configuration: the
micro-batched one needs B divisible by its 2 micro-batches; records before 2026-12-06 used
B = 1) of ``seq`` tokens (each rank holds seq/4 of each row). ``grad_reduction=
"allreduce"`` for all three: the one reduction the transformers configuration can use as
is (under the FSDP2 default its experts, DTensors on their own ep mesh after the swap, would
sit inside blocks FSDP2 already wrapped; not attempted). Every experts module runs the
implementation transformers resolves for a float32 model on this CPU (``"grouped_mm"``): the
ep = 1 copy and ``AllToAllEP``'s local experts; hp-moe runs its own local backend.

Reported per configuration: step time (median over repetitions of the slowest rank), peak
tensor memory of a step per rank (hp-dtensor's ``peak_memory_bytes``, max over ranks),
expert parameter bytes per rank (local shards), and bytes moved per rank per step counted at
the dispatcher for every c10d and functional collective (transformers' row exchanges go
through ``_c10d_functional``) with hp-dtensor's ``comm.link_bytes`` rule, max over ranks; for
the hp-models configurations also ``simulated_link``'s count (zero latency, unbounded
bandwidth) as a cross-check.

``--model qwen3-next``: the same configurations on a stock Qwen3-Next (records
``models_qwen3_next_moe_step/*``): float32, hidden 128, 4 layers in the family's pattern
(Gated DeltaNet, Gated DeltaNet, Gated DeltaNet, gated attention with 4 query and 2 key/value
heads), the first an MLP-only layer (``mlp_only_layers=[0]``), the other three MoE blocks of
16 experts, top-4, with the gated shared expert; the main job's mesh (cp, tp) = (2, 2).

    python packages/hp-models/benchmarks/bench_moe_model.py --out f.json [--quick]
    python packages/hp-models/benchmarks/bench_moe_model.py --model qwen3-next --out f.json
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from hyper_parallel.dtensor import init_device_mesh, unflatten
from hyper_parallel.dtensor.benchmarking import (
    bench_arguments,
    bench_record,
    bytes_per_call,
    interleaved_timing,
    max_over_ranks,
    peak_memory_bytes,
    run_ranks,
    summary_line,
    write_records,
)
from hyper_parallel.dtensor.comm import all_to_all_v_bytes, link_bytes
from hyper_parallel.models import parallelize_model, pipeline_model, shard_batch, sync_gradients
from hyper_parallel.models.testing import random_batch, tiny_model

# transformers' AllToAllEP on one experts module lives with hp-moe's benchmarks
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "hp-moe" / "benchmarks"))
import _hf_ep

PREFIXES = {"deepseek-v3": "models_deepseek_moe_step", "qwen3-next": "models_qwen3_next_moe_step"}
WORLD = 4
VOCAB = 512
EXPERTS_IMPL = "grouped_mm"


# ---- bytes over the link, counted at the dispatcher --------------------------------------------
def _group(g: Any) -> tuple[int, int]:
    if isinstance(g, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        g = _resolve_process_group(g)
    elif not isinstance(g, dist.ProcessGroup):
        g = dist.ProcessGroup.unbox(g)
    return int(g.size()), int(g.rank())


def _nb(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _a2a_bytes(inp: torch.Tensor, in_splits: Any, group: Any) -> int:
    size, rank = _group(group)
    if in_splits and size > 1 and inp.dim() and inp.shape[0]:
        return all_to_all_v_bytes(_nb(inp) // inp.shape[0], [int(n) for n in in_splits], rank)
    return link_bytes("all_to_all", _nb(inp), size)


class _DispatchBytes(TorchDispatchMode):
    """Bytes this rank moves over its link for every collective reaching the dispatcher."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.by_op: dict[str, int] = {}

    def _count(self, name: str, a: tuple[Any, ...]) -> int:
        if name == "c10d.alltoall_base_":  # (out, in, pg, out_splits, in_splits, ...)
            return _a2a_bytes(a[1], a[4], a[2])
        if name.endswith("all_to_all_single") and "_c10d_functional" in name:
            return _a2a_bytes(a[0], a[2], a[3])  # (in, out_splits, in_splits, group)
        if name == "c10d._allgather_base_":
            return link_bytes("all_gather", _nb(a[0]), _group(a[2])[0])
        if name == "c10d.allgather_":
            return link_bytes("all_gather", sum(map(_nb, a[0][0])), _group(a[2])[0])
        if name == "_c10d_functional.all_gather_into_tensor":
            return link_bytes("all_gather", _nb(a[0]) * int(a[1]), int(a[1]))
        if name == "c10d.allreduce_":
            return link_bytes("all_reduce", sum(map(_nb, a[0])), _group(a[1])[0])
        if name == "_c10d_functional.all_reduce":
            return link_bytes("all_reduce", _nb(a[0]), _group(a[2])[0])
        if name in ("c10d.reduce_scatter_tensor_coll_", "c10d._reduce_scatter_base_"):
            return link_bytes("reduce_scatter", _nb(a[1]), _group(a[2])[0])
        if name == "_c10d_functional.reduce_scatter_tensor":
            return link_bytes("reduce_scatter", _nb(a[0]), int(a[2]))
        if name in ("c10d.send", "c10d.recv_"):
            return sum(map(_nb, a[0])) if name == "c10d.send" else 0
        return 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = str(func.overloadpacket)
        if "c10d" in name:
            n = self._count(name, tuple(args))
            if n:
                self.bytes += n
                self.by_op[name] = self.by_op.get(name, 0) + n
        return func(*args, **(kwargs or {}))


# ---- the models and the step -------------------------------------------------------------------
def _build(cfg: dict[str, Any], device: torch.device) -> nn.Module:
    h = cfg["hidden"]
    if cfg["model"] == "qwen3-next":
        kind, shape = (
            "qwen3-next",
            {
                "shared_expert_intermediate_size": h,
                "num_key_value_heads": 2,
                "head_dim": 32,
                "linear_num_key_heads": 2,
                "linear_num_value_heads": 4,
                "linear_key_head_dim": 32,
                "linear_value_head_dim": 32,
                "layer_types": ["linear_attention"] * 3 + ["full_attention"],
                "mlp_only_layers": [0],
                "num_experts": cfg["experts"],
            },
        )
    else:
        kind, shape = (
            "deepseek",
            {
                "num_key_value_heads": 4,
                "kv_lora_rank": 32,
                "q_lora_rank": 48,
                "qk_rope_head_dim": 16,
                "qk_nope_head_dim": 32,
                "v_head_dim": 32,
                "num_hidden_layers": 4,
                "first_k_dense_replace": 1,
                "n_routed_experts": cfg["experts"],
            },
        )
    model = tiny_model(
        kind,
        seed=0,
        dtype=torch.float32,
        vocab_size=VOCAB,
        hidden_size=h,
        intermediate_size=2 * h,
        moe_intermediate_size=h // 2,
        num_attention_heads=4,
        num_experts_per_tok=cfg["top_k"],
        **shape,
    )
    model.config._experts_implementation = EXPERTS_IMPL  # shared by every experts module
    return model.to(device)


def _experts(model: nn.Module) -> list[nn.Module]:
    return [layer.mlp.experts for layer in model.model.layers if hasattr(layer.mlp, "experts")]


def _expert_param_bytes(model: nn.Module) -> int:
    total = 0
    for experts in _experts(model):
        for p in experts.parameters():
            total += _nb(p.to_local() if hasattr(p, "to_local") else p)
    return total


class _Case:
    """One configuration: its model, optimizer and step."""

    def __init__(self, model: nn.Module, local: dict[str, torch.Tensor], hf: bool) -> None:
        self.model, self.local, self.hf = model, local, hf
        self.hf_params = [p for e in _experts(model) for p in e.parameters()] if hf else []
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)

    def grads(self) -> None:
        """Forward, backward and ``sync_gradients``: every gradient the serial one."""
        self.opt.zero_grad(set_to_none=True)
        self.backward()
        # transformers' EP gradients are complete on their owner: keep them out of the sum
        kept = [p.grad for p in self.hf_params]
        for p in self.hf_params:
            p.grad = None
        sync_gradients(self.model)
        for p, g in zip(self.hf_params, kept):
            p.grad = g

    def backward(self) -> None:
        self.model(**self.local).loss.backward()

    def __call__(self) -> None:
        self.grads()
        self.opt.step()

    def loss(self) -> float:
        with torch.no_grad():
            return float(self.model(**self.local).loss)


class _AccumCase(_Case):
    """``hf_ep4`` over two micro-batches of one row: gradient accumulation as a user of
    transformers' ``AllToAllEP`` would run it (two forwards and backwards, each loss halved:
    equal micro-batches, so the mean over the global batch), then ``sync_gradients``."""

    def backward(self) -> None:
        rows = next(iter(self.local.values())).shape[0]
        for r in range(rows):
            part = {k: v[r : r + 1] for k, v in self.local.items()}
            (self.model(**part).loss / rows).backward()


#: the pipeline_model configurations (``pm.step`` on the global batch)
PIPED = ("hp_fb_ep4", "hp_mb2_ep4")


class _PipeCase(_Case):
    """``pipeline_model(...)``: ``pm.step`` on the global batch."""

    def __init__(self, pm: Any, batch: dict[str, torch.Tensor]) -> None:
        super().__init__(pm, batch, False)

    def grads(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.last = float(self.model.step(**self.local))
        sync_gradients(self.model)

    def loss(self) -> float:
        self.grads()
        self.opt.zero_grad(set_to_none=True)
        return self.last


def _grad_diffs(cases: dict[str, _Case]) -> dict[str, float]:
    """Max abs difference of every gradient after one step's ``grads()`` from ``hp_ep1``'s
    (experts: this rank's contiguous block of E/4 experts of the whole gradient), max over
    ranks: the configurations compute the same step."""
    for case in cases.values():
        case.grads()
    rank, out = dist.get_rank(), {}
    ref = dict(cases["hp_ep1"].model.named_parameters())
    for name in ("hp_ep4", "hf_ep4", "hf_ep4_mb2", *PIPED):
        worst = 0.0
        for pname, p in cases[name].model.named_parameters():
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            r = ref[pname].grad
            r = r.to_local() if hasattr(r, "to_local") else r
            if g is None or r is None:
                if (g is None) != (r is None):
                    worst = float("inf")
                continue
            if ".experts." in pname and g.shape != r.shape:
                n = g.shape[0]
                r = r[rank * n : (rank + 1) * n]
            worst = max(worst, (g - r).abs().max().item())
        out[name] = max_over_ranks(worst)
    for case in cases.values():
        case.opt.zero_grad(set_to_none=True)
    return out


def _body(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    device = torch.device(cfg["device"])
    world = init_device_mesh(device.type, (WORLD,), mesh_dim_names=("world",))
    mesh = unflatten(world, "world", (2, WORLD // 2), ("cp", "tp"))
    batch = random_batch(vocab=VOCAB, bsz=cfg["bsz"], seq=cfg["seq"], seed=1)
    local = {k: v.to(device) for k, v in shard_batch(batch, mesh).items()}

    hp4 = parallelize_model(_build(cfg, device), mesh, ep=WORLD, grad_reduction="allreduce")
    hp1 = parallelize_model(_build(cfg, device), mesh, ep=1, grad_reduction="allreduce")
    hf4 = parallelize_model(_build(cfg, device), mesh, ep=1, grad_reduction="allreduce")
    for experts in _experts(hf4):
        _hf_ep.hf_all_to_all_ep(experts, world)
    hf4_mb2 = parallelize_model(_build(cfg, device), mesh, ep=1, grad_reduction="allreduce")
    for experts in _experts(hf4_mb2):
        _hf_ep.hf_all_to_all_ep(experts, world)
    fb4 = pipeline_model(_build(cfg, device), mesh, microbatches=2, ep=WORLD,
                         overlap="forward_backward", grad_reduction="allreduce")  # fmt: skip
    mb4 = pipeline_model(_build(cfg, device), mesh, microbatches=2, ep=WORLD,
                         grad_reduction="allreduce")  # fmt: skip
    models = {"hp_ep4": hp4, "hp_ep1": hp1, "hf_ep4": hf4, "hp_fb_ep4": fb4, "hp_mb2_ep4": mb4}
    cases: dict[str, _Case] = {n: _Case(m, local, n == "hf_ep4") for n, m in models.items()
                               if n not in PIPED}  # fmt: skip
    for name in PIPED:
        cases[name] = _PipeCase(models[name], {k: v.to(device) for k, v in batch.items()})
    models["hf_ep4_mb2"] = hf4_mb2
    cases["hf_ep4_mb2"] = _AccumCase(hf4_mb2, local, True)

    # the first step of each also checks that the three agree on the loss
    losses = {}
    for name, case in cases.items():
        losses[name] = case.loss()
    grad_diff = _grad_diffs(cases)
    times = interleaved_timing(cases, repeats=cfg["repeats"], warmup=1, device=device)
    peak, moved, by_op, sim, params = {}, {}, {}, {}, {}
    for name, fn in cases.items():
        piped = name in PIPED  # the interleaved sides run under the caller's dispatch modes
        peak[name] = int(max_over_ranks(float(peak_memory_bytes(fn, device))))
        with _DispatchBytes() as counter:
            fn()
        sim[name] = int(max_over_ranks(float(bytes_per_call(fn))))
        moved[name] = int(max_over_ranks(float(counter.bytes)))
        by_op[name] = counter.by_op
        held = models[name].parts[0] if piped else models[name]
        params[name] = int(max_over_ranks(float(_expert_param_bytes(held))))
    extra = {
        "model": cfg["model"],
        "seq": cfg["seq"],
        "bsz": cfg["bsz"],
        "hidden": cfg["hidden"],
        "experts": cfg["experts"],
        "top_k": cfg["top_k"],
        "moe_layers": len(_experts(hp1)),
        "layers": 4,
        "mesh": "cp=2 x tp=2",
        "world": WORLD,
        "dtype": "float32",
        "grad_reduction": "allreduce",
        "experts_implementation_hf": EXPERTS_IMPL,
        "optimizer": "AdamW",
        "repeats": cfg["repeats"],
        "loss": losses,
        "grad_max_abs_diff_vs_hp_ep1": grad_diff,
        "load_avg_start": cfg["load_avg_start"],
        "load_avg_end": _loadavg(),
    }
    pairs = [("hp_ep4", "hp_ep1"), ("hp_ep4", "hf_ep4"), ("hp_fb_ep4", "hf_ep4"),
             ("hp_fb_ep4", "hp_ep4"), ("hp_mb2_ep4", "hf_ep4"),
             ("hp_fb_ep4", "hp_mb2_ep4"), ("hp_fb_ep4", "hf_ep4_mb2")]  # fmt: skip
    return [
        bench_record(
            f"{PREFIXES[cfg['model']]}/{a}_vs_{b}",
            times[a],
            times[b],
            peak_mem_ours=peak[a],
            peak_mem_baseline=peak[b],
            device=device.type,
            ours=a,
            baseline=b,
            expert_param_bytes_ours=params[a],
            expert_param_bytes_baseline=params[b],
            bytes_ours=moved[a],
            bytes_baseline=moved[b],
            bytes_by_op_ours=by_op[a],
            bytes_by_op_baseline=by_op[b],
            bytes_simulated_link_ours=sim[a],
            bytes_simulated_link_baseline=sim[b],
            **extra,
        )
        for a, b in pairs
    ]


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def main(argv: list[str] | None = None) -> None:
    p = bench_arguments(__doc__)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--model", choices=sorted(PREFIXES), default="deepseek-v3")
    p.add_argument("--bsz", type=int, default=2, help="rows a step (every configuration)")
    a = p.parse_args(argv)
    seq, hidden, repeats = (128, 64, 2) if a.quick else (256, 128, 9)
    cfg = {
        "model": a.model,
        "device": a.device,
        "seq": a.seq or seq,
        "bsz": a.bsz,
        "hidden": a.hidden or hidden,
        "experts": 16,
        "top_k": 4,
        "repeats": a.repeats or repeats,
        "load_avg_start": _loadavg(),
    }
    records = run_ranks(_body, cfg, world_size=WORLD, timeout=1800.0)
    if records is not None:
        write_records(a.out, records)
        for r in records:
            print(
                summary_line(r),
                f"| bytes/rank/step {r['bytes_ours']} vs {r['bytes_baseline']}"
                f" | expert params/rank {r['expert_param_bytes_ours']} vs "
                f"{r['expert_param_bytes_baseline']}",
            )


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
