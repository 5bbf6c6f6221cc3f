"""Forward/backward overlap across micro-batches (``pipeline_model(...,
overlap="forward_backward")``) under a modeled link: how much of a training step's exchange
time (MoE dispatch and combine and their gradients, plus the other exchanges of the step) the
step hides, against the same step with every exchange blocking.

A stock DeepSeek-V3 MoE model (float32, hidden 256, 4 layers of which 3 MoE: 16 routed experts
top-4 of intermediate 256 plus one shared, dense intermediate 512; MLA attention), 2 ranks, one
core per rank (``torch.set_num_threads(1)``, ``OMP_NUM_THREADS=1``), ``ep=2``, at pp = 1 on
the mesh ``--mesh cp`` ((cp, tp) = (2, 1): every exchange of the main job's layers, the
context-parallel attention's all-to-alls and gathers beside the MoE dispatch and combine) or
``--mesh dp`` ((dp, cp, tp) = (2, 1, 1): the dispatch and combine are the step's only
exchanges besides two small blocking all-reduces). Global batch B = ``m`` micro-batches
(``--microbatches``, default 2) of one row a rank of ``--seq`` tokens,
``grad_reduction="allreduce"``. Four configurations, every one its own model from the same
seed, in ONE run, interleaved, median of the repetitions:

- ``fb``: ``pipeline_model(model, mesh, microbatches=m, ep=2, overlap="forward_backward")``:
  micro-batch k+1's forward interleaved with micro-batch k's backward at their exchanges, the
  layers' own in-layer overlap kept (hp-moe's chunks, ``moe_chunks="auto"``);
- ``fb_one_chunk``: the same with ``moe_chunks=1`` (only the other micro-batch hides an
  exchange);
- ``blocking``: ``overlap=False`` (torch's 1F1B over one stage: F0 B0 F1 B1 ..., every
  exchange waited at once, the MoE blocks in one chunk);
- ``in_layer``: ``overlap=True`` (each layer's own overlap: hp-moe's chunks, ``"auto"``; the
  attention's head groups), no forward/backward interleaving.

At pp = 1 the first forward and the last backward have no partner: at most ``(m - 1) / m`` of
the exchange time can be under the other micro-batch (``interleaved_share_bound``); the rest
only the in-layer chunks can hide.

One step is ``zero_grad`` + ``pm.step(**batch)`` (forward and backward of the global batch;
``sync_gradients`` and the optimizer are left out: a blocking all-reduce that no schedule here
can hide). Under hp-dtensor's ``simulated_link`` (every collective completes no earlier than
launch + latency + bytes / bandwidth; the waiting thread sleeps for the rest), with the
bandwidth calibrated on the blocking step (``calibrate_link``: its bytes take as long as its
compute), latency 20 µs, exactly as the other modeled-link benchmarks
(hp-moe's bench_moe.py, hp-mc2's, hp-context-parallel's): ``hidden_fraction = (T_blocking −
T_ours) / T_link``, ``T_link`` the blocking step's modeled link seconds (hp-dtensor's
``LinkMeasurement``). Records ``models_fb_overlap/<mesh>/link/<ours>_vs_<baseline>`` (at
``m != 2``: ``.../link/m<m>/...``) for ``fb``, ``fb_one_chunk`` and ``in_layer`` against
``blocking`` and the two fb ones against ``in_layer``, each with the peak tensor memory of a
step (``peak_memory_bytes``, max over ranks; the tracker is a dispatch mode, which the
interleaved sides run under too); against ``blocking`` also where the link time not hidden
went (``schedule_hidden_share``: 1 − what ours' waits slept / its link time;
``split_unhidden_link``: that sleep; ``split_exchange_cpu``: the rest, the exchanges' real
work on the rank's one core, gloo's copies and the chunks', beyond the blocking step's, each a
share of ``T_link``); ``moe_link_share`` (the dispatch and combine share of the blocking step's
bytes over the link, from the recorder), the losses of the four (they must agree: same model,
same batch) and ``fb_switches`` (hand-overs of the interleaved pair).
``--repeat R`` runs the whole measurement R times and records the median run's figures with
``hidden_fraction_runs``.

    python packages/hp-models/benchmarks/bench_fb_overlap.py --out f.json [--quick]
        [--mesh cp|dp] [--microbatches M] [--repeat R] [--seq S] [--moe-ffn I]
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from hyper_parallel.dtensor import init_device_mesh, unflatten
from hyper_parallel.dtensor.benchmarking import (
    bench_arguments,
    link_world,
    max_over_ranks,
    measure_under_link,
    median_of_runs,
    peak_memory_bytes,
    run_facts,
    run_ranks,
    summary_line,
    write_records,
)
from hyper_parallel.dtensor.recorder import record_events
from hyper_parallel.models import pipeline_model
from hyper_parallel.models.testing import random_batch, tiny_model

PREFIX = "models_fb_overlap"
WORLD = 2
VOCAB = 512
MESHES = {"cp": ((2, 1), ("cp", "tp")), "dp": ((2, 1, 1), ("dp", "cp", "tp"))}
#: each configuration: pipeline_model's overlap= and moe_chunks=
CASES: dict[str, tuple[Any, Any]] = {
    "fb": ("forward_backward", "auto"),
    "fb_one_chunk": ("forward_backward", 1),
    "blocking": (False, "auto"),
    "in_layer": (True, "auto"),
}
#: the records: (ours, baseline)
PAIRS = (
    ("fb", "blocking"),
    ("fb_one_chunk", "blocking"),
    ("in_layer", "blocking"),
    ("fb", "in_layer"),
    ("fb_one_chunk", "in_layer"),
)


def _build(cfg: dict[str, Any]) -> torch.nn.Module:
    h = cfg["hidden"]
    return tiny_model(
        "deepseek",
        seed=0,
        dtype=torch.float32,
        vocab_size=VOCAB,
        hidden_size=h,
        intermediate_size=2 * h,
        moe_intermediate_size=cfg["moe_ffn"],
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        num_hidden_layers=4,
        first_k_dense_replace=1,
        n_routed_experts=cfg["experts"],
        num_experts_per_tok=cfg["top_k"],
    )


def _moe_share(step: Any) -> float:
    """The MoE dispatch and combine (and their gradients) share of one step's bytes over the
    link, this rank, from the recorder's launches (``comm.link_bytes``)."""
    with record_events() as rec:
        step()
    total = sum(e.nbytes for e in rec.events if e.kind == "launch")
    moe = sum(e.nbytes for e in rec.events if e.kind == "launch" and e.name.startswith("moe:"))
    return moe / total if total else float("nan")


def _measure(cfg: dict[str, Any], models: dict[str, Any], steps: dict[str, Any]) -> list[dict]:
    m = measure_under_link(
        steps,
        "blocking",
        latency_s=cfg["link_latency"],
        repeats=cfg["repeats"],
        runs=0,
        scale=cfg["link_scale"],
    )
    # hp-dtensor's CPU tracker is a dispatch mode: the interleaved sides run under the caller's
    # dispatch modes (pipeline.interleave), so it sees both sides' tensors
    peak = {n: int(max_over_ranks(float(peak_memory_bytes(fn)))) for n, fn in steps.items()}
    losses = {n: float(models[n].last_loss) for n in steps}
    share = max_over_ranks(_moe_share(steps["blocking"]))
    extra = {
        "mesh": cfg["mesh"],
        "dims": list(MESHES[cfg["mesh"]][0]),
        "dim_names": list(MESHES[cfg["mesh"]][1]),
        "ep": WORLD,
        "microbatches": cfg["microbatches"],
        "bsz": cfg["microbatches"] * (MESHES[cfg["mesh"]][0][0] if cfg["mesh"] == "dp" else 1),
        # at pp = 1 the first forward and the last backward run alone: at most (m - 1) / m of
        # the exchange time is under the other micro-batch (the rest only in-layer)
        "interleaved_share_bound": (cfg["microbatches"] - 1) / cfg["microbatches"],
        "seq": cfg["seq"],
        "hidden": cfg["hidden"],
        "moe_ffn": cfg["moe_ffn"],
        "experts": cfg["experts"],
        "top_k": cfg["top_k"],
        "layers": 4,
        "moe_layers": 3,
        "dtype": "float32",
        "grad_reduction": "allreduce",
        "link_scale": cfg["link_scale"],
        "repeats": cfg["repeats"],
        "losses": losses,
        "loss_max_rel_diff": max(abs(v - losses["blocking"]) for v in losses.values())
        / abs(losses["blocking"]),
        "fb_switches": list(models["fb"].pm.switches),
        "moe_chunks": {n: c for n, (_, c) in CASES.items()},
        "moe_link_share": share,
        "link_over_compute_check": m.link_over_compute("blocking"),
        "load_avg_start": cfg["load_avg_start"],
        "load_avg_end": _loadavg(),
    }
    m_tag = "" if cfg["microbatches"] == 2 else f"/m{cfg['microbatches']}"
    base = f"{PREFIX}/{cfg['mesh']}/link{m_tag}"
    return [
        m.record(
            f"{base}/{a}_vs_{b}",
            a,
            b,
            peak_mem_ours=peak[a],
            peak_mem_baseline=peak[b],
            **(_split(m, a, b) if b == "blocking" else {}),
            **extra,
        )
        for a, b in PAIRS
    ]


def _split(m: Any, ours: str, baseline: str) -> dict[str, float]:
    """Where the link time not hidden went, each a share of the baseline's ``T_link``
    (``hidden_fraction + split_unhidden_link + split_exchange_cpu = 1``): what ours' own waits
    slept (the link its schedule left exposed) and the rest, the exchanges' real work on the
    rank's one core (gloo's copies, the chunks' copies) beyond the baseline's;
    ``schedule_hidden_share``: ``1 - slept / T_link`` of ours' own link (what the schedule put
    under compute, whatever that compute then cost)."""
    b, o = m.cases[baseline], m.cases[ours]
    hidden = (b.time_s - o.time_s) / b.t_link_s
    unhidden = o.added_s / b.t_link_s
    return {
        "schedule_hidden_share": 1.0 - o.added_s / o.t_link_s,
        "split_unhidden_link": unhidden,
        "split_exchange_cpu": 1.0 - hidden - unhidden,
    }


class _Case:
    """One configuration: its pipelined model and step (``zero_grad`` + ``pm.step``)."""

    def __init__(self, cfg: dict[str, Any], mesh: Any, case: tuple[Any, Any], batch: dict) -> None:
        overlap, chunks = case
        self.pm = pipeline_model(
            _build(cfg), mesh, microbatches=cfg["microbatches"], ep=WORLD, overlap=overlap,
            grad_reduction="allreduce", moe_chunks=chunks,
        )  # fmt: skip
        self.params = list(self.pm.parameters())
        self.batch = batch
        self.last_loss = float("nan")

    def __call__(self) -> None:
        for p in self.params:
            p.grad = None
        self.last_loss = float(self.pm.step(**self.batch))


def _body(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    dims, names = MESHES[cfg["mesh"]]
    world = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("world",))
    mesh = unflatten(world, "world", dims, names)
    dp = dims[0] if names[0] == "dp" else 1
    m = cfg["microbatches"]
    batch = random_batch(vocab=VOCAB, bsz=m * dp, seq=cfg["seq"], seed=1)  # m micro-batches
    models = {name: _Case(cfg, mesh, case, batch) for name, case in CASES.items()}
    for case in models.values():  # the first steps (allocations, the hp-moe auto choice)
        case()
    runs = [_measure(cfg, models, dict(models)) for _ in range(cfg["repeat"])]
    return median_of_runs(runs)


def _loadavg() -> str | None:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return None


def main(argv: list[str] | None = None) -> None:
    p = bench_arguments(__doc__)
    p.add_argument("--mesh", choices=sorted(MESHES), default="cp")
    p.add_argument("--seq", type=int, default=None, help="tokens a row (2 rows a step)")
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--moe-ffn", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None, help="timed rounds a run")
    p.add_argument("--repeat", type=int, default=1, help="runs, each interleaving every case")
    p.add_argument("--microbatches", type=int, default=2, help="micro-batches a step (>= 2)")
    p.add_argument("--link-latency", type=float, default=20e-6, help="modeled latency (s)")
    p.add_argument("--world", type=int, default=None, help=f"ranks (only {WORLD})")
    p.add_argument(
        "--link-scale", type=float, default=1.0,
        help="the calibrated bandwidth times this (< 1: a slower link than the step's compute)",
    )  # fmt: skip
    a = p.parse_args(argv)
    if a.microbatches < 2:
        p.error("--microbatches: forward/backward overlap pairs two micro-batches, give >= 2")
    if a.device != "cpu":
        p.error("bench_fb_overlap models the link on CPU ranks (gloo): --device cpu")
    seq, hidden, moe_ffn, repeats = (128, 128, 128, 3) if a.quick else (512, 256, 256, 7)
    world = link_world(WORLD, a.world)
    if world != WORLD:
        p.error(f"bench_fb_overlap runs on {WORLD} ranks (ep 2 over the 2-rank mesh)")
    cfg = {
        "mesh": a.mesh,
        "seq": a.seq or seq,
        "hidden": a.hidden or hidden,
        "moe_ffn": a.moe_ffn or moe_ffn,
        "experts": 16,
        "top_k": 4,
        "repeats": a.repeats or repeats,
        "repeat": max(1, a.repeat),
        "microbatches": a.microbatches,
        "link_latency": a.link_latency,
        "link_scale": a.link_scale,
        "load_avg_start": _loadavg(),
    }
    facts = run_facts(world)
    records = run_ranks(_body, cfg, world_size=world, timeout=3600.0)
    if records is None:
        return
    records = [{**r, **facts} for r in records]
    write_records(a.out, records)
    print(f"load average: {cfg['load_avg_start']} at the start, {_loadavg()} at the end")
    for r in records:
        print(
            f"{summary_line(r)}  [modeled link: T_link {r['t_link_s'] * 1e3:.1f} ms, hidden "
            f"{r['hidden_fraction']:.2f} (paired {r['hidden_fraction_paired']:.2f}; schedule "
            f"{r.get('schedule_hidden_share', float('nan')):.2f}, exposed "
            f"{r.get('split_unhidden_link', float('nan')):.2f}, exchange cpu "
            f"{r.get('split_exchange_cpu', float('nan')):.2f}), added to ours "
            f"{r['link_added_ours_s'] * 1e3:.1f} ms, runs "
            f"{[round(v, 2) for v in r.get('hidden_fraction_runs', [])]}, check "
            f"{r['link_over_compute']:.2f}, moe share of bytes {r['moe_link_share']:.2f}, "
            f"loss rel diff {r['loss_max_rel_diff']:.1e}, switches {r['fb_switches']}]"
        )


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
