"""One real-size delta-rule layer under context parallelism: what each rank keeps and how long
its step takes, per local kernel, beside the planner's prediction.

The stock Hugging Face layers on transformers' PyTorch path (``import_torch_path``), float32,
cp = 2 (2 gloo ranks), one forward + backward of each rank's block (``layer(block).sum()
.backward()``, the block requiring grad):

- Kimi-Linear-48B's ``KimiLinearDeltaAttention`` (hidden 2304, 32 heads of 128, conv 4) under
  ``parallelize_kda``;
- Qwen3-Next-80B's ``Qwen3NextGatedDeltaNet`` (hidden 2048, 16 key and 32 value heads of 128,
  conv 4) under ``parallelize_gated_deltanet``;

each at 512 and 2048 tokens a rank, on three local paths:

- ``earlier``: hp-kda-kernels' chunk path under plain autograd (``layer._LEAN = False``,
  ``local_kernel="torch"``);
- ``lean``: the lean chunk path (``_LEAN = True``, ``local_kernel="torch"``; the default);
- ``stock``: the stock layer's own chunk function (``local_kernel="stock"``; on CPU
  transformers' torch reference, which keeps the pairwise decay tensors).

Measured: the activation peak of the step (hp-models' ``track_activations``, parameter
gradients left out, as the planner's tests do) in bytes a token of the rank's block, what the
forward leaves live (``saved``: the outputs included), and the median step time (slowest
rank, the three paths interleaved). Planned: ``plan.activations.mixer_bytes`` for the layer's
shape at ``kda_kernel="torch"`` (what the planner says of the lean path, the default), the
layer alone (no norms, no MLP); the earlier and stock paths are set beside that same number
(how much more they keep than the planner's default), and ``kda_kernel="fused"`` is printed
as what a fused kernel (fla's) would keep. A case whose peak, projected from its 512-token
bytes a token, would pass ``--max-gib`` (9 GiB) a rank is skipped and recorded with why.

Then (skipped by ``--layers-only``; ``--model-only`` runs it alone) the planner against a
small model at a size a team plans with: Kimi-Linear with the real KDA and MLA head sizes (KDA,
MLA, KDA, MLA; three dense MLPs and one MoE), reduced hidden size, vocabulary and experts,
float32, cp = 4 (4 gloo ranks), 8192 tokens (2048 a rank), ``parallelize_model``: one
training step's activation peak (the busiest rank) against ``plan_memory``'s, with MLA's
attention as CPU sdpa runs it (the unfused math: its q/k and v head dims differ), on the lean
path; and the same step on the earlier path (peak and median step time beside the lean one's).

    python packages/hp-models/benchmarks/bench_delta_rule_layers.py --out FILE [--quick]

About 15 minutes on 2 CPU cores (``--quick``: tiny shapes, under a minute).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import torch

from hyper_parallel.dtensor.benchmarking import (
    bench_arguments,
    bench_record,
    interleaved_timing,
    run_ranks,
    write_records,
)

PATHS = ("earlier", "lean", "stock")
MB = 1e6


def _kda_layer(cfg: dict[str, Any]) -> Any:
    """A stock ``KimiLinearDeltaAttention`` on its PyTorch path, HF's initialisation and
    hp-kda-kernels' bench_kda gate (``A_log``, ``dt_bias`` set: the bare layer leaves them
    uninitialised)."""
    from transformers import KimiLinearConfig

    from hyper_parallel.kda.testing import import_torch_path

    kimi = import_torch_path("transformers.models.kimi_linear.modeling_kimi_linear")
    config = KimiLinearConfig(
        hidden_size=cfg["kda_hidden"], num_hidden_layers=1,
        linear_attn_config={"head_dim": cfg["head_dim"], "num_heads": cfg["kda_heads"],
                            "short_conv_kernel_size": 4},
    )  # fmt: skip
    torch.manual_seed(0)
    layer = kimi.KimiLinearDeltaAttention(config, layer_idx=0)
    with torch.no_grad():
        layer.forget_gate.A_log.uniform_(1.0, 16.0).log_()
        layer.forget_gate.dt_bias.uniform_(-7.0, -2.3)
    return layer


def _gdn_layer(cfg: dict[str, Any]) -> Any:
    """A stock ``Qwen3NextGatedDeltaNet`` on its PyTorch path, initialised as bench_kda's."""
    from transformers import Qwen3NextConfig

    from hyper_parallel.kda.testing import import_torch_path

    qwen = import_torch_path("transformers.models.qwen3_next.modeling_qwen3_next")
    d = cfg["head_dim"]
    config = Qwen3NextConfig(
        hidden_size=cfg["gdn_hidden"], num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, linear_num_key_heads=cfg["gdn_key_heads"],
        linear_num_value_heads=cfg["gdn_value_heads"], linear_key_head_dim=d,
        linear_value_head_dim=d, linear_conv_kernel_dim=4, layer_types=["linear_attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    layer = qwen.Qwen3NextGatedDeltaNet(config, layer_idx=0)
    with torch.no_grad():
        layer.A_log.uniform_(1.0, 16.0).log_()
        layer.dt_bias.uniform_(-7.0, -2.3)
    return layer


def _shape(kind: str, cfg: dict[str, Any]) -> Any:
    """The planner's :class:`LayerShape` of the layer (the MLP part unused: mixer only)."""
    from hyper_parallel.models.plan.activations import LayerShape

    d = cfg["head_dim"]
    if kind == "kda":
        dims = {"D": cfg["kda_hidden"], "H": cfg["kda_heads"], "K": d, "conv": 4}
    else:
        dims = {"D": cfg["gdn_hidden"], "Hk": cfg["gdn_key_heads"],
                "Hv": cfg["gdn_value_heads"], "K": d, "V": d, "conv": 4}  # fmt: skip
    return LayerShape(kind, "dense", tuple(sorted({**dims, "I": 0}.items())))


def planned(kind: str, cfg: dict[str, Any], tokens: int, p: int, kernel: str) -> int:
    """The planner's bytes for the layer alone (``mixer_bytes``), ``tokens`` a rank over ``p``
    ranks, float32."""
    from hyper_parallel.models.plan.activations import mixer_bytes

    return mixer_bytes(
        _shape(kind, cfg), rows=1, seq=tokens * p, p=p, b=4, attn_implementation="flash",
        kda_kernel=kernel, peak=True,
    )  # fmt: skip


def _parallel(kind: str, layer: Any, mesh: Any, path: str) -> Any:
    from hyper_parallel.kda import parallelize_gated_deltanet, parallelize_kda

    fn = parallelize_kda if kind == "kda" else parallelize_gated_deltanet
    return fn(copy.deepcopy(layer), mesh, local_kernel="stock" if path == "stock" else "torch")


def _step(layer: Any, block: torch.Tensor, path: str) -> Callable[[], Any]:
    """One forward + backward of the rank's block on ``path`` (the lean switch set for it)."""
    from hyper_parallel.kda import layer as kda_layer

    def run() -> Any:
        kda_layer._LEAN = path != "earlier"
        try:
            layer.zero_grad(set_to_none=True)
            out = layer(block.detach().requires_grad_())
            out.sum().backward()
        finally:
            kda_layer._LEAN = True

    return run


def _measure(layer: Any, block: torch.Tensor, path: str) -> dict[str, int]:
    """The step's activation peak and what its forward leaves live (parameter gradients and
    the input's gradient left out)."""
    from hyper_parallel.kda import layer as kda_layer
    from hyper_parallel.models.plan.measure import track_activations

    kda_layer._LEAN = path != "earlier"
    try:
        layer.zero_grad(set_to_none=True)
        x = block.detach().requires_grad_()
        with track_activations() as trace:
            out = layer(x)
            loss = out.sum()
            # not activations: the parameters and the input (seen through their views), the
            # output (in a model the residual add's input, not kept)
            trace.exclude_tensors([*layer.parameters(), x, out])
            saved = trace.live_bytes() - sum(
                t.untyped_storage().nbytes() for t in (x, out, *layer.parameters())
                if t.untyped_storage().data_ptr() in trace.live
            )  # fmt: skip
            del out
            loss.backward()
        grads = [p.grad for p in layer.parameters() if p.grad is not None]
        trace.exclude_tensors([*grads, *([x.grad] if x.grad is not None else [])])
        return {"peak": trace.peak(), "saved": saved}
    finally:
        kda_layer._LEAN = True


def _layers(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    import torch.distributed as dist

    from hyper_parallel.dtensor import init_device_mesh

    torch.set_num_threads(1)
    P, r = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (P,), mesh_dim_names=("cp",))
    records = []
    for kind, build in (("kda", _kda_layer), ("gdn", _gdn_layer)):
        stock = build(cfg)
        layers = {path: _parallel(kind, stock, mesh, path) for path in PATHS}
        per_token: dict[str, float] = {}  # bytes a token at the first size, for the projection
        for tokens in cfg["tokens"]:
            D = stock.hidden_size
            x = torch.randn(1, tokens * P, D, generator=torch.Generator().manual_seed(1))
            block = x[:, tokens * r : tokens * (r + 1)].contiguous()
            run, skipped = [], {}
            for path in PATHS:
                projected = per_token.get(path, 0.0) * tokens
                if projected > cfg["max_bytes"]:
                    skipped[path] = (
                        f"projected peak {projected / 2**30:.1f} GiB a rank (from "
                        f"{per_token[path] / MB:.2f} MB a token at {cfg['tokens'][0]} tokens) "
                        f"> {cfg['max_bytes'] / 2**30:.0f} GiB"
                    )
                else:
                    run.append(path)
            mem = {path: _measure(layers[path], block, path) for path in run}
            got = [None] * P
            dist.all_gather_object(got, mem)
            mem = {p: {k: max(g[p][k] for g in got) for k in mem[p]} for p in run}  # type: ignore[index]
            cases = {path: _step(layers[path], block, path) for path in run}
            times = interleaved_timing(cases, repeats=cfg["repeats"], warmup=1)
            plan = planned(kind, cfg, tokens, P, "torch")
            fused = planned(kind, cfg, tokens, P, "fused")
            for path in PATHS:
                name = f"delta_rule_layer/{kind}/T{tokens}/{path}"
                facts = {
                    "layer": kind, "path": path, "tokens_per_rank": tokens, "cp": P,
                    "hidden": D, "dtype": "float32", "planned_bytes": plan,
                    "planned_per_token": plan / tokens, "planned_fused_bytes": fused,
                    "planned_fused_per_token": fused / tokens,
                    "planned_as": "mixer_bytes(kda_kernel='torch'): the planner's lean path",
                }  # fmt: skip
                if path in skipped:  # no step: times 0, ratio NaN
                    records.append(bench_record(name, 0.0, 0.0, skipped=skipped[path], **facts))
                    continue
                m = mem[path]
                per_token.setdefault(path, m["peak"] / tokens)
                records.append(
                    bench_record(
                        name,
                        times[path],
                        times["lean"] if "lean" in times else times[path],
                        peak_mem_ours=m["peak"],
                        peak_mem_baseline=mem.get("lean", m)["peak"],
                        measured_per_token=m["peak"] / tokens,
                        saved_bytes=m["saved"],
                        saved_per_token=m["saved"] / tokens,
                        step_s=times[path],
                        planned_over_measured=plan / m["peak"],
                        baseline="the lean path (ratio: this path's time / lean's)",
                        **facts,
                    )
                )
        del layers, stock
    return records


# Kimi-Linear with the real KDA and MLA head sizes (hidden, vocabulary and experts reduced):
# KDA, MLA, KDA, MLA, the last with MoE
MODEL = {
    "hidden_size": 512, "intermediate_size": 1024, "moe_intermediate_size": 256,
    "vocab_size": 2048, "num_attention_heads": 4, "num_key_value_heads": 4,
    "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
    "linear_num_heads": 4, "linear_head_dim": 128, "num_experts": 8, "num_experts_per_token": 2,
}  # fmt: skip
QUICK_MODEL = {**MODEL, "hidden_size": 64, "intermediate_size": 64, "moe_intermediate_size": 32,
               "vocab_size": 256, "kv_lora_rank": 32, "qk_rope_head_dim": 16,
               "qk_nope_head_dim": 32, "v_head_dim": 32, "linear_head_dim": 32}  # fmt: skip
MODEL_ATTN = "sdpa-math"  # CPU sdpa on MLA's unequal q/k and v head dims: the unfused math


def _model(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """One training step (forward + backward) of the small Kimi-Linear on every rank (cp =
    world size, ``parallelize_model``) on the lean path and on the earlier one (``_LEAN =
    False``): the activation peak (parameter gradients left out, as the planner's tests measure
    it; the busiest rank's) and the median step time (slowest rank). Rank 0's record; the plan
    is added by :func:`with_plan` (``plan_memory`` runs without a process group)."""
    import torch.distributed as dist

    from hyper_parallel.dtensor import init_device_mesh, unflatten
    from hyper_parallel.kda import layer as kda_layer
    from hyper_parallel.models import parallelize_model, shard_batch
    from hyper_parallel.models.plan.measure import track_activations
    from hyper_parallel.models.testing import random_batch, tiny_model

    torch.set_num_threads(1)
    P = dist.get_world_size()
    shape, seq = cfg["model"], cfg["model_seq"]
    model = tiny_model("kimi", dtype=torch.float32, **shape)
    model.train()
    world = init_device_mesh("cpu", (P,), mesh_dim_names=("w",))
    mesh = unflatten(world, "w", (1, P, 1), ("dp", "cp", "tp"))
    parallelize_model(model, mesh, grad_reduction="allreduce", local_kernel="torch")
    local = shard_batch(random_batch(vocab=shape["vocab_size"], bsz=1, seq=seq), mesh)

    def step(lean: bool) -> Callable[[], None]:
        def run() -> None:
            kda_layer._LEAN = lean
            try:
                model.zero_grad(set_to_none=True)
                model(**local).loss.backward()
            finally:
                kda_layer._LEAN = True

        return run

    peaks = {}
    for path, lean in (("lean", True), ("earlier", False)):
        kda_layer._LEAN = lean
        try:
            model.zero_grad(set_to_none=True)
            with track_activations() as trace:
                model(**local).loss.backward()
        finally:
            kda_layer._LEAN = True
        trace.exclude_tensors([p.grad for p in model.parameters() if p.grad is not None])
        got = [0] * P
        dist.all_gather_object(got, trace.peak())
        peaks[path] = max(got)
    times = interleaved_timing(
        {"lean": step(True), "earlier": step(False)}, repeats=cfg["model_repeats"], warmup=0
    )
    return [
        bench_record(
            f"delta_rule_model/kimi4/T{seq}/cp{P}/lean_vs_earlier",
            times["lean"],
            times["earlier"],
            peak_mem_ours=peaks["lean"],
            peak_mem_baseline=peaks["earlier"],
            measured_peak=peaks["lean"],
            tokens=seq,
            cp=P,
            tokens_per_rank=seq // P,
            attn_implementation=MODEL_ATTN,
            kda_kernel="torch",
            dtype="float32",
            model=shape,
            layers="KDA, MLA, KDA, MLA (dense, dense, dense, MoE)",
            baseline="the earlier chunk path (_LEAN = False) on the same model",
        )
    ]


def with_plan(rec: dict[str, Any]) -> dict[str, Any]:
    """``rec`` (from :func:`_model`) with the planner's peak for the same step."""
    from hyper_parallel.models import plan_memory
    from hyper_parallel.models.testing import kimi_config

    plan = plan_memory(
        kimi_config(**rec["model"]), dims=(1, rec["cp"], 1), seq_len=rec["tokens"],
        dtype=torch.float32, grad_reduction="allreduce", attn_implementation=MODEL_ATTN,
    )  # fmt: skip
    ratio = plan.activations / rec["measured_peak"]
    return {**rec, "planned_peak": plan.activations, "planned_over_measured": ratio}


def table(records: list[dict[str, Any]]) -> str:
    """The markdown table of the layer records."""
    rows = [
        "| layer | tokens/rank | path | measured peak (MB/token) | saved after forward "
        "(MB/token) | planned, torch (MB/token) | planned / measured | planned, fused "
        "(MB/token) | step (s) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for rec in records:
        if not rec["name"].startswith("delta_rule_layer/"):
            continue
        head = f"| {rec['layer']} | {rec['tokens_per_rank']} | {rec['path']} |"
        plan = f"{rec['planned_per_token'] / MB:.3f}"
        fused = f"{rec['planned_fused_per_token'] / MB:.3f}"
        if "skipped" in rec:
            rows.append(f"{head} skipped: {rec['skipped']} | | {plan} | | {fused} | |")
            continue
        rows.append(
            f"{head} {rec['measured_per_token'] / MB:.3f} | {rec['saved_per_token'] / MB:.3f} "
            f"| {plan} | {rec['planned_over_measured']:.2f} | {fused} | {rec['step_s']:.2f} |"
        )
    models = [r for r in records if r["name"].startswith("delta_rule_model/")]
    if models:
        rows += ["", "| model | tokens (per rank) | cp | measured peak, lean (MB) | planned "
                 "(MB) | planned / measured | earlier path's peak (MB) | step lean / earlier "
                 "(s) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for rec in models:
            rows.append(
                f"| {rec['layers']} | {rec['tokens']} ({rec['tokens_per_rank']}) | {rec['cp']} "
                f"| {rec['measured_peak'] / MB:.1f} | {rec['planned_peak'] / MB:.1f} "
                f"| {rec['planned_over_measured']:.2f} | {rec['peak_mem_baseline'] / MB:.1f} "
                f"| {rec['ours_s']:.1f} / {rec['baseline_s']:.1f} |"
            )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    p = bench_arguments(__doc__)
    p.add_argument("--tokens", type=int, nargs="+", default=None, help="tokens a rank")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--max-gib", type=float, default=9.0, help="skip a case projected past it")
    p.add_argument("--layers-only", action="store_true", help="skip the small model")
    p.add_argument("--model-only", action="store_true", help="the small model alone")
    a = p.parse_args(argv)
    if a.device != "cpu":
        raise SystemExit("this benchmark runs gloo ranks on the CPU (--device cpu)")
    if a.quick:
        cfg: dict[str, Any] = {"kda_hidden": 64, "kda_heads": 2, "gdn_hidden": 64,
                               "gdn_key_heads": 1, "gdn_value_heads": 2, "head_dim": 32,
                               "tokens": [64, 128], "repeats": 2}  # fmt: skip
    else:
        cfg = {"kda_hidden": 2304, "kda_heads": 32, "gdn_hidden": 2048, "gdn_key_heads": 16,
               "gdn_value_heads": 32, "head_dim": 128, "tokens": [512, 2048],
               "repeats": 3}  # fmt: skip
    cfg["tokens"] = a.tokens or cfg["tokens"]
    cfg["repeats"] = a.repeats or cfg["repeats"]
    cfg["max_bytes"] = int(a.max_gib * 2**30)
    cfg["model"] = QUICK_MODEL if a.quick else MODEL
    cfg["model_seq"] = 512 if a.quick else 8192
    cfg["model_repeats"] = 1 if a.quick else 2
    records: list[dict[str, Any]] = []
    if not a.model_only:
        records += run_ranks(_layers, cfg, world_size=2, timeout=7200.0) or []
    if not a.layers_only:
        got = run_ranks(_model, cfg, world_size=4, timeout=3600.0) or []
        records += [with_plan(r) for r in got]
    if not records:
        return
    write_records(a.out, records)
    print(table(records))


if __name__ == "__main__":
    os.environ.setdefault("HP_CHECK_CONSISTENCY", "0")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
