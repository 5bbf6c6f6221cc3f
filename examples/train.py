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
slices. Trained with AdamW on a learnable synthetic token stream (examples/_data.py;
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
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from tqdm import tqdm

from hyper_parallel.dtensor import init_device_mesh, unflatten
from hyper_parallel.dtensor.devices import BACKENDS, bind_device
from hyper_parallel.models import (
    balance_experts,
    clip_grad_norm_,
    parallelize_model,
    shard_batch,
    sync_gradients,
)
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
    add("--mesh", default="2,2", help="cp,tp or dp,cp,tp (product = ranks)")
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
    args.batch = args.batch or (dp if args.packed else 2)
    if len(args.mesh) not in (2, 3) or min(args.mesh) < 1:
        p.error("--mesh takes cp,tp or dp,cp,tp (positive sizes)")
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
    if args.packed and args.batch != dp:  # shard_batch: one packed row per dp replica
        p.error(f"--packed takes one row per data-parallel replica: --batch {dp}")
    n, ranks = len(args.mixers), math.prod(args.mesh)
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
    names = ("cp", "tp") if len(args.mesh) == 2 else ("dp", "cp", "tp")  # dp outermost
    mesh = unflatten(world, "world", args.mesh, names)
    if args.folder is None:  # the tiny random model, parallelised in one call
        model = build_model(args).to(args.device)
        parallelize_model(model, mesh, grad_reduction=args.grad_reduction, ep=args.ep)
    else:  # a Hugging Face folder, parallelised as it loads: each rank reads only its slices
        eager = args.dtype == "float64"  # grouped_mm has no float64
        model = from_pretrained(args.folder, mesh, dtype=getattr(torch, args.dtype), ep=args.ep,
                                grad_reduction=args.grad_reduction,
                                experts_implementation="eager" if eager else None)  # fmt: skip
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())  # whole tensors, not shards
        dims = " x ".join(f"{n}={s}" for n, s in zip(names, args.mesh))
        mixers = ", ".join(args.mixers)
        if "attn" in args.mixers:  # Qwen3-Next's gated GQA: key/value heads fewer than the ranks
            heads, kv = model.config.num_attention_heads, model.config.num_key_value_heads
            mixers += (f"; gated attention {heads} heads, {kv} key/value head{'s' * (kv > 1)} "
                       f"over {math.prod(args.mesh)} ranks")  # fmt: skip
        name = type(model).__name__.removeprefix("FSDP")  # FSDP2's subclass of the stock one
        print(f"training {name}: {len(args.mixers)} layers ({mixers}; "
              f"{describe_mlps(args)}), {params:,} parameters ({args.dtype})\nmesh {dims} on "
              f"{args.device}; "
              f"{args.batch} x {args.seq} tokens per step{', packed documents' * args.packed}; "
              f"autocast {args.autocast}; {args.steps} steps", flush=True)  # fmt: skip
        if (report := load_report(model)) is not None:
            print(f"loaded {report.path} ({report.family}): rank 0 read "
                  f"{report.bytes_read:,} of {report.folder_bytes:,} bytes in "
                  f"{report.seconds:.1f} s", flush=True)  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)  # after parallelize_model
    # routers with a bias to balance (Kimi-Linear's, DeepSeek-V3's; Qwen3-Next's have none)
    biased = any(hasattr(m, "e_score_correction_bias") for m in model.modules())
    start = latest_step(out) if args.resume else 0
    if start:  # the DCP recipe of packages/hp-models/README.md (any mesh shape)
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(checkpoint_dir(out, start)))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if rank == 0:
            print(f"resumed from {checkpoint_dir(out, start)}", flush=True)
    if hooks is not None:
        hooks.on_model(model, mesh)
    losses: list[float] = []
    bar = tqdm(range(start, args.steps), desc="train", disable=rank != 0, file=sys.stdout)
    for step in bar:
        t0 = time.perf_counter()
        with hooks.step(step) if hooks is not None else nullcontext():
            batch = shard_batch(_data.batch(args, step), mesh)  # the whole batch on every rank
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
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(checkpoint_dir(out, step + 1)))
    if rank == 0:
        (out / "losses.json").write_text(json.dumps({"first_step": start, "losses": losses}))
        _report.plot_loss(out / "loss.png", start, losses, f"{model_name(args)}, mesh {args.mesh}")
        print(f"checkpoint: {checkpoint_dir(out, args.steps)}; loss curve: {out / 'loss.png'}")
    dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    main()
