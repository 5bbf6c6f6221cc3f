#!/usr/bin/env python3
"""Train a stock Hugging Face model parallelised by hp-models: the script to copy and start from.

    torchrun --standalone --nproc-per-node 4 examples/train.py                 # cp=2 x tp=2, CPU
    torchrun --standalone --nproc-per-node 4 examples/train.py --device cuda --autocast bf16
    torchrun --standalone --nproc-per-node 2 examples/train.py --mesh 1,2 --model deepseek-v3
    torchrun --standalone --nproc-per-node 4 examples/train.py --steps 80 --resume

A tiny random ``KimiLinearForCausalLM`` (KDA and MLA layers, dense MLPs) or
``DeepseekV3ForCausalLM`` (MLA layers) built in code, parallelised in one call
(``parallelize_model``), trained with AdamW on a learnable synthetic token stream; gradients
clipped with ``hyper_parallel.models.clip_grad_norm_``, a sharded checkpoint
(``torch.distributed.checkpoint``) every ``--save-every`` steps and at the end, ``--resume`` from
the latest one. Rank 0 shows a progress bar and writes ``<out>/losses.json`` and
``<out>/loss.png``. Swap ``build_model`` and ``make_batches`` for your model and data.
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

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from tqdm import tqdm

from hyper_parallel.dtensor import init_device_mesh, unflatten
from hyper_parallel.models import clip_grad_norm_, parallelize_model, shard_batch, sync_gradients
from hyper_parallel.models.testing import tiny_model

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
LAYERS = {"kimi-linear": "kda,mla,kda,mla", "deepseek-v3": "mla,mla,mla,mla"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=sorted(BACKENDS), default="cpu")
    p.add_argument("--model", choices=sorted(LAYERS), default="kimi-linear")
    p.add_argument("--layers", help="token mixer per layer, kda / mla (default: per --model)")
    p.add_argument("--mesh", default="2,2", help="cp,tp or dp,cp,tp (product = ranks)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=2, help="sequences per step (global)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--heads", type=int, default=4, help="MLA heads (and KDA heads)")
    p.add_argument("--kda-head-dim", type=int, default=16)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32", help="weights")
    p.add_argument("--autocast", choices=["off", "bf16", "fp16"], default="off")
    p.add_argument("--grad-reduction", choices=["auto", "fsdp", "allreduce"], default="auto")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip", type=float, default=1.0, help="max gradient norm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=20, help="checkpoint period (0: at end)")
    p.add_argument("--resume", action="store_true", help="start from the latest checkpoint")
    p.add_argument("--out", default="out")
    p.add_argument("--timeout", type=float, default=600.0, help="collective timeout (s)")
    args = p.parse_args(argv)
    args.mesh = tuple(int(v) for v in args.mesh.split(",") if v.isdigit())
    args.mixers = (args.layers or LAYERS[args.model]).split(",")
    if len(args.mesh) not in (2, 3) or min(args.mesh) < 1:
        p.error("--mesh takes cp,tp or dp,cp,tp (positive sizes)")
    if not set(args.mixers) <= {"kda", "mla"}:
        p.error(f"--layers takes kda / mla per layer, got {args.layers!r}")
    if args.model == "deepseek-v3" and set(args.mixers) != {"mla"}:
        p.error("--model deepseek-v3 has MLA layers only")
    return args


def build_mesh(args: argparse.Namespace) -> Any:
    """``("cp", "tp")``, or ``("dp", "cp", "tp")`` with data parallelism outermost."""
    world = init_device_mesh(args.device, (dist.get_world_size(),), mesh_dim_names=("world",))
    names = ("cp", "tp") if len(args.mesh) == 2 else ("dp", "cp", "tp")
    return unflatten(world, "world", args.mesh, names)


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """The stock HF model, seeded (the same weights on every rank), tiny config, dense MLPs."""
    n = len(args.mixers)
    sizes = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                 num_hidden_layers=n, num_attention_heads=args.heads,
                 num_key_value_heads=args.heads)  # fmt: skip
    if args.model == "deepseek-v3":
        return tiny_model("deepseek", args.seed, getattr(torch, args.dtype), **sizes,
                          first_k_dense_replace=n)  # fmt: skip
    kinds = {"kda": "linear_attention", "mla": "full_attention"}
    return tiny_model("kimi", args.seed, getattr(torch, args.dtype), **sizes,
                      layer_types=[kinds[m] for m in args.mixers], mlp_layer_types=["dense"] * n,
                      linear_num_heads=args.heads, linear_head_dim=args.kda_head_dim)  # fmt: skip


def make_batch(args: argparse.Namespace, step: int) -> torch.Tensor:
    """Step ``step``'s ``[batch, seq]`` token ids: a fixed random Markov chain (learnable),
    seeded by ``--seed`` and the step alone (a resumed or longer run sees the same stream)."""
    g = torch.Generator().manual_seed(args.seed + 1234)
    trans = torch.softmax(torch.randn(args.vocab, args.vocab, generator=g) * 3.0, dim=-1)
    g.manual_seed(args.seed * 1_000_003 + step)
    toks = torch.empty(args.batch, args.seq, dtype=torch.long)
    toks[:, 0] = torch.randint(0, args.vocab, (args.batch,), generator=g)
    for i in range(1, args.seq):
        toks[:, i] = torch.multinomial(trans[toks[:, i - 1]], 1, generator=g).squeeze(1)
    return toks


def autocast(args: argparse.Namespace) -> Any:
    if args.autocast == "off":
        return nullcontext()
    return torch.autocast(args.device, dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[
        args.autocast])  # fmt: skip


def describe(model: torch.nn.Module, mesh: Any, args: argparse.Namespace) -> str:
    params = sum(p.numel() for p in model.parameters())
    dims = " x ".join(f"{n}={s}" for n, s in zip(mesh.mesh_dim_names, mesh.shape))
    return (f"training {type(model).__name__}: {len(args.mixers)} layers "
            f"({', '.join(args.mixers)}; dense MLPs), {params:,} parameters ({args.dtype})\n"
            f"mesh {dims} on {args.device}; {args.batch} x {args.seq} tokens per step; "
            f"autocast {args.autocast}; {args.steps} steps")  # fmt: skip


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
    if args.device == "npu":
        import torch_npu  # noqa: F401  (from the NPU image; never pip-installed)
    if args.device != "cpu":
        getattr(torch, args.device).set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(BACKENDS[args.device], timeout=timedelta(seconds=args.timeout))
    rank, out = dist.get_rank(), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mesh = build_mesh(args)
    model = build_model(args).to(args.device)
    if rank == 0:
        print(describe(model, mesh, args), flush=True)
    parallelize_model(model, mesh, grad_reduction=args.grad_reduction)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)  # after parallelize_model
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
            tokens = make_batch(args, step)  # the whole batch, the same on every rank
            batch = shard_batch({"input_ids": tokens, "labels": tokens}, mesh)
            with autocast(args):
                loss = model(**{k: v.to(args.device) for k, v in batch.items()}).loss
            loss.backward()
            sync_gradients(model)  # a no-op under FSDP2 (it reduces during backward)
            clip_grad_norm_(model, args.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
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
        write_outputs(out, start, losses, args)
    dist.destroy_process_group()
    return losses


def write_outputs(out: Path, start: int, losses: list[float], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (out / "losses.json").write_text(json.dumps({"first_step": start, "losses": losses}))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(start + 1, start + len(losses) + 1), losses, marker=".")
    ax.set(xlabel="step", ylabel="loss", title=f"{args.model}, mesh {args.mesh}")
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=110)
    print(f"checkpoint: {checkpoint_dir(out, args.steps)}; loss curve: {out / 'loss.png'}")


if __name__ == "__main__":
    main()
