"""A picture of the recorded training step, drawn from the same events as the Perfetto JSON.

One pair of lanes per rank: ``compute`` (tid 0: each layer's forward/backward span, the spans
recorded inside it, time blocked in a wait) and, right under it, ``comm`` (tid 1: each
collective recorded by hp-dtensor's ``record_events`` from launch to the end of its
wait). A collective bar under a compute bar is communication hidden behind compute; a red
``wait`` span is communication that was not. Every layer's collectives (MLA, KDA, Qwen3-Next's
Gated DeltaNet and gated attention, MC2, the MoE layers' ``moe:dispatch`` / ``moe:combine``
all-to-alls, drawn in magenta) and hp-models' own (the loss's sums, ``sync_gradients``,
clipping) run on hp-dtensor's comm runtime and are recorded; FSDP2's all-gathers and
reduce-scatters, which are not on it, are timed from the ranges FSDP2 names them by
(examples/_fsdp_trace.py) onto the same comm lane.

Under ``--pp`` (examples/_pipeline_meter.py) each micro-batch's forward and backward of a
pipeline stage is a span of its own (``stage S mb K``, labelled ``F K`` / ``B K``, ``sS`` in
front where a rank holds several stages) with the layers' spans nested inside, torch's sends
and receives between the stages are on the comm lane (``p2p:…``, teal) and the time a stage
waits for one is a red ``wait`` span between the micro-batches: the pipeline's bubble.

Under ``--overlap forward_backward`` a third lane per rank, ``micro-batches`` (tid 2,
examples/_pipeline_meter.py's ``micro_batch_lane``), shows each micro-batch's running
stretches (``forward mb1`` dark, ``backward mb0`` light, labelled ``F1`` / ``B0``): a forward
stretch starting under a ``moe:combine…`` bar of the comm lane is one micro-batch's forward
computing while the other's combine is in flight.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

KIND_COLOURS = {"kda": "#4C72B0", "mla": "#DD8452", "gdn": "#4C72B0", "attn": "#DD8452",
                "mlp": "#55A868", "moe": "#DA8BC3"}  # fmt: skip
INNER = "#8172B3"
WAIT = "#C44E52"
COMM = "#937860"
MOE_COMM = "#A23B8C"  # hp-moe's dispatch and combine on the comm lane
OTHER = "#8C8C8C"
PIPE = "#1F3A93"  # a pipeline stage's micro-batch (forward dark, backward light)
P2P = "#2A9D8F"  # torch's point-to-point sends and receives between the stages


def spans_by_rank(trace: dict[str, Any]) -> dict[int, dict[int, list[dict[str, Any]]]]:
    """``{pid: {tid: [span, ...]}}`` of the complete ('X') events, each lane sorted by start."""
    lanes: dict[int, dict[int, list[dict[str, Any]]]] = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X":
            lanes.setdefault(int(e["pid"]), {}).setdefault(int(e.get("tid", 0)), []).append(e)
    for per_tid in lanes.values():
        for spans in per_tid.values():
            spans.sort(key=lambda e: (e["ts"], -e["dur"]))
    return lanes


def nesting_depth(spans: list[dict[str, Any]]) -> list[int]:
    """Depth of each span (sorted by start) inside the spans that enclose it."""
    depth: list[int] = []
    open_ends: list[float] = []
    for e in spans:
        while open_ends and open_ends[-1] <= e["ts"]:
            open_ends.pop()
        depth.append(len(open_ends))
        open_ends.append(e["ts"] + e["dur"])
    return depth


def pipeline_label(name: str, several: bool) -> str:
    """``stage 1 mb 3 (backward)`` -> ``B3`` (``s1 B3`` where the rank holds several stages)."""
    head, _, phase = name.partition(" (")
    words = head.split()  # stage S mb K
    label = ("B" if phase.startswith("backward") else "F") + words[-1]
    return f"s{words[1]} {label}" if several else label


def _colour(name: str) -> tuple[str, float]:
    if name.startswith("wait "):
        return WAIT, 1.0
    if name.startswith("stage "):
        return PIPE, 0.14 if "(backward)" in name else 0.3
    if name.startswith("layer "):
        kind = name.split(":", 1)[-1].split()[0]
        return KIND_COLOURS.get(kind, OTHER), 0.45 if "(backward)" in name else 0.8
    return INNER, 0.9


def _comm_colour(name: str) -> tuple[str, float]:
    """hp-moe's exchanges (``moe:…``) magenta, the pipeline's sends and receives teal, every
    other collective brown."""
    if name.startswith("p2p:"):
        return P2P, 0.85
    return (MOE_COMM, 0.9) if name.startswith("moe:") else (COMM, 0.8)


def _draw_segments(ax: Any, spans: list[dict[str, Any]], y: float, t_end: float) -> None:
    """The micro-batches' running stretches (tid 2): forward dark, backward light."""
    for e in spans:
        backward = e["name"].startswith("backward")
        start, width = e["ts"] / 1e3, max(e["dur"] / 1e3, t_end * 2e-4)
        alpha = 0.25 if backward else 0.6
        ax.broken_barh([(start, width)], (y - 0.4, 0.8), facecolors=PIPE, alpha=alpha,
                       edgecolor="white", linewidth=0.3)  # fmt: skip
        if width > t_end * 0.012:
            label = ("B" if backward else "F") + e["name"].rsplit("mb", 1)[-1]
            ax.text(start + width / 2, y, label, ha="center", va="center", fontsize=6)


def _draw_lane(ax: Any, spans: list[dict[str, Any]], y: float, comm: bool, t_end: float) -> None:
    depths = [0] * len(spans) if comm else nesting_depth(spans)
    several = len({e["name"].split()[1] for e in spans if e["name"].startswith("stage ")}) > 1
    for e, d in zip(spans, depths, strict=True):
        colour, alpha = _comm_colour(e["name"]) if comm else _colour(e["name"])
        height = 0.8 * (0.62**d)
        start, width = e["ts"] / 1e3, max(e["dur"] / 1e3, t_end * 2e-4)
        on_top = comm and e["name"].startswith("moe:")  # over the FSDP2 spans they overlap
        under = comm and e["name"].startswith("p2p:")  # long in flight: under the collectives
        ax.broken_barh([(start, width)], (y - 0.4, height), facecolors=colour, alpha=alpha,
                       edgecolor="white" if d == 0 else "none", linewidth=0.3,
                       zorder=2.5 if on_top else 1.5 if under else 2)  # fmt: skip
        if d == 0 and not comm and width > t_end * 0.045 and e["name"].startswith("layer "):
            label = e["name"].removeprefix("layer ").replace(" (forward)", "")
            label = label.replace(" (backward)", " bwd")
            ax.text(start + width / 2, y - 0.4 + height * 0.78, label, ha="center",
                    va="center", fontsize=6)  # fmt: skip
        if d == 0 and not comm and width > t_end * 0.012 and e["name"].startswith("stage "):
            ax.text(start + width / 2, y - 0.4 + height * 0.84, pipeline_label(e["name"], several),
                    ha="center", va="center", fontsize=6)  # fmt: skip


def plot_trace(trace: dict[str, Any], path: Path, title: str,
               xlabel: str = "ms since the rank's first recorded event") -> None:  # fmt: skip
    """Write a PNG timeline of ``trace`` (Chrome trace dict, one pid per rank) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    lanes = spans_by_rank(trace)
    ranks = sorted(lanes)
    t_end = max((e["ts"] + e["dur"]) / 1e3 for r in ranks for s in lanes[r].values() for e in s)
    segments = any(lanes[r].get(2) for r in ranks)  # --overlap forward_backward
    pitch = 3.6 if segments else 2.6
    fig, ax = plt.subplots(figsize=(12, 0.9 + (1.5 if segments else 1.1) * max(len(ranks), 1)))
    ticks, labels = [], []
    for i, rank in enumerate(ranks):
        base = pitch * (len(ranks) - 1 - i) + (1.0 if segments else 0.0)
        for tid, y in ((0, base + 1.0), (1, base)):
            _draw_lane(ax, lanes[rank].get(tid, []), y, comm=tid == 1, t_end=t_end)
            ticks.append(y)
            labels.append(f"rank {rank} {'compute' if tid == 0 else 'comm'}")
        if segments:
            _draw_segments(ax, lanes[rank].get(2, []), base - 1.0, t_end)
            ticks.append(base - 1.0)
            labels.append(f"rank {rank} micro-batches")
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.set_xlim(0, t_end * 1.01)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    present = {e["name"].split(":", 1)[-1].split()[0] for r in ranks
               for e in lanes[r].get(0, []) if e["name"].startswith("layer ")}  # fmt: skip
    legend = [Patch(color=c, label=f"{k} layer (dark: fwd, light: bwd)")
              for k, c in KIND_COLOURS.items() if k in present]  # fmt: skip
    legend += [Patch(color=INNER, label="compute inside a layer"),
               Patch(color=WAIT, label="blocked in a wait"),
               Patch(color=COMM, label="collective in flight, launch to wait "
                     "(every layer's, hp-models', FSDP2's)")]  # fmt: skip
    if any(e["name"].startswith("moe:") for r in ranks for e in lanes[r].get(1, [])):
        legend.append(Patch(color=MOE_COMM, label="MoE dispatch / combine in flight (hp-moe)"))
    if any(e["name"].startswith("stage ") for r in ranks for e in lanes[r].get(0, [])):
        legend.append(Patch(color=PIPE, alpha=0.3, label="a pipeline stage's micro-batch K: F K "
                            "forward, B K backward (its layers inside)"))  # fmt: skip
    if segments:
        legend.append(Patch(color=PIPE, alpha=0.6, label="a micro-batch running (F k forward, "
                            "B k backward), hand-over to hand-over"))  # fmt: skip
    if any(e["name"].startswith("p2p:") for r in ranks for e in lanes[r].get(1, [])):
        legend.append(Patch(color=P2P, label="pipeline send / receive between stages (torch)"))
    ax.legend(handles=legend, fontsize=7, loc="upper center", ncol=2,
              bbox_to_anchor=(0.5, -0.16 - 0.05 / max(len(ranks), 1)))  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
