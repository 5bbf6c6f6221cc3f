"""What the main job prints and draws: the curve comparison (NaN counts as disagreement), the
per-layer table (under ``--pp``, the pipeline's stages after it), the reason a parallel run is
slower than the serial one, the loss plots."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any


def first_non_finite(losses: list[float]) -> int | None:
    """Index of the first NaN/inf loss, or None."""
    return next((i for i, v in enumerate(losses) if not math.isfinite(v)), None)


def max_rel_diff(parallel: list[float], serial: list[float]) -> tuple[float, int]:
    """(largest relative difference, its step index); ``inf`` where either loss is not finite
    or the curves have different lengths (``max`` over a list with NaN would hide it)."""
    if len(parallel) != len(serial) or not serial:
        return math.inf, min(len(parallel), len(serial))
    worst, at = 0.0, 0
    for i, (p, s) in enumerate(zip(parallel, serial, strict=True)):
        d = abs(p - s) / max(abs(s), 1e-12) if math.isfinite(p) and math.isfinite(s) else math.inf
        if d > worst or not math.isfinite(d):
            worst, at = d, i
            if not math.isfinite(d):
                break
    return worst, at


def compare_curves(parallel: list[float], serial: list[float], tol: float) -> tuple[float, str]:
    """(max relative difference, reason); the reason is empty when the curves agree."""
    for name, curve in (("serial", serial), ("parallel", parallel)):
        bad = first_non_finite(curve)
        if bad is not None:
            return math.inf, f"{name} loss is {curve[bad]} at step {bad}"
    rel, at = max_rel_diff(parallel, serial)
    if rel <= tol:
        return rel, ""
    if at >= min(len(parallel), len(serial)):
        return rel, f"loss curves differ in length ({len(parallel)} vs {len(serial)} steps)"
    return rel, (
        f"loss curves disagree: max relative difference {rel:.2e} > tol {tol:.0e} "
        f"(step {at}: parallel {parallel[at]:.6f}, serial {serial[at]:.6f})"
    )


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def slower_reason(device: str, ranks: int, parallel_s: float, serial_s: float) -> str:
    """One line explaining a parallel step slower than the serial one ('' when it is not)."""
    if parallel_s <= serial_s:
        return ""
    why = []
    if device == "cpu":
        cores = usable_cores()
        if ranks > cores:
            why.append(f"{ranks} ranks share {cores} CPU core{'s' * (cores > 1)} on this machine")
        why.append("collectives go over gloo through the CPU, competing with the matmuls")
    why.append("a model this small has too little compute per rank to hide its communication")
    return (f"parallel step is {parallel_s / serial_s:.1f}x the serial one because "
            + "; ".join(why))  # fmt: skip


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


# the table's parallelism column, by the layer's kind (train.py's --layers names, mlp, moe)
HOW = {
    "kda": "KDA state passing + conv halo over cp·tp",
    "mla": "Ulysses MLA over cp·tp",
    "gdn": "Gated DeltaNet state passing + halo over cp·tp",
    "attn": "Ulysses gated GQA over cp·tp",
    "mlp": "MC2 gated MLP, TP+SP over tp",
    "moe": "hp-moe: {local} of {experts} experts a rank, ep={ep}",
    "p2p": "pipeline: hidden states, grads between stages",
    "other": "embedding, head, loss, FSDP2, clip, balancing",
}
# a MoE layer's collectives (hp-moe's names; ``:grad``, their backward, counted with them)
MOE_COLLECTIVES = {
    "moe:counts": "routing counts over ep (all-gather)",
    "moe:dispatch": "tokens to their experts (all-to-all-v)",
    "moe:combine": "expert outputs back (all-to-all-v)",
}


def moe_collectives(row: dict[str, Any]) -> list[tuple[str, list[int]]]:
    """A MoE layer's collectives as ``(name, bytes per rank)``, forward and ``:grad`` summed,
    hp-moe's first (counts, dispatch, combine), then any other."""
    summed: dict[str, list[int]] = {}
    for name, per_rank in row.get("collectives", {}).items():
        base = name.removesuffix(":grad")
        old = summed.get(base, [0] * len(per_rank))
        summed[base] = [a + b for a, b in zip(old, per_rank, strict=True)]
    order = [n for n in MOE_COLLECTIVES if n in summed] + sorted(set(summed) - set(MOE_COLLECTIVES))
    return [(n, summed[n]) for n in order]


def load_lines(load: dict[str, Any]) -> str:
    """What ``from_pretrained`` loaded (the folder, its family) and what each rank read."""
    total = load["folder_bytes"]
    lines = [
        f"\nloaded {load['path']} ({load['family']}, from_pretrained): "
        f"{fmt_bytes(total)} of tensors in the folder; each rank read its own slices:"
    ]
    per_rank = zip(load["bytes_read_per_rank"], load["tensors_per_rank"], load["seconds_per_rank"])
    for rank, (n, tensors, seconds) in enumerate(per_rank):
        lines.append(f"  rank {rank}: read {fmt_bytes(n)} ({n:,} bytes, {n / max(total, 1):.0%} "
                     f"of the folder) from {tensors} tensors in {seconds:.1f} s")  # fmt: skip
    return "\n".join(lines)


def print_layer_table(record: dict[str, Any], parallel_s: float, serial_s: float | None) -> None:
    mesh = record["mesh"]
    pp = f"pp={mesh['pp']} x " if "pp" in mesh else ""  # a pipeline: each layer on its stage's
    print(
        f"\nper layer, one step ({pp}cp={mesh['cp']} x tp={mesh['tp']}; bytes each rank moves over "
        "its link (hp-dtensor's comm.link_bytes), counted on the traced step; time: slowest "
        "rank, mean over steps; under each MoE layer, its collectives, forward + :grad)"
    )
    head = f"{'layer':<14} {'parallelism':<46} {'link/rank (max)':>16} {'total link':>12} " \
           f"{'fwd ms':>8} {'bwd ms':>8}"  # fmt: skip
    print(head)
    print("-" * len(head))
    ep, experts = record.get("ep", 1), record.get("experts", 0)
    for row in record["layers"]:
        kind = row["layer"].split(":")[-1]
        par = HOW.get(kind, "").format(local=experts // max(ep, 1), experts=experts, ep=ep)
        if kind == "moe" and ep == 1:
            par = f"MoE, all {experts} experts on every rank (ep=1)"
        recv = row["recv_bytes_per_rank"]
        fwd, bwd = (
            f"{row[k] * 1e3:.1f}" if row[k] is not None else "-" for k in ("fwd_s", "bwd_s")
        )
        print(
            f"{row['layer']:<14} {par:<46} {fmt_bytes(max(recv)):>16} "
            f"{fmt_bytes(sum(recv)):>12} {fwd:>8} {bwd:>8}"
        )
        if kind != "moe":
            continue
        for name, per_rank in moe_collectives(row):  # one line per collective, fwd + :grad
            what = MOE_COLLECTIVES.get(name, "")
            print(
                f"{'  ' + name:<14} {what:<46} {fmt_bytes(max(per_rank)):>16} "
                f"{fmt_bytes(sum(per_rank)):>12} {'':>8} {'':>8}"
            )
    serial = "no serial run" if serial_s is None else f"serial {serial_s * 1e3:.0f} ms"
    print(f"median step: parallel {parallel_s * 1e3:.0f} ms, {serial}")


def pipeline_lines(record: dict[str, Any], span: Any, mixers: list[str]) -> str:
    """The pipeline's stages (``record["pipeline"]``, train_hybrid.pipeline_record): each
    stage's decoder layers, ranks and forward / backward time a step, then each pp rank's busy
    time against its ``PipelinedModel.step`` and the schedule's bubble. ``span(range)`` names a
    layer range (``0-1``)."""
    pipe = record["pipeline"]
    steps = pipe["timed_steps"]
    which = f"steps {steps[0]}-{steps[-1]}" if len(steps) > 1 else f"step {steps[0]}"
    spr = pipe["stages_per_rank"]
    lines = [
        f"\npipeline: pp={pipe['pp']}, schedule {pipe['schedule']}, {pipe['microbatches']} "
        f"micro-batches a step, {spr} stage{'s' * (spr > 1)} a rank; per stage, its forward "
        f"and backward a step (torch's PipelineStage forward_one_chunk / backward_one_chunk, "
        f"every micro-batch summed; slowest rank of the stage, mean over {which})",
        f"{'stage':<6} {'layers':<24} {'ranks':<12} {'fwd ms':>8} {'bwd ms':>8}",
    ]
    for st in pipe["stages"]:
        layers = range(*st["layers"])
        named = f"{span(layers)} ({', '.join(mixers[i] for i in layers)})"
        ranks = ",".join(map(str, st["ranks"]))
        lines.append(f"{st['stage']:<6} {named:<24} {ranks:<12} {st['forward_s'] * 1e3:>8.1f} "
                     f"{st['backward_s'] * 1e3:>8.1f}")  # fmt: skip
    for r in pipe["ranks"]:
        idle = f"idle {r['idle']:.2f}" if r["idle"] is not None else "idle -"
        stages = ",".join(map(str, r["stages"]))
        lines.append(f"rank {r['rank']} (stage{'s' * (len(r['stages']) > 1)} {stages}): busy "
                     f"{r['busy_s'] * 1e3:.1f} ms of {r['step_s'] * 1e3:.1f} ms in "
                     f"PipelinedModel.step, {idle}")  # fmt: skip
    bubble = pipe["bubble"]
    formula = "(p-1)/(m+p-1)" if pipe["schedule"] in ("GPipe", "1F1B") else "(p-1)/(v·m+p-1)"
    lines.append(
        "idle: the step's time outside the rank's stage forwards and backwards (waiting for a "
        "neighbouring stage, sends, the loss)"
        + (f"; {pipe['schedule']}'s bubble with equal stages {formula} = {bubble:.2f}"
           if bubble is not None else "")
    )  # fmt: skip
    return "\n".join(lines)


def routing_lines(rate: float, bias: dict[str, list[float]], rerouted: list[int],
                  bias_ok: bool) -> str:  # fmt: skip
    """Two lines on the MoE routers: the balanced bias (``bias`` empty: routers without one,
    Qwen3-Next's), and how often the serial model routed the batch differently from the
    parallel one."""
    same = sum(1 for n in rerouted if n == 0)
    if bias:
        spread = max(max(v) - min(v) for v in bias.values())
        check = ("equal to the serial model's (the rule on the same loads) after every step"
                 if bias_ok else "NOT equal to the serial model's")  # fmt: skip
        head = (f"router bias: balance_experts after every step (rate {rate:g}), spread "
                f"{spread:.1e} over the experts at the end, {check}")  # fmt: skip
    else:
        head = "router bias: none (routers without e_score_correction_bias: nothing to balance)"
    line = (f"{head}\nrouting: the serial model picks the parallel model's experts at {same} "
            f"of {len(rerouted)} steps")  # fmt: skip
    if same < len(rerouted):
        line += (f" (elsewhere at most {max(rerouted)} (token, expert) assignments differ: "
                 "router scores within the two runs' rounding of a tie)")  # fmt: skip
    return line


def plot_curves(path: Path, parallel: list[float], serial: list[float], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if serial:  # none under --no-serial
        ax.plot(range(1, len(serial) + 1), serial, label="serial (1 process)", linewidth=2.5,
                alpha=0.6)  # fmt: skip
    ax.plot(range(1, len(parallel) + 1), parallel, label="parallel (TP + CP)", linestyle="--",
            marker=".")  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title, fontsize=9)  # names the model (its family) and the mesh
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_loss(path: Path, first_step: int, losses: list[float], title: str) -> None:
    """train.py's loss curve: steps ``first_step + 1, …`` (a resumed run starts later)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(first_step + 1, first_step + len(losses) + 1), losses, marker=".")
    ax.set(xlabel="step", ylabel="loss", title=title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
