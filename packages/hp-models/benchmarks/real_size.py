"""Parameter bytes per rank of the real DeepSeek-V3 (671B) and Kimi-Linear-48B-A3B under
``parallelize_model(model, mesh, ep=..., grad_reduction="fsdp")``: measured on the placement
itself, not a formula, for thousands of ranks in one CPU process.

How: torch's fake process group (``dist.init_process_group("fake", ...)``: collectives
return at once and move nothing; an all-gather hands back this rank's own input in every
slot) stands in for ``dp·cp·tp`` ranks; the stock model is built with
every parameter on the meta device (no memory) and placed by the real ``parallelize_model``
(hp-context-parallel's MLA, hp-kda's KDA, hp-mc2's tp MLPs, hp-moe's experts over ``ep``,
FSDP2 over the meshes of :mod:`hyper_parallel.models.fsdp`); then every parameter's local
shard (``p.to_local()``) is counted, in bf16 (2 bytes per element whatever the build dtype).

Which rank: the placement is run for real on rank 0, on the last rank and on the busiest one
(the fake process group is made again for each: a new world, so hp-dtensor's mesh and group
caches start afresh); every rank's shard of every parameter is computed from rank 0's
placements with :func:`hyper_parallel.models.regions.box_of` (torch's chunk rule, the one
``to_local`` follows), and each real run must agree with that prediction (else the script
raises). hp-dtensor's consistency checks are turned off around ``parallelize_model``: under
the fake group they would compare each rank with itself. FSDP2's uneven chunks (``⌈n/k⌉``,
the last ones shorter or empty) make the ranks differ: the table gives the busiest rank (max)
and the lightest (min).

Columns (GiB = 2^30 bytes, bf16):

- ``params/rank max|min``: the local shards' bytes, busiest / lightest rank;
- ``experts/rank``: the routed experts' share of the busiest rank's bytes; ``ranks with
  experts``: how many ranks hold any routed expert weights (FSDP2 shards the stacked
  ``[E, …]`` expert tensors on dim 0, so at most ``E`` ranks hold experts, whatever ``ep``);
- ``FSDP2 alloc``: the bytes FSDP2 allocates on every rank (each shard is stored padded to the
  first chunk's size: ``FSDPParam.padded_sharded_param_size``): what a rank really holds;
- ``gathered layer``: the largest decoder layer's parameters as FSDP2 all-gathers them for its
  forward/backward (the layer's unit plus its experts' unit, each ``FSDPParam._orig_size``:
  still split over ``tp`` and ``ep``, whole over the FSDP mesh); FSDP2's prefetch may hold
  two layers at once;
- ``training state, derived``: not measured: ``FSDP2 alloc`` elements × 16 bytes, the mixed
  precision AdamW state per element (fp32 master weight, fp32 ``exp_avg`` and ``exp_avg_sq``
  and the gradient: bf16 weights + bf16 gradients + fp32 master, or hp-models' recipe of fp32
  weights with ``param_dtype=bf16`` and fp32 gradients: 16 bytes either way); activations and
  FSDP2's all-gather buffers come on top;
- ``whole``: the whole model in bf16.

Run (the default rows: about 25 s for DeepSeek-V3, 15 s for Kimi-Linear on 2 CPU cores;
``--all``: about 80 s in all)::

    python packages/hp-models/benchmarks/real_size.py [--all]
    python packages/hp-models/benchmarks/real_size.py --model deepseek-v3 --mesh 32,4,2 --ep 64

Kimi-Linear is built as published (``moonshotai/Kimi-Linear-48B-A3B-Instruct``'s
``config.json``: MLA at layers 4, 8, …, 24, 27, 1-indexed; 49.12B parameters):
``KimiLinearConfig()``'s own default puts MLA at 0-indexed 4, 8, …, 24 (6 MLA layers, not 7;
49.13B), so the published ``linear_attn_config`` is passed. ``DeepseekV3Config()``'s defaults
are the published DeepSeek-V3 (without the multi-token-prediction layer, which transformers
does not build: 671.03B).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

GIB = 2**30
BF16 = 2  # bytes per element
TRAIN_BYTES = 16  # fp32 master + 2 fp32 AdamW states + gradient, per element (derived)

# the published Kimi-Linear-48B-A3B layer pattern (1-indexed, as in its config.json)
KIMI_MLA_LAYERS = (4, 8, 12, 16, 20, 24, 27)
KIMI_LINEAR_ATTN = {
    "full_attn_layers": list(KIMI_MLA_LAYERS),
    "kda_layers": [i for i in range(1, 28) if i not in KIMI_MLA_LAYERS],
    "num_heads": 32,
    "head_dim": 128,
    "short_conv_kernel_size": 4,
}

MODELS = ("deepseek-v3", "kimi-linear")

# (model, (dp, cp, tp), ep): DeepSeek-V3 on 256 and 1024 ranks, Kimi-Linear on 16 and 64
# (the default set; --all adds EXTRA_ROWS: FSDP2's set-up time grows with the world size,
# about 6 s a placement at 1024 ranks)
DEFAULT_ROWS: list[tuple[str, tuple[int, int, int], int]] = [
    ("deepseek-v3", (32, 4, 2), 1),
    ("deepseek-v3", (32, 4, 2), 64),
    ("deepseek-v3", (8, 8, 4), 256),
    ("deepseek-v3", (128, 4, 2), 256),
    ("kimi-linear", (1, 4, 4), 1),
    ("kimi-linear", (1, 4, 4), 16),
    ("kimi-linear", (2, 8, 1), 16),
    ("kimi-linear", (4, 4, 4), 1),
    ("kimi-linear", (4, 4, 4), 64),
]
EXTRA_ROWS: list[tuple[str, tuple[int, int, int], int]] = [
    ("deepseek-v3", (32, 4, 2), 256),
    ("deepseek-v3", (128, 4, 2), 1),
    ("deepseek-v3", (32, 8, 4), 256),
    ("kimi-linear", (2, 8, 4), 64),
]


def config(name: str, **overrides: Any) -> Any:
    """The real model's config (see the module docstring), eager experts, bf16."""
    import transformers

    cfg: Any
    if name == "deepseek-v3":
        cfg = transformers.DeepseekV3Config(**overrides)
    elif name == "kimi-linear":  # the checkpoint's sub-dict, read by the config's __post_init__
        cfg = transformers.KimiLinearConfig(**{"linear_attn_config": KIMI_LINEAR_ATTN, **overrides})
    else:
        raise ValueError(f"model must be one of {MODELS}, got {name!r}")
    cfg._experts_implementation = "eager"
    cfg.dtype = torch.bfloat16
    return cfg


def build_on_meta(cfg: Any) -> torch.nn.Module:
    """The stock ``*ForCausalLM`` of ``cfg`` with every parameter (and buffer) on meta, bf16."""
    import transformers

    cls = {
        "deepseek_v3": transformers.DeepseekV3ForCausalLM,
        "kimi_linear": transformers.KimiLinearForCausalLM,
    }[cfg.model_type]
    with torch.device("meta"):
        model = cls(cfg)
    return model.to(torch.bfloat16)


def fake_world(rank: int, world: int) -> None:
    """(Re)start the default process group as torch's fake one: ``rank`` of ``world``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


def dp_cp_tp_mesh(dp: int, cp: int, tp: int) -> Any:
    from hyper_parallel.dtensor import init_device_mesh, unflatten

    world = init_device_mesh("cpu", (dp * cp * tp,), mesh_dim_names=("world",))
    return unflatten(world, "world", (dp, cp, tp), ("dp", "cp", "tp"))


def place(
    cfg: Any, dp: int, cp: int, tp: int, ep: int, rank: int, build: Any = build_on_meta
) -> torch.nn.Module:
    """This ``rank``'s model: built by ``build(cfg)`` and placed by the real
    ``parallelize_model`` (FSDP2) over a fake ``dp·cp·tp``-rank world."""
    from hyper_parallel.dtensor import consistency_checks
    from hyper_parallel.models import parallelize_model

    fake_world(rank, dp * cp * tp)
    model = build(cfg)
    # the fake group's all-gather hands every rank its own input back: the checks would
    # compare this rank with itself, so they are off
    with consistency_checks(False):
        parallelize_model(model, dp_cp_tp_mesh(dp, cp, tp), ep=ep, grad_reduction="fsdp")
    return model


def _is_expert(name: str) -> bool:
    return ".experts." in name and ".shared_experts." not in name


def local_elements(model: torch.nn.Module) -> tuple[int, int]:
    """``(all, routed experts)``: elements of this rank's local shards."""
    total = experts = 0
    for name, p in model.named_parameters():
        n = (p.to_local() if hasattr(p, "to_local") else p).numel()
        total += n
        experts += n if _is_expert(name) else 0
    return total, experts


def every_rank_elements(model: torch.nn.Module, world: int) -> tuple[list[int], list[int]]:
    """Every rank's local elements ``(all, routed experts)``, from this rank's placements
    (``box_of``, torch's chunk rule): rank ``r`` sits at the coordinate of ``r`` in each
    parameter's mesh."""
    from torch.distributed.tensor import DTensor

    from hyper_parallel.models.regions import box_of

    kinds: Counter[Any] = Counter()
    plain = [0, 0]
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            plain[0] += p.numel()
            plain[1] += p.numel() if _is_expert(name) else 0
            continue
        kinds[(tuple(p.shape), p.device_mesh, tuple(p.placements), _is_expert(name))] += 1
    total, experts = [plain[0]] * world, [plain[1]] * world
    for (shape, mesh, placements, is_expert), count in kinds.items():
        ranks = mesh.mesh
        if ranks.numel() != world:
            raise RuntimeError(f"a parameter mesh of {ranks.numel()} ranks, not all {world}")
        for r, coord in enumerate(_coords(ranks, world)):
            n = count * box_of(shape, tuple(ranks.shape), coord, placements).numel()
            total[r] += n
            experts[r] += n if is_expert else 0
    return total, experts


def _coords(ranks: torch.Tensor, world: int) -> list[tuple[int, ...]]:
    """The mesh coordinate of every global rank ``0..world-1``."""
    coords: list[tuple[int, ...]] = [()] * world
    for idx in torch.cartesian_prod(*[torch.arange(s) for s in ranks.shape]).reshape(
        -1, ranks.ndim
    ):
        c = tuple(int(i) for i in idx)
        coords[int(ranks[c])] = c
    return coords


def fsdp_elements(model: torch.nn.Module) -> tuple[int, int, int]:
    """``(allocated, largest gathered layer, unmanaged)``: the padded shards FSDP2 stores on
    every rank; the largest decoder layer's all-gathered size (its unit and the units nested
    in it); elements of parameters no FSDP2 unit manages."""
    from torch.distributed.fsdp import FSDPModule

    alloc = 0
    managed: set[int] = set()
    gathered: dict[str, int] = {}
    for mod_name, mod in model.named_modules():
        if not isinstance(mod, FSDPModule):
            continue
        group = mod._get_fsdp_state()._fsdp_param_group
        if group is None:
            continue
        for fp in group.fsdp_params:
            alloc += torch.Size(fp.padded_sharded_param_size).numel()
            managed.add(id(fp.sharded_param))
            layer = _layer_of(mod_name)
            if layer is not None:
                gathered[layer] = gathered.get(layer, 0) + torch.Size(fp._orig_size).numel()
    unmanaged = sum(p.numel() for p in model.parameters() if id(p) not in managed)
    return alloc, max(gathered.values(), default=0), unmanaged


def _layer_of(module_name: str) -> str | None:
    parts = module_name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return ".".join(parts[: i + 2])
    return None


@dataclass
class Row:
    model: str
    params: int
    mesh: tuple[int, int, int]
    ep: int
    max_rank: int
    max_elems: int
    min_elems: int
    expert_elems: int  # routed experts on the busiest rank
    expert_ranks: int  # ranks holding some routed expert weights
    alloc: int
    gathered_layer: int
    seconds: float

    @property
    def world(self) -> int:
        return self.mesh[0] * self.mesh[1] * self.mesh[2]


def measure(name: str, mesh: tuple[int, int, int], ep: int, cfg: Any = None) -> Row:
    """One row: every rank's shards from rank 0's placements, checked against the real
    placement on rank 0, the last rank and the busiest rank. ``cfg``: another config than the
    real model's (``name`` then only labels the row)."""
    start = time.perf_counter()
    cfg = config(name) if cfg is None else cfg
    dp, cp, tp = mesh
    world = dp * cp * tp
    model = place(cfg, dp, cp, tp, ep, 0)
    params = sum(p.numel() for p in model.parameters())  # DTensors: the whole tensor's
    per_rank, experts = every_rank_elements(model, world)
    alloc, gathered, unmanaged = fsdp_elements(model)
    if unmanaged:
        raise RuntimeError(f"{unmanaged} parameter elements are outside every FSDP2 unit")
    busiest = max(range(world), key=lambda r: per_rank[r])
    # the real placement on rank 0, the last rank and the busiest must hold what box_of says
    for r in sorted({0, world - 1, busiest}):
        if r:
            del model
            model = place(cfg, dp, cp, tp, ep, r)
        held = local_elements(model)
        if held != (per_rank[r], experts[r]):
            raise RuntimeError(f"rank {r} holds {held} elements, box_of says {per_rank[r]}")
        if fsdp_elements(model)[:2] != (alloc, gathered):
            raise RuntimeError(f"FSDP2's allocation differs between rank 0 and rank {r}")
    del model
    dist.destroy_process_group()
    return Row(
        model=name,
        params=params,
        mesh=mesh,
        ep=ep,
        max_rank=busiest,
        max_elems=per_rank[busiest],
        min_elems=min(per_rank),
        expert_elems=experts[busiest],
        expert_ranks=sum(1 for n in experts if n),
        alloc=alloc,
        gathered_layer=gathered,
        seconds=time.perf_counter() - start,
    )


def _gib(elements: int, per: int = BF16) -> str:
    return f"{elements * per / GIB:.2f}"


HEADER = (
    "| model | params (B) | ranks | dp, cp, tp | ep | params/rank max (GiB) | busiest rank "
    "| params/rank min (GiB) | experts/rank (GiB) | ranks with experts | FSDP2 alloc/rank (GiB) "
    "| gathered layer (GiB) | training state/rank, derived: 16 B/elem (GiB) "
    "| whole (GiB) |"
)


def table(rows: list[Row]) -> str:
    lines = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.params / 1e9:.2f} | {r.world} | {r.mesh[0]}, {r.mesh[1]}, "
            f"{r.mesh[2]} | {r.ep} | {_gib(r.max_elems)} | {r.max_rank} | {_gib(r.min_elems)} "
            f"| {_gib(r.expert_elems)} | {r.expert_ranks} | {_gib(r.alloc)} "
            f"| {_gib(r.gathered_layer)} | {_gib(r.alloc, TRAIN_BYTES)} | {_gib(r.params)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=MODELS, help="one model (default: every default row)")
    ap.add_argument("--mesh", help="dp,cp,tp (needs --model)")
    ap.add_argument("--ep", type=int, default=1, help="expert parallelism (with --mesh)")
    ap.add_argument("--all", action="store_true", help="the default rows and EXTRA_ROWS")
    a = ap.parse_args(argv)
    if a.mesh is not None:
        if a.model is None:
            ap.error("--mesh needs --model")
        dp, cp, tp = (int(x) for x in a.mesh.split(","))
        todo = [(a.model, (dp, cp, tp), a.ep)]
    else:
        rows_ = DEFAULT_ROWS + EXTRA_ROWS if a.all else DEFAULT_ROWS
        todo = sorted(
            (row for row in rows_ if a.model in (None, row[0])),
            key=lambda row: (MODELS.index(row[0]), row[1][0] * row[1][1] * row[1][2], row[2]),
        )
    rows = []
    took: dict[str, float] = {}
    for name, mesh, ep in todo:
        row = measure(name, mesh, ep)
        rows.append(row)
        took[name] = took.get(name, 0.0) + row.seconds
        print(f"# {name} {mesh} ep={ep}: {row.seconds:.1f} s", file=sys.stderr, flush=True)
    print(table(rows))
    print(file=sys.stderr)
    for name, s in took.items():
        print(f"# {name}: {s:.1f} s in all", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HP_CHECK_CONSISTENCY", "0")
    sys.exit(main())
