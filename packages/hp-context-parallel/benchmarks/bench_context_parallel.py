"""One MLA block (forward + backward) under Ulysses context parallelism: overlapped vs blocking
collectives for each strategy, and the latent strategy vs the expanded one, side by side,
interleaved, median; peak memory; and the bytes each rank receives from its peers per step,
counted by the event recorder during one extra step (not estimated).

Two blocks, the same shapes: this package's ``MultiHeadLatentAttention`` (records
``cp_mla_fwd_bwd/*``) and the stock Hugging Face ``DeepseekV3Attention`` (transformers, records
``cp_hf_deepseek_v3_fwd_bwd/*``; RoPE tables from its own rotary embedding at the rank's global
positions, computed once outside the timed step). ``--block mla|deepseek_v3|qwen3_next`` runs
one. ``qwen3_next``: the stock gated ``Qwen3NextAttention`` (2 key/value heads, head dim 64,
rotary 0.25) through ``parallelize_attention``, under the modeled link only (records
``cp_hf_qwen3_next_attention_fwd_bwd/link/overlap_vs_blocking``: its default, overlap with
``head_groups="auto"``, vs blocking).

Under a modeled link (``simulated_link``, a simulation: every collective completes no earlier
than launch + latency + bytes / bandwidth, the wait sleeping for what compute has not hidden),
records ``cp_mla_fwd_bwd/link/<strategy>_overlap_vs_blocking`` (this package's block, at most
2048 tokens so that the extra steps stay short): for each strategy the link's
bandwidth is chosen so that the blocking path's bytes per step take as long as its compute
(its step without the link, less gloo's real transfers), then both paths run interleaved
under it; ``hidden_fraction`` is
``(T_blocking - T_overlapped) / T_link``, ``T_link`` the modeled link seconds per step.

    python packages/hp-context-parallel/benchmarks/bench_context_parallel.py \\
        --out bench.json [--quick]
    torchrun --nproc-per-node 2 packages/hp-context-parallel/benchmarks/bench_context_parallel.py \\
        --device cuda --out bench.json

``--repeat R``: each modeled-link table R times (each run interleaving every case), per record
the median run's figures with ``hidden_fraction_runs``; ``--split``: how each MLA step splits
(hp-dtensor's ``link_time_split``; the chunking overhead against the one-group pipeline);
``--link-groups ''`` / ``--link-strategies expanded``: the default alone. Every record carries
``world``, ``cores_per_rank``, ``load`` and ``oversubscribed``.

Without torchrun it starts min(2, cores) gloo ranks on this machine (one core per rank;
``--world N`` to choose); under torchrun it uses the launched
ranks and the device's own backend (NCCL on CUDA, HCCL on NPU). Rank 0 writes the records.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

from hyper_parallel.context_parallel import (
    MLAConfig,
    MultiHeadLatentAttention,
    attention_head_groups,
    mla_head_groups,
    parallelize_attention,
    parallelize_mla,
    record_events,
)
from hyper_parallel.dtensor import init_device_mesh
from hyper_parallel.dtensor.benchmarking import (
    bench_arguments,
    bench_record,
    interleaved_timing,
    link_time_split,
    link_world,
    measure_under_link,
    median_of_runs,
    peak_memory_bytes,
    run_facts,
    run_ranks,
    simulated_link,
    summary_line,
    write_records,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CASES = [
    ("expanded_overlap", "expanded", True),
    ("expanded_blocking", "expanded", False),
    ("latent_overlap", "latent", True),
    ("latent_blocking", "latent", False),
]
PAIRS = [
    ("expanded_overlap_vs_blocking", "expanded_overlap", "expanded_blocking"),
    ("latent_overlap_vs_blocking", "latent_overlap", "latent_blocking"),
    ("latent_vs_expanded_overlap", "latent_overlap", "expanded_overlap"),
    ("latent_vs_expanded_blocking", "latent_blocking", "expanded_blocking"),
]
BLOCKS = {
    "mla": "cp_mla_fwd_bwd",
    "deepseek_v3": "cp_hf_deepseek_v3_fwd_bwd",
    "qwen3_next": "cp_hf_qwen3_next_attention_fwd_bwd",  # under the modeled link only
}
GATED_KV_HEADS, GATED_HEAD_DIM, GATED_ROTARY = 2, 64, 0.25  # Qwen3-Next's kv heads, rotary
# the head-group pipeline, compared under the modeled link: (suffix, head_groups); the
# ``<strategy>_overlap`` case itself is parallelize_mla's default, head_groups="auto"
LINK_GROUPS = [("g1", 1), ("g2", 2), ("g4", 4), ("g8", 8)]
WORLD = 2  # context-parallel ranks; by default at most one per core


def _mla_block(cfg: dict[str, Any], rank: int, ws: int) -> tuple[torch.nn.Module, Any]:
    """This package's block; its forward takes the rank's hidden_states only."""
    config = MLAConfig(
        hidden_size=cfg["hidden"],
        num_heads=cfg["heads"],
        q_lora_rank=cfg["q_lora"],
        kv_lora_rank=cfg["kv_lora"],
        qk_nope_head_dim=cfg["nope"],
        qk_rope_head_dim=cfg["rope"],
        v_head_dim=cfg["v"],
    )
    torch.manual_seed(0)
    return MultiHeadLatentAttention(config), lambda m, x: m(x)


def _deepseek_v3_block(cfg: dict[str, Any], rank: int, ws: int) -> tuple[torch.nn.Module, Any]:
    """The stock HF DeepseekV3Attention with the same shapes; called like its decoder layer."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
    )

    config = DeepseekV3Config(
        hidden_size=cfg["hidden"],
        num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg["heads"],
        q_lora_rank=cfg["q_lora"],
        kv_lora_rank=cfg["kv_lora"],
        qk_nope_head_dim=cfg["nope"],
        qk_rope_head_dim=cfg["rope"],
        v_head_dim=cfg["v"],
        max_position_embeddings=cfg["tokens"],
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    module = DeepseekV3Attention(config, layer_idx=0)
    s_local = cfg["tokens"] // ws
    positions = torch.arange(rank * s_local, (rank + 1) * s_local)[None]
    rotary = DeepseekV3RotaryEmbedding(config)
    tables: dict[tuple, Any] = {}

    def call(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        key = (x.device, x.dtype)
        if key not in tables:  # the model computes these once per step for all layers
            tables[key] = rotary.to(x.device)(x, positions.to(x.device))
        return m(hidden_states=x, position_embeddings=tables[key], attention_mask=None)[0]

    return module, call


def _qwen3_next_block(cfg: dict[str, Any], rank: int, ws: int) -> tuple[torch.nn.Module, Any]:
    """The stock HF Qwen3NextAttention (gated, 2 kv heads, partial rotary); called like its
    decoder layer with the RoPE tables of the rank's global positions (per sequence length)."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        Qwen3NextAttention,
        Qwen3NextRotaryEmbedding,
    )

    config = Qwen3NextConfig(
        hidden_size=cfg["hidden"], num_attention_heads=cfg["heads"],
        num_key_value_heads=GATED_KV_HEADS, head_dim=GATED_HEAD_DIM,
        partial_rotary_factor=GATED_ROTARY, attention_dropout=0.0, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    module = Qwen3NextAttention(config, layer_idx=0)
    rotary = Qwen3NextRotaryEmbedding(config)
    tables: dict[tuple, Any] = {}

    def call(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]
        key = (x.device, x.dtype, s)
        if key not in tables:  # the model computes these once per step for all layers
            positions = torch.arange(rank * s, (rank + 1) * s, device=x.device)[None]
            tables[key] = rotary.to(x.device)(x, positions)
        return m(hidden_states=x, position_embeddings=tables[key], attention_mask=None)[0]

    return module, call


def _gated_link(
    cfg: dict[str, Any], base: torch.nn.Module, call: Any, mesh: Any, x: torch.Tensor
) -> list[dict[str, Any]]:
    """``parallelize_attention``'s default (overlap, ``head_groups="auto"``) vs blocking on
    the stock gated attention, interleaved under a modeled link calibrated as for MLA."""
    device = x.device
    models = {
        "overlap": parallelize_attention(copy.deepcopy(base), mesh),
        "blocking": parallelize_attention(copy.deepcopy(base), mesh, overlap=False),
    }
    g = torch.Generator().manual_seed(2 + dist.get_rank())
    s_link = cfg["link_tokens"] // dist.get_world_size()
    shape = (1, s_link, cfg["hidden"])
    xl = torch.randn(*shape, generator=g).to(device=device, dtype=x.dtype).requires_grad_()
    dyl = torch.randn(*shape, generator=g).to(device=device, dtype=x.dtype)

    def step(model: torch.nn.Module) -> None:
        for p in model.parameters():
            p.grad = None
        xl.grad = None
        call(model, xl).backward(dyl)

    pair = {name: (lambda m=m: step(m)) for name, m in models.items()}
    latency = cfg["link_latency"]
    m = measure_under_link(
        pair, "blocking", latency_s=latency, repeats=cfg["link_repeats"], device=device
    )
    launches, moved = {}, {}
    for name, fn in pair.items():
        with simulated_link(latency, m.bytes_per_s), record_events() as rec:
            fn()
        launches[name] = sum(1 for e in rec.events if e.kind == "launch" and e.phase == "forward")
        moved[name] = rec.bytes_received()
    if dist.get_rank() == 0:
        print(f"link qwen3_next: blocking {m.calibration_line()}")
    return [
        m.record(
            f"{BLOCKS['qwen3_next']}/link/overlap_vs_blocking",
            "overlap",
            device=device.type,
            head_groups=attention_head_groups(models["overlap"], xl).count,
            collectives_per_forward=launches["overlap"],
            collectives_per_forward_baseline=launches["blocking"],
            bytes_per_rank=moved["overlap"],
            repeats=cfg["link_repeats"],
            tokens=cfg["link_tokens"],
            hidden=cfg["hidden"],
            heads=cfg["heads"],
            kv_heads=GATED_KV_HEADS,
            head_dim=GATED_HEAD_DIM,
            dtype=cfg["dtype"],
        )
    ]


def _body(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    rank, ws = dist.get_rank(), dist.get_world_size()
    device = torch.device(cfg["device"])
    dtype = DTYPES[cfg["dtype"]]
    mesh = init_device_mesh(device.type, (ws,), mesh_dim_names=("cp",))
    s_local = cfg["tokens"] // ws
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(1, s_local, cfg["hidden"], generator=g).to(device=device, dtype=dtype)
    dy = torch.randn(1, s_local, cfg["hidden"], generator=g).to(device=device, dtype=dtype)
    x.requires_grad_()
    records = []
    for block in cfg["blocks"]:
        if block == "qwen3_next":  # the gated GQA attention: the modeled-link case only
            if cfg["link"]:
                gated, gated_call = _qwen3_next_block(cfg, rank, ws)
                gated = gated.to(device=device, dtype=dtype)
                records += median_of_runs(
                    [_gated_link(cfg, gated, gated_call, mesh, x) for _ in range(cfg["repeat"])]
                )
            continue
        make = _mla_block if block == "mla" else _deepseek_v3_block
        base, call = make(cfg, rank, ws)
        base = base.to(device=device, dtype=dtype)
        models = {
            name: parallelize_mla(copy.deepcopy(base), mesh, strategy=strategy, overlap=overlap)
            for name, strategy, overlap in CASES
        }
        if block == "mla" and cfg["link"]:
            for strategy in ("expanded", "latent"):
                for suffix, groups in _link_groups(cfg, ws):
                    models[f"{strategy}_overlap_{suffix}"] = parallelize_mla(
                        copy.deepcopy(base), mesh, strategy=strategy, head_groups=groups
                    )
        plain = {name for name, _, _ in CASES}
        del base

        def step(model: torch.nn.Module, call: Any = call) -> None:
            for p in model.parameters():
                p.grad = None
            x.grad = None
            call(model, x).backward(dy)

        cases = {name: (lambda m=m: step(m)) for name, m in models.items() if name in plain}
        if not cfg["link_only"]:
            records += _measure(cfg, block, cases, device, ws)
        if block == "mla" and cfg["link"]:
            # its own (shorter) sequence: each link step runs the block up to twice as long
            s_link = cfg["link_tokens"] // ws
            xl = torch.randn(1, s_link, cfg["hidden"], generator=g).to(device=device, dtype=dtype)
            dyl = torch.randn(1, s_link, cfg["hidden"], generator=g).to(device=device, dtype=dtype)
            xl.requires_grad_()

            def link_step(
                model: torch.nn.Module, call: Any = call, xl: Any = xl, dyl: Any = dyl
            ) -> None:
                for p in model.parameters():
                    p.grad = None
                xl.grad = None
                call(model, xl).backward(dyl)

            link_cases = {name: (lambda m=m: link_step(m)) for name, m in models.items()}
            groups = {
                f"{s}_overlap": mla_head_groups(models[f"{s}_overlap"], xl).count
                for s in ("expanded", "latent")
            }
            # --repeat R: R runs, each interleaving every case; the median run per record
            records += median_of_runs(
                [
                    _measure_link(cfg, block, link_cases, device, groups)
                    for _ in range(cfg["repeat"])
                ]
            )
    return records


def _link_groups(cfg: dict[str, Any], ws: int) -> list[tuple[str, Any]]:
    """The head-group counts compared under the link: those dividing the heads per rank."""
    h = cfg["heads"] // ws
    return [(s, g) for s, g in LINK_GROUPS if h % g == 0 and g in cfg["link_groups"]]


def _measure_link(
    cfg: dict[str, Any],
    block: str,
    cases: dict[str, Any],
    device: torch.device,
    auto_groups: dict[str, int],
) -> list[dict[str, Any]]:
    """Overlapped — the default (``head_groups="auto"``) and G = 1, 2, 4, 8 — vs blocking, per
    strategy, under a modeled link whose communication per step matches the blocking path's
    compute (bandwidth = blocking bytes / blocking step time); all of them interleaved."""
    records = []
    latency = cfg["link_latency"]
    for strategy in cfg["link_strategies"]:
        base = f"{strategy}_blocking"
        group_of = {f"{strategy}_overlap": auto_groups[f"{strategy}_overlap"]}
        for suffix, groups in _link_groups(cfg, dist.get_world_size()):
            group_of[f"{strategy}_overlap_{suffix}"] = int(groups)
        pair = {base: cases[base], **{name: cases[name] for name in group_of}}
        m = measure_under_link(
            pair, base, latency_s=latency, repeats=cfg["link_repeats"], device=device
        )
        launches = {}
        for name, fn in pair.items():  # collectives each forward launches, under the link
            with simulated_link(latency, m.bytes_per_s), record_events() as rec:
                fn()
            launches[name] = sum(
                1 for e in rec.events if e.kind == "launch" and e.phase == "forward"
            )
        # --split: each case's plain step (no link), for how a short figure's step splits;
        # the chunking overhead is ours' plain step less the one-group pipeline's
        one = f"{strategy}_overlap_g1"
        plain = (
            interleaved_timing(pair, repeats=cfg["link_repeats"], warmup=1, device=device)
            if cfg["split"] and one in pair
            else {}
        )
        if dist.get_rank() == 0:
            print(f"link {strategy}: blocking {m.calibration_line()}")
        for ours, groups in group_of.items():
            split = link_time_split(m, ours, base, plain, ours, one) if plain else {}
            records.append(
                m.record(
                    f"{BLOCKS[block]}/link/{ours}_vs_blocking",
                    ours,
                    device=device.type,
                    head_groups=groups,
                    collectives_per_forward=launches[ours],
                    collectives_per_forward_baseline=launches[base],
                    repeats=cfg["link_repeats"],
                    tokens=cfg["link_tokens"],
                    hidden=cfg["hidden"],
                    heads=cfg["heads"],
                    kv_lora=cfg["kv_lora"],
                    dtype=cfg["dtype"],
                    **split,
                )
            )
    return records


def _measure(
    cfg: dict[str, Any], block: str, cases: dict[str, Any], device: torch.device, ws: int
) -> list[dict[str, Any]]:
    times = interleaved_timing(cases, repeats=cfg["repeats"], warmup=cfg["warmup"], device=device)
    mem = {name: _peak_memory(fn, device) for name, fn in cases.items()}
    moved = {}
    for name, fn in cases.items():
        with record_events() as rec:
            fn()
        moved[name] = rec.bytes_received()
    # values per token each strategy moves, from the shapes (a2a of Q, K, V, O vs Q, latent, O)
    h, dq, dv = cfg["heads"], cfg["nope"] + cfg["rope"], cfg["v"]
    per_token = {
        "expanded": (h * dq * 2 + h * dv * 2) * (ws - 1) / ws,
        "latent": (h * dq + h * dv) * (ws - 1) / ws + (cfg["kv_lora"] + cfg["rope"]) * (ws - 1),
    }
    shapes = {
        k: cfg[k]
        for k in ("tokens", "hidden", "heads", "q_lora", "kv_lora", "nope", "rope", "v", "dtype")
    }
    records = []
    for name, a, b in PAIRS:
        strat_a, strat_b = a.split("_")[0], b.split("_")[0]
        records.append(
            bench_record(
                f"{BLOCKS[block]}/{name}",
                times[a],
                times[b],
                peak_mem_ours=mem[a],
                peak_mem_baseline=mem[b],
                device=device.type,
                ours=a,
                baseline=b,
                bytes_per_rank_ours=moved[a],
                bytes_per_rank_baseline=moved[b],
                bytes_ratio=moved[a] / moved[b],
                bytes_ratio_predicted=per_token[strat_a] / per_token[strat_b],
                repeats=cfg["repeats"],
                **shapes,
            )
        )
    return records


def _peak_memory(fn: Any, device: torch.device) -> int | None:
    try:
        return peak_memory_bytes(fn, device)
    except RuntimeError as exc:
        if dist.get_rank() == 0:
            print(f"peak memory not measured: {exc}")
        return None


def _config(argv: list[str] | None = None) -> tuple[dict[str, Any], str]:
    p = bench_arguments(__doc__)
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--kv-lora", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--block", choices=sorted(BLOCKS), default=None, help="default: both")
    p.add_argument("--link-latency", type=float, default=20e-6, help="modeled link latency (s)")
    p.add_argument("--no-link", action="store_true", help="skip the modeled-link comparison")
    p.add_argument(
        "--link-only", action="store_true", help="only the modeled-link comparison (this block)"
    )
    p.add_argument(
        "--world", type=int, default=None,
        help=f"ranks (default: min({WORLD}, the available cores): one core per rank)",
    )  # fmt: skip
    p.add_argument(
        "--repeat", type=int, default=1,
        help="runs of each modeled-link table, each interleaving every case; records the median",
    )  # fmt: skip
    p.add_argument(
        "--split", action="store_true",
        help="also the time split of each MLA link record (unhidden link, chunking, copies)",
    )  # fmt: skip
    p.add_argument(
        "--link-strategies", default="expanded,latent",
        help="comma-separated MLA strategies of the link table (expanded: parallelize_mla's "
        "default)",
    )  # fmt: skip
    p.add_argument(
        "--link-groups", default="1,2,4,8",
        help="comma-separated head-group counts of the MLA link table (auto is always added; "
        "'' for auto alone)",
    )  # fmt: skip
    a = p.parse_args(argv)
    link_groups = {int(g) for g in a.link_groups.split(",") if g.strip()}
    if a.split:
        link_groups.add(1)  # the split's reference: the one-group pipeline
    # tokens, hidden, heads, kv_lora, q_lora, repeats
    dims = (1024, 512, 8, 128, 192, 3) if a.quick else (4096, 1024, 16, 256, 384, 5)
    cfg = {
        "device": a.device,
        "dtype": a.dtype,
        "tokens": a.tokens or dims[0],
        "hidden": a.hidden or dims[1],
        "heads": a.heads or dims[2],
        "kv_lora": a.kv_lora or dims[3],
        "q_lora": dims[4],
        "nope": 64,
        "rope": 32,
        "v": 64,
        "repeats": a.repeats or dims[5],
        "blocks": (
            [a.block] if a.block else (["mla", "qwen3_next"] if a.link_only else list(BLOCKS))
        ),
        "warmup": 1,
        "link": not a.no_link,
        "link_only": a.link_only,
        "link_latency": a.link_latency,
        "link_tokens": min(a.tokens or dims[0], 1024 if a.quick else 2048),
        "link_repeats": a.repeats or (3 if a.quick else 5),
        "link_groups": sorted(link_groups),
        "link_strategies": [t for t in a.link_strategies.split(",") if t.strip()],
        "world": link_world(WORLD, a.world),
        "repeat": max(1, a.repeat),
        "split": a.split,
    }
    return cfg, a.out


def main(argv: list[str] | None = None) -> None:
    cfg, out = _config(argv)
    facts = run_facts(cfg["world"])
    # a loaded host is slow
    records = run_ranks(_body, cfg, world_size=cfg["world"], timeout=3600.0)
    if records is not None:  # rank 0 (or the launching process) reports
        records = [{**r, **facts} for r in records]
        write_records(out, records)
        for record in records:
            if record.get("simulated"):
                print(
                    f"{summary_line(record)}  [modeled link: latency "
                    f"{record['link_latency_s'] * 1e6:.0f} us, "
                    f"{record['link_bytes_per_s'] / 1e6:.1f} MB/s, T_link "
                    f"{record['t_link_s'] * 1e3:.1f} ms, hidden {record['hidden_fraction']:.2f}, "
                    f"runs {[round(v, 2) for v in record.get('hidden_fraction_runs', [])]}]"
                    + (
                        f"  split: unhidden {record['split_unhidden_link']:.2f}, chunking "
                        f"{record['split_chunking_overhead']:.2f}, copies "
                        f"{record['split_copies_cpu']:.2f}"
                        if "split_unhidden_link" in record
                        else ""
                    )
                )
                continue
            print(
                f"{summary_line(record)}  bytes/rank/step {record['bytes_per_rank_ours']} vs "
                f"{record['bytes_per_rank_baseline']} (x{record['bytes_ratio']:.3f}, "
                f"predicted x{record['bytes_ratio_predicted']:.3f})"
            )


if __name__ == "__main__":
    main()
