#!/usr/bin/env python3
"""Train a stock Hugging Face model parallelised by hp-models: the script to copy and start from.

    torchrun --standalone --nproc-per-node 4 examples/train.py                 # cp=2 x tp=2, CPU
    torchrun --standalone --nproc-per-node 4 examples/train.py --device cuda --autocast bf16
    torchrun --standalone --nproc-per-node 2 examples/train.py --mesh 1,2 --model deepseek-v3
    torchrun --standalone --nproc-per-node 4 examples/train.py --model qwen3-next
    torchrun --standalone --nproc-per-node 4 examples/train.py --steps 80 --resume
    torchrun --standalone --nproc-per-node 4 examples/train.py --packed   # documents per row
    torchrun --standalone --nproc-per-node 4 examples/train.py --ep 2      # experts over 2 ranks
    torchrun --standalone --nproc-per-node 4 examples/train.py --experts 0 # dense MLPs only
    torchrun --standalone --nproc-per-node 4 examples/train.py --model path/to/hf-folder
    torchrun --standalone --nproc-per-node 4 examples/train.py --pp 2 --microbatches 4  # pipeline
    torchrun --standalone --nproc-per-node 4 examples/train.py --overlap forward_backward \
        --microbatches 2  # micro-batch k's forward interleaved with k-1's backward (pp = 1)

A tiny random ``KimiLinearForCausalLM`` (KDA and MLA layers), ``DeepseekV3ForCausalLM`` (MLA
layers) or ``Qwen3NextForCausalLM`` (Gated DeltaNet "gdn" and gated GQA attention "attn"
layers, 3:1 like the stock config, with ``--kv-heads`` key/value heads: fewer than the ranks)
built in code, the first ``--dense-layers`` layers with a dense MLP (Qwen3-Next's
``mlp_only_layers``) and the others with a MoE block (``--experts`` routed experts, ``--top-k``
a token, one shared expert: Qwen3-Next's behind its sigmoid gate), like the stock configs,
parallelised in one call (``parallelize_model``: the routed experts split over groups of
``--ep`` ranks); or ``--model PATH``, a Hugging Face folder of one of these families
(``config.json`` and safetensors, as downloaded or as ``save_pretrained`` writes them) loaded
by ``from_pretrained`` straight into the parallelised model, each rank reading only its own
slices. ``--pp N`` (N >= 2) cuts the model into pipeline stages instead
(``pipeline_model``: ``--schedule``, one of torch's schedules by name, ``--microbatches`` a step,
``--stages-per-rank``, ``--layer-split``), each stage parallelised over its ``--mesh`` ranks
(mesh ``("pp", [dp,] cp, tp)``), every step ``PipelinedModel.step`` on the global batch.
``--overlap``: ``on`` (default) each layer's own overlap of its exchanges with its compute,
``off`` every exchange waited at once, ``forward_backward`` (at ``--pp 1``, with
``--microbatches`` >= 2, default 2) the step cut into micro-batches whose forward and backward
interleave: micro-batch k's forward runs while micro-batch k-1's backward has an exchange in
flight and the other way round (``pipeline_model(..., overlap="forward_backward")`` over the
``([dp,] cp, tp)`` mesh, every step ``PipelinedModel.step`` on the global batch).
Trained with AdamW on a learnable synthetic token stream (examples/_data.py;
``--packed``: each row holds documents of random lengths), the routers' bias balanced after
every step (``balance_experts``, DeepSeek-V3's auxiliary-loss-free balancing;
``--balance-rate``; Kimi-Linear and DeepSeek-V3: Qwen3-Next's routers have no bias, and its
auxiliary balancing loss is off as in the stock config); gradients clipped with
``hyper_parallel.models.clip_grad_norm_``, a sharded checkpoint (``torch.distributed.checkpoint``)
every ``--save-every`` steps and at the end, ``--resume`` from the latest one. Rank 0 shows a
progress bar and writes ``<out>/losses.json`` and ``<out>/loss.png``. Swap ``build_model`` (or
``--model PATH``) and ``_data.batch`` for your model and data.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import _data
import _report
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from tqdm import tqdm

from hyper_parallel.dtensor import init_device_mesh, unflatten
from hyper_parallel.dtensor.devices import BACKENDS, bind_device
from hyper_parallel.models import (
    PipelinedModel,
    balance_experts,
    clip_grad_norm_,
    parallelize_model,
    pipeline_model,
    shard_batch,
    sync_gradients,
)
from hyper_parallel.models.pipeline import SCHEDULES
from hyper_parallel.models.pretrained import from_pretrained, load_report
from hyper_parallel.models.testing import tiny_model

# the built-in models: their default layers, and the token mixers each family has
LAYERS = {"kimi-linear": "kda,mla,kda,mla", "deepseek-v3": "mla,mla,mla,mla",
          "qwen3-next": "gdn,gdn,gdn,attn"}  # fmt: skip
MIXERS = {"kimi-linear": ("kda", "mla"), "deepseek-v3": ("mla",), "qwen3-next": ("gdn", "attn")}
# a folder's config.json model_type -> the family (train.py's --model name)
FAMILIES = {"kimi_linear": "kimi-linear", "deepseek_v3": "deepseek-v3", "qwen3_next": "qwen3-next"}
# the built-in model's sizes: a folder's config.json has its own
SHAPE = ("layers", "hidden", "ffn", "experts", "top_k", "moe_ffn", "dense_layers", "heads",
         "kv_heads", "kda_head_dim")  # fmt: skip
AMP = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}
FB = "forward_backward"
OVERLAP = ("on", "off", FB)  # --overlap: pipeline_model / parallelize_model's overlap=


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--device", choices=sorted(BACKENDS), default="cpu")
    add("--model", default="kimi-linear",
        help=f"{' / '.join(LAYERS)} (tiny, random) or PATH, a Hugging Face folder of one of "
             "these families")  # fmt: skip
    add("--layers", help="token mixer per layer: kda / mla (kimi-linear), mla (deepseek-v3), "
        "gdn / attn (qwen3-next); default: per --model, "
        + "; ".join(f"{v} ({m})" for m, v in LAYERS.items()))  # fmt: skip
    add("--mesh", help="cp,tp or dp,cp,tp (product = ranks; default 2,2); with --pp, each "
        "stage's (default 4/pp,1: pp x cp = 4 ranks)")  # fmt: skip
    add("--pp", type=int, default=1, help="pipeline stages' ranks (>= 2: pipeline_model over a "
        "(pp, [dp,] cp, tp) mesh; default 1: no pipeline)")  # fmt: skip
    add("--schedule", choices=list(SCHEDULES), default="1F1B", help="--pp: torch's schedule")
    add("--microbatches", type=int, help="--pp: micro-batches a step (default: the stages, "
        "pp x stages-per-rank); --overlap forward_backward: 2 or more (default 2)")  # fmt: skip
    add("--overlap", choices=OVERLAP, default="on", help="on: each layer overlaps its "
        "exchanges with its own compute; off: every exchange waited at once; forward_backward "
        "(--pp 1): micro-batch k's forward interleaved with k-1's backward at their exchanges, "
        "the layers' own overlap kept")  # fmt: skip
    add("--stages-per-rank", type=int, help="--pp: stages a pipeline rank holds (default 1; 2 "
        "for the interleaved and V schedules)")  # fmt: skip
    add("--layer-split", help="--pp: decoder layers a stage, e.g. 1,3 (default: balanced by "
        "each layer's active parameters)")  # fmt: skip
    add("--steps", type=int, default=40)
    add("--batch", type=int, help="sequences per step, global (default 2; --packed: dp)")
    add("--seq", type=int, default=128, help="tokens per sequence")
    add("--packed", action="store_true", help="pack documents of random lengths in each row")
    add("--hidden", type=int, default=64)
    add("--ffn", type=int, default=128, help="dense MLP width")
    add("--experts", type=int, default=8, help="routed experts per MoE layer (0: dense MLPs)")
    add("--top-k", type=int, default=2, help="routed experts a token")
    add("--moe-ffn", type=int, default=32, help="width of each expert (and the "
        "shared one, qwen3-next's gated)")  # fmt: skip
    add("--dense-layers", type=int, default=1, help="leading layers with a dense MLP "
        "(qwen3-next: its mlp_only_layers)")  # fmt: skip
    add("--ep", type=int, help="ranks splitting the experts (default: every rank)")
    add("--balance-rate", type=float, default=1e-3, help="router bias step (0: off; "
        "qwen3-next's routers have no bias)")  # fmt: skip
    add("--heads", type=int, default=4, help="attention heads (MLA, gated GQA), KDA heads, "
        "Gated DeltaNet value heads (half as many key heads)")  # fmt: skip
    add("--kv-heads", type=int, help="qwen3-next: gated attention's key/value heads (default "
        "--heads / 2: fewer than the ranks, each sent once)")  # fmt: skip
    add("--kda-head-dim", type=int, default=16, help="KDA / Gated DeltaNet head dim")
    add("--vocab", type=int, default=64, help="the data's tokens (a folder: <= its vocab)")
    add("--dtype", choices=["float32", "float64"], default="float32", help="weights")
    add("--autocast", choices=sorted(AMP), default="off")
    add("--grad-reduction", choices=["auto", "fsdp", "allreduce"], default="auto")
    add("--lr", type=float, default=3e-3)
    add("--clip", type=float, default=1.0, help="max gradient norm")
    add("--seed", type=int, default=0)
    add("--save-every", type=int, default=20, help="checkpoint period (0: at end)")
    add("--resume", action="store_true", help="start from the latest checkpoint")
    add("--out", default="out")
    add("--timeout", type=float, default=600.0, help="collective timeout (s)")
    args = p.parse_args(argv)
    piped = ("stages_per_rank", "layer_split") + ("microbatches",) * (args.overlap != FB)
    if args.pp < 1:
        p.error("--pp takes a number of pipeline ranks >= 1")
    if args.overlap == FB and args.pp > 1:
        p.error("--overlap forward_backward interleaves the micro-batches of one stage: it "
                f"runs at --pp 1, not --pp {args.pp} (pipeline stages: --overlap on)")  # fmt: skip
    if args.pp == 1 and (args.schedule != "1F1B" or any(getattr(args, o) for o in piped)):
        p.error("--schedule, --microbatches, --stages-per-rank and --layer-split configure a "
                "pipeline: give --pp (>= 2) (--microbatches at --pp 1: with --overlap "
                "forward_backward)")  # fmt: skip
    if args.overlap == FB:
        args.microbatches = 2 if args.microbatches is None else args.microbatches
        if args.microbatches < 2:
            p.error(
                "--overlap forward_backward pairs one micro-batch's forward with another's "
                f"backward: it needs --microbatches 2 or more, got {args.microbatches}"
            )
    if args.mesh is None:  # 4 ranks in all
        args.mesh = "2,2" if args.pp == 1 else f"{max(1, 4 // args.pp)},1"
    args.mesh = tuple(int(v) for v in args.mesh.split(",") if v.isdigit())
    args.folder = None if args.model in LAYERS else args.model
    args.family = args.model
    if args.folder is not None:
        if not (Path(args.folder) / "config.json").is_file():
            p.error(f"--model takes {' / '.join(LAYERS)} or a folder with a config.json")
        given = [o for o in SHAPE if getattr(args, o) != p.get_default(o)]
        if given:
            p.error(f"--{given[0].replace('_', '-')} sizes the built-in model: the folder's "
                    "config.json sizes this one")  # fmt: skip
        try:
            layout = folder_layout(args.folder)
            args.family, args.mixers, args.mlps, args.experts, args.top_k, vocab = layout
        except ValueError as exc:
            p.error(str(exc))
        args.vocab = min(args.vocab, vocab)  # the synthetic data's tokens
    else:
        args.mixers = (args.layers or LAYERS[args.model]).split(",")
    dp = args.mesh[0] if len(args.mesh) == 3 else 1
    if len(args.mesh) not in (2, 3) or min(args.mesh) < 1:
        p.error("--mesh takes cp,tp or dp,cp,tp (positive sizes)")
    if args.pp > 1:
        pipeline_options(p, args, dp)
    elif args.overlap == FB:
        microbatch_rows(p, args, dp)
    else:
        args.batch = args.batch or (dp if args.packed else 2)
    allowed = MIXERS[args.family]
    if not set(args.mixers) <= set(allowed):
        p.error(f"--layers for --model {args.family} takes {' / '.join(allowed)} per layer, got "
                f"{args.layers!r}")  # fmt: skip
    if args.kv_heads is not None and args.family != "qwen3-next":
        p.error("--kv-heads sizes --model qwen3-next's gated attention (MLA has one per head)")
    if args.folder is None:
        qwen = args.family == "qwen3-next"
        if args.kv_heads is None:
            args.kv_heads = max(1, args.heads // 2) if qwen else args.heads
        if not 1 <= args.heads <= args.hidden or args.kv_heads < 1 or args.heads % args.kv_heads:
            p.error(f"--heads takes 1 to --hidden ({args.hidden}), --kv-heads a divisor of it")
    # one packed row per dp replica (micro-batches: per replica and micro-batch, checked above)
    if args.packed and args.pp == 1 and args.overlap != FB and args.batch != dp:
        p.error(f"--packed takes one row per data-parallel replica: --batch {dp}")
    n, ranks = len(args.mixers), math.prod(args.mesh)  # ep: within a pipeline stage's ranks
    args.dims = (args.pp, *args.mesh) if args.pp > 1 else args.mesh
    args.dim_names = (("pp",) if args.pp > 1 else ()) + (("cp", "tp") if len(args.mesh) == 2
                                                         else ("dp", "cp", "tp"))  # fmt: skip
    args.ranks = math.prod(args.dims)
    if args.pp > 1:
        pipeline_split(p, args)
    if args.experts < 0 or not 0 <= args.dense_layers <= n:
        p.error(f"--experts takes a count >= 0, --dense-layers one in [0, {n}]")
    if args.folder is None:
        args.mlps = ["moe" if args.experts and i >= args.dense_layers else "dense"
                     for i in range(n)]  # fmt: skip
    args.ep = ranks if args.ep is None else args.ep
    if "moe" in args.mlps:
        if not 1 <= args.top_k <= args.experts:
            p.error(f"--top-k takes 1 to --experts ({args.experts})")
        if args.ep < 1 or ranks % args.ep or args.experts % args.ep:
            p.error(f"--ep {args.ep} must divide the {ranks} ranks and the {args.experts} "
                    "experts")  # fmt: skip
    else:
        args.ep = 1
    if not (math.isfinite(args.balance_rate) and args.balance_rate >= 0):
        p.error("--balance-rate takes a finite number >= 0")
    return args


def pipeline_options(p: argparse.ArgumentParser, args: argparse.Namespace, dp: int) -> None:
    """--pp's schedule, stages a rank, micro-batches and batch, checked by
    ``hyper_parallel.models``' own rules (its ``ValueError`` as the error) before any rank
    starts."""
    from hyper_parallel.models.pipeline.schedules import check_schedule

    spec = SCHEDULES[args.schedule]
    if args.stages_per_rank is None:  # what the schedule runs: 1, or 2 (interleaved, V)
        args.stages_per_rank = spec.per_rank or (2 if spec.multi else 1)
    if args.microbatches is None:  # one a stage: enough for every schedule
        args.microbatches = args.pp * args.stages_per_rank
    try:
        check_schedule(args.schedule, args.pp, args.stages_per_rank, args.microbatches)
    except (TypeError, ValueError) as exc:
        p.error(str(exc))
    microbatch_rows(p, args, dp)


def microbatch_rows(p: argparse.ArgumentParser, args: argparse.Namespace, dp: int) -> None:
    """The batch of a micro-batched step (``--pp`` or ``--overlap forward_backward``): a
    multiple of microbatches·dp rows (default: that many)."""
    rows = args.microbatches * dp  # PipelinedModel.step: B/m rows a micro-batch, B/(m·dp) a replica
    args.batch = args.batch or rows
    if args.packed and args.batch != rows:
        p.error(f"--packed with micro-batches takes one packed row per data-parallel replica "
                f"and micro-batch: --batch {rows}")  # fmt: skip
    if args.batch < 1 or args.batch % rows:
        p.error(f"--batch {args.batch} does not divide into microbatches·dp = "
                f"{args.microbatches}·{dp} = {rows} (each micro-batch takes B/microbatches "
                "rows, each dp replica B/(microbatches·dp) of them)")  # fmt: skip


def pipeline_split(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--layer-split (or the balanced default) against the pipeline's pp · stages-per-rank
    stages, by ``hyper_parallel.models``' own checks."""
    from hyper_parallel.models.pipeline.split import balanced_split, check_layer_split

    n, stages = len(args.mixers), args.pp * args.stages_per_rank
    try:
        if args.layer_split is None:  # the rule the default split applies: a layer a stage
            balanced_split([1.0] * n, stages)
            return
        counts = args.layer_split.split(",")
        if not all(c.strip().isdigit() for c in counts):
            p.error(f"--layer-split takes layers a stage, e.g. 2,2; got {args.layer_split!r}")
        args.layer_split = check_layer_split([int(c) for c in counts], n, stages)
    except (TypeError, ValueError) as exc:
        p.error(str(exc))


def describe_mlps(args: argparse.Namespace) -> str:
    """``dense MLPs`` or e.g. ``MLPs dense, moe, moe, moe: 8 experts, top-2, ep=4`` (Qwen3-Next:
    ``…, top-2, gated shared expert, ep=4``)."""
    if "moe" not in args.mlps:
        return "dense MLPs"
    shared = ", gated shared expert" if args.family == "qwen3-next" else ""
    return (f"MLPs {', '.join(args.mlps)}: {args.experts} experts, top-{args.top_k}{shared}, "
            f"ep={args.ep}")  # fmt: skip


def model_name(args: argparse.Namespace) -> str:
    """The family (``qwen3-next``), or a folder's name and its family (``tiny (qwen3-next)``)."""
    return args.family if args.folder is None else f"{Path(args.folder).name} ({args.family})"


def folder_layout(path: str) -> tuple[str, list[str], list[str], int, int, int]:
    """A Hugging Face folder's (family, mixers, MLPs, routed experts, experts a token, vocab
    size); ``ValueError`` for a family this script does not train."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(path)
    n = c.num_hidden_layers
    family = FAMILIES.get(c.model_type)
    if family == "kimi-linear":
        mixers = ["kda" if k == "linear_attention" else "mla" for k in c.layer_types]
        mlps = ["moe" if k == "sparse" else "dense" for k in c.mlp_layer_types]
        return family, mixers, mlps, c.num_experts, c.num_experts_per_token, c.vocab_size
    if family == "deepseek-v3":
        mlps = ["dense" if i < c.first_k_dense_replace else "moe" for i in range(n)]
        return family, ["mla"] * n, mlps, c.n_routed_experts, c.num_experts_per_tok, c.vocab_size
    if family == "qwen3-next":  # Qwen3NextDecoderLayer's rule for a MoE block
        mixers = ["gdn" if k == "linear_attention" else "attn" for k in c.layer_types]
        sparse = [i not in c.mlp_only_layers and c.num_experts > 0
                  and (i + 1) % c.decoder_sparse_step == 0 for i in range(n)]  # fmt: skip
        mlps = ["moe" if k else "dense" for k in sparse]
        return family, mixers, mlps, c.num_experts, c.num_experts_per_tok, c.vocab_size
    raise ValueError(f"{path}: a {c.model_type!r} model; this script trains "
                     f"{', '.join(FAMILIES)}")  # fmt: skip


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """The stock HF model, seeded (the same weights on every rank), tiny config: a dense MLP
    or a MoE block per layer (``args.mlps``)."""
    n, dtype = len(args.mixers), getattr(torch, args.dtype)
    sizes = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                 num_hidden_layers=n, num_attention_heads=args.heads,
                 num_key_value_heads=args.kv_heads, moe_intermediate_size=args.moe_ffn)  # fmt: skip
    experts = max(args.experts, args.top_k)  # unused where every MLP is dense
    if args.model == "deepseek-v3":
        return tiny_model("deepseek", args.seed, dtype, **sizes, n_routed_experts=experts,
                          num_experts_per_tok=args.top_k,
                          first_k_dense_replace=args.mlps.count("dense"))  # fmt: skip
    if args.model == "qwen3-next":  # GDN: half as many key heads as value heads (odd: as many)
        kinds = {"gdn": "linear_attention", "attn": "full_attention"}
        return tiny_model("qwen3-next", args.seed, dtype, **sizes, num_experts=experts,
                          num_experts_per_tok=args.top_k, decoder_sparse_step=1,
                          mlp_only_layers=[i for i, m in enumerate(args.mlps) if m == "dense"],
                          shared_expert_intermediate_size=args.moe_ffn,
                          layer_types=[kinds[m] for m in args.mixers],
                          head_dim=args.hidden // args.heads,
                          linear_num_key_heads=args.heads // (2 - args.heads % 2),
                          linear_num_value_heads=args.heads,
                          linear_key_head_dim=args.kda_head_dim,
                          linear_value_head_dim=args.kda_head_dim)  # fmt: skip
    kinds = {"kda": "linear_attention", "mla": "full_attention"}
    mlps = {"dense": "dense", "moe": "sparse"}
    return tiny_model("kimi", args.seed, dtype, **sizes, num_experts=experts,
                      num_experts_per_token=args.top_k,
                      mlp_layer_types=[mlps[m] for m in args.mlps],
                      layer_types=[kinds[m] for m in args.mixers], linear_num_heads=args.heads,
                      linear_head_dim=args.kda_head_dim)  # fmt: skip


def layer_span(layers: range) -> str:
    """``0-1`` (or ``3`` for one layer)."""
    return f"{layers.start}" if len(layers) == 1 else f"{layers.start}-{layers.stop - 1}"


def describe_pipeline(pm: PipelinedModel, mesh: Any, args: argparse.Namespace) -> str:
    """The pipeline: schedule, micro-batches, and each stage's decoder layers (``pm.layers``)
    and the ranks holding it."""
    from hyper_parallel.models.pipeline.schedules import stages_of_rank

    spec, pp, per = SCHEDULES[args.schedule], args.pp, args.stages_per_rank
    holders: dict[int, list[int]] = {}
    for r in range(pp):  # pp coordinate r: the ranks of its (dp,) cp, tp slice
        for s in stages_of_rank(spec, r, pp, per):
            holders.setdefault(s, []).extend(int(v) for v in mesh.mesh[r].flatten())
    rows = args.batch // args.microbatches
    lines = [f"pipeline: pp={pp}, schedule {args.schedule}, {args.microbatches} micro-batches of "
             f"{rows} x {args.seq} tokens a step, {per} stage{'s' * (per > 1)} a rank"]  # fmt: skip
    for s, layers in enumerate(pm.layers):
        kinds = ", ".join(args.mixers[i] for i in layers)
        lines.append(f"  stage {s}: layers {layer_span(layers)} ({kinds}) on ranks "
                     f"{', '.join(map(str, sorted(holders.get(s, []))))}")  # fmt: skip
    return "\n".join(lines)


def checkpoint_module(model: Any) -> torch.nn.Module:
    """What the checkpoints hold: the model itself, or for a pipeline one module holding this
    rank's stages' layers, embeddings, final norm and LM head under the stock names (the keys of
    ``pm.state_dict()``), so that ``get_state_dict`` maps one optimizer over
    ``pm.parameters()`` (several stages a rank too) to them; resumable at another pp."""
    if not isinstance(model, PipelinedModel):
        return model
    root, base = torch.nn.Module(), torch.nn.Module()
    root.model = base
    base.layers = torch.nn.ModuleDict()
    parts: list[Any] = model.parts
    for part, s in zip(parts, model.stages, strict=True):
        for i in model.layers[s]:
            base.layers[str(i)] = part.model.layers[i]  # type: ignore[index]
        if s == 0:
            base.embed_tokens = part.model.embed_tokens
        if s == model.num_stages - 1:
            base.norm, root.lm_head = part.model.norm, part.lm_head
    if set(root.state_dict()) != set(model.state_dict()):
        raise RuntimeError("the pipeline's stages hold state outside their layers, "
                           "embeddings, norm and head")  # fmt: skip
    return root


def autocast(args: argparse.Namespace) -> Any:
    dtype = AMP[args.autocast]
    return nullcontext() if dtype is None else torch.autocast(args.device, dtype=dtype)


def checkpoint_dir(out: Path, step: int) -> Path:
    return out / "ckpt" / f"step-{step}"


def latest_step(out: Path) -> int:
    """The last complete checkpoint's step (0: none); DCP writes ``.metadata`` last."""
    steps = [int(p.parent.name.split("-")[1]) for p in (out / "ckpt").glob("step-*/.metadata")]
    return max(steps, default=0)


def main(argv: list[str] | None = None, hooks: Any = None) -> list[float]:
    """Train; return this run's losses (on every rank). ``hooks``, for tools that watch the run
    (examples/train_hybrid.py: meters, trace, drills): ``on_model(model, mesh)``,
    ``step(step)`` (a context manager around each step), ``on_step_end(step, loss, seconds)``."""
    args = parse_args(argv)
    # hp-mc2's MLP returns a view of its reduce-scatter output; the stock decoder layers add it
    # out of place, so FSDP2's warning about in-place ops on it does not apply
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    bind_device(args.device, int(os.environ.get("LOCAL_RANK", "0")))  # torch_npu on npu
    dist.init_process_group(BACKENDS[args.device], timeout=timedelta(seconds=args.timeout))
    rank, out = dist.get_rank(), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    world = init_device_mesh(args.device, (dist.get_world_size(),), mesh_dim_names=("world",))
    names = args.dim_names  # ("pp",) dp outermost, then cp, tp
    mesh = unflatten(world, "world", args.dims, names)
    # --pp: pipeline_model's options; every other one goes to parallelize_model for each stage
    piped: dict[str, Any] = {}
    if args.pp > 1:
        piped = dict(microbatches=args.microbatches, schedule=args.schedule,
                     stages_per_rank=args.stages_per_rank,
                     layer_split=args.layer_split)  # fmt: skip
    elif args.overlap == FB:  # pp = 1: micro-batches interleaved forward/backward
        piped = dict(microbatches=args.microbatches, overlap=FB)
    # --overlap off: every layer's exchanges blocking (default: each layer overlaps its own)
    layer_overlap = {"overlap": False} if args.overlap == "off" else {}
    params = 0
    model: Any
    if args.folder is None:  # the tiny random model, parallelised in one call
        model = build_model(args).to(args.device)
        if piped:  # cut into stages (this rank's returned), each stage parallelised
            params = sum(p.numel() for p in model.parameters())  # every stage's
            model = pipeline_model(model, mesh, grad_reduction=args.grad_reduction, ep=args.ep,
                                   **piped, **layer_overlap)  # fmt: skip
        else:
            parallelize_model(model, mesh, grad_reduction=args.grad_reduction, ep=args.ep,
                              **layer_overlap)  # fmt: skip
    else:  # a Hugging Face folder, parallelised as it loads: each rank reads only its slices
        eager = args.dtype == "float64"  # grouped_mm has no float64
        model = from_pretrained(args.folder, mesh, dtype=getattr(torch, args.dtype), ep=args.ep,
                                grad_reduction=args.grad_reduction,
                                experts_implementation="eager" if eager else None,
                                **piped, **layer_overlap)  # fmt: skip
    if rank == 0:
        stock = model.parts[0] if piped else model  # a pipeline: this rank's first stage
        mine = " in rank 0's stages" if piped and not params else ""  # a pipelined folder
        params = params or sum(p.numel() for p in model.parameters())  # whole tensors, not shards
        dims = " x ".join(f"{n}={s}" for n, s in zip(names, args.dims))
        mixers = ", ".join(args.mixers)
        if "attn" in args.mixers:  # Qwen3-Next's gated GQA: key/value heads fewer than the ranks
            heads, kv = stock.config.num_attention_heads, stock.config.num_key_value_heads
            mixers += (f"; gated attention {heads} heads, {kv} key/value head{'s' * (kv > 1)} "
                       f"over {math.prod(args.mesh)} ranks")  # fmt: skip
        name = type(stock).__name__.removeprefix("FSDP")  # FSDP2's subclass of the stock one
        print(f"training {name}: {len(args.mixers)} layers ({mixers}; "
              f"{describe_mlps(args)}), {params:,} parameters{mine} ({args.dtype})\nmesh {dims} "
              f"on {args.device}; "
              f"{args.batch} x {args.seq} tokens per step{', packed documents' * args.packed}; "
              f"autocast {args.autocast}; {args.steps} steps", flush=True)  # fmt: skip
        if args.pp > 1:
            print(describe_pipeline(model, mesh, args), flush=True)
        elif args.overlap == FB:
            print(f"forward/backward overlap: {args.microbatches} micro-batches of "
                  f"{args.batch // args.microbatches} x {args.seq} tokens a step, micro-batch "
                  "k's forward interleaved with k-1's backward at their exchanges",
                  flush=True)  # fmt: skip
        if (report := load_report(model)) is not None:
            print(f"loaded {report.path} ({report.family}): rank 0 read "
                  f"{report.bytes_read:,} of {report.folder_bytes:,} bytes in "
                  f"{report.seconds:.1f} s", flush=True)  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)  # after parallelize_model
    held = checkpoint_module(model)  # what the checkpoints hold: the model, or this rank's stages
    # a pipeline's ranks hold different parameters: the optimizer's param groups by name
    # (flattened), not as a list that DCP keeps from one rank only
    sd_options = StateDictOptions(flatten_optimizer_state_dict=True) if piped else None
    # routers with a bias to balance (Kimi-Linear's, DeepSeek-V3's; Qwen3-Next's have none)
    biased = any(hasattr(m, "e_score_correction_bias") for m in held.modules())  # this rank's
    start = latest_step(out) if args.resume else 0
    if start:  # the DCP recipe of packages/hp-models/README.md (any mesh shape)
        msd, osd = get_state_dict(held, opt, options=sd_options)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(checkpoint_dir(out, start)))
        set_state_dict(held, opt, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=sd_options)  # fmt: skip
        if rank == 0:
            print(f"resumed from {checkpoint_dir(out, start)}", flush=True)
    if hooks is not None:
        hooks.on_model(model, mesh)
    losses: list[float] = []
    bar = tqdm(range(start, args.steps), desc="train", disable=rank != 0, file=sys.stdout)
    for step in bar:
        t0 = time.perf_counter()
        with hooks.step(step) if hooks is not None else nullcontext():
            if piped:  # the global batch on every rank: the stages' forwards and backwards
                batch = {k: v.to(args.device) for k, v in _data.batch(args, step).items()}
                with autocast(args):
                    loss = model.step(**batch)  # the whole batch's loss, on every rank
            else:
                batch = shard_batch(_data.batch(args, step), mesh)  # the whole batch, every rank
                with autocast(args):
                    loss = model(**{k: v.to(args.device) for k, v in batch.items()}).loss
                loss.backward()
            sync_gradients(model)  # a no-op under FSDP2 (it reduces during backward)
            clip_grad_norm_(model, args.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if args.balance_rate and biased:  # by the whole batch's routing
                balance_experts(model, args.balance_rate)
            losses.append(loss.item())  # the loss of the whole batch, the same on every rank
        seconds = time.perf_counter() - t0
        if hooks is not None:
            hooks.on_step_end(step, losses[-1], seconds)
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"loss is {losses[-1]} at step {step}")
        bar.set_postfix_str(f"loss={losses[-1]:.4f} tok/s={args.batch * args.seq / seconds:,.0f}")
        if step + 1 == args.steps or (args.save_every and (step + 1) % args.save_every == 0):
            msd, osd = get_state_dict(held, opt, options=sd_options)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(checkpoint_dir(out, step + 1)))
    if rank == 0:
        (out / "losses.json").write_text(json.dumps({"first_step": start, "losses": losses}))
        _report.plot_loss(out / "loss.png", start, losses, f"{model_name(args)}, mesh {args.dims}")
        print(f"checkpoint: {checkpoint_dir(out, args.steps)}; loss curve: {out / 'loss.png'}")
    dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    main()
