#!/usr/bin/env python3
"""The main job: train a stock Hugging Face ``KimiLinearForCausalLM`` (a tiny random config built
in code: KDA and MLA layers, dense MLPs) parallelised by hp-models on local ranks (every token
mixer context-parallel over the whole (cp, tp) mesh, MLPs tensor + sequence parallel over tp,
gradients summed by FSDP2), then train the unparallelised model with the same seed and data in
one process and check that the two loss curves agree. ``--model deepseek-v3`` trains a stock
``DeepseekV3ForCausalLM`` the same way.

    python examples/train_hybrid.py                       # 4 CPU ranks (cp=2 x tp=2), gloo
    python examples/train_hybrid.py --device cuda         # NCCL, one GPU per rank
    python examples/train_hybrid.py --device npu          # HCCL (torch_npu from the image)
    python examples/train_hybrid.py --mesh 4,1 --kda-protocol allgather --steps 60
    python examples/train_hybrid.py --model deepseek-v3

Started plainly, the script launches itself under torchrun (``torch.distributed.run``) on
``cp * tp`` local ranks; under torchrun it is a worker. Output (``--out``, default ``out/``):
``loss_curves.png`` (parallel vs serial), ``trace_step.json`` (Chrome / Perfetto trace of one
training step, one process per rank) and ``trace_step.png`` (the same step as a timeline per
rank), ``parallel.json`` (losses, step times, per-layer communication and time).

Exit status 0 when the curves agree within ``--tol``; otherwise non-zero with a one-line
reason: curves that disagree (a NaN counts as disagreement), a non-finite loss on any rank (the
run stops at that step and names the rank where it started), a failed rank (torchrun stops the
others; a rank stuck in a collective times out after ``--rank-timeout`` seconds), the
``--job-timeout``, Ctrl-C or SIGTERM. In every case torchrun and all its workers are ended
before the script exits (examples/_jobctl.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import _jobctl
import _report
import torch
import torch.distributed as dist
from _meter import LayerMeter
from _trace_plot import plot_trace

ROOT = Path(__file__).resolve().parent.parent

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


# ---- arguments ----------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=sorted(BACKENDS), default="cpu")
    p.add_argument("--model", choices=MODELS, default="kimi-linear")
    p.add_argument("--mesh", default="2,2", help="cp,tp (default 2,2: 4 ranks)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--layers", default="kda,mla,kda,mla",
                   help="token mixer per layer: kda / mla (deepseek-v3: mla only)")  # fmt: skip
    p.add_argument("--kda-heads", type=int, default=4)
    p.add_argument("--kda-head-dim", type=int, default=16)
    p.add_argument("--mla-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--kda-protocol", default="auto", help="auto | p2p | allgather | grouped")
    p.add_argument("--mla-strategy", default="latent", choices=["expanded", "latent"])
    p.add_argument("--no-overlap", action="store_true", help="blocking MLA collectives")
    p.add_argument("--grad-reduction", default="auto", choices=["auto", "fsdp", "allreduce"])
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tol", type=float, default=2e-3, help="max relative loss difference")
    p.add_argument("--trace-step", type=int, default=2, help="step recorded in the trace")
    p.add_argument("--out", default=str(ROOT / "out"))
    p.add_argument("--rank-timeout", type=float, default=60.0, help="collective timeout (s)")
    p.add_argument("--job-timeout", type=float, default=900.0, help="whole parallel run (s)")
    # failure drills (hidden): a rank exits at a step; a step's loss turns NaN (every rank, or
    # only --nan-rank)
    p.add_argument("--fail-rank", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--fail-step", type=int, default=3, help=argparse.SUPPRESS)
    p.add_argument("--nan-step", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--nan-rank", type=int, default=-1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        args.cp, args.tp = (int(v) for v in args.mesh.split(","))
    except ValueError:
        p.error(f"--mesh must be 'cp,tp', got {args.mesh!r}")
    if args.tp < 1 or args.cp < 1:
        p.error("--mesh sizes must be positive")
    if args.seq % (args.tp * args.cp):
        p.error(f"--seq {args.seq} must be divisible by cp*tp = {args.cp * args.tp}")
    args.mixers = [m.strip() for m in args.layers.split(",") if m.strip()]
    bad = [m for m in args.mixers if m not in ("kda", "mla")]
    if bad or not args.mixers:
        p.error(f"--layers takes kda / mla per layer, got {args.layers!r}")
    if args.model == "deepseek-v3" and "kda" in args.mixers:
        p.error("--model deepseek-v3 has MLA layers only (--layers mla,mla,...)")
    if not 0 <= args.trace_step < args.steps:
        p.error("--trace-step must be in [0, steps)")
    if args.job_timeout <= 0:
        p.error("--job-timeout must be positive")
    return args


def make_batches(args: argparse.Namespace) -> torch.Tensor:
    """``[steps, B, S]`` token ids from a fixed random Markov chain (learnable, seeded)."""
    g = torch.Generator().manual_seed(args.seed + 1234)
    trans = torch.softmax(torch.randn(args.vocab, args.vocab, generator=g) * 3.0, dim=-1)
    n = args.steps * args.batch
    toks = torch.empty(n, args.seq, dtype=torch.long)
    toks[:, 0] = torch.randint(0, args.vocab, (n,), generator=g)
    for i in range(1, args.seq):
        toks[:, i] = torch.multinomial(trans[toks[:, i - 1]], 1, generator=g).squeeze(1)
    return toks.view(args.steps, args.batch, args.seq)


# ---- the model: everything that knows which model is trained ---------------------------------
MODELS = ("kimi-linear", "deepseek-v3")


def config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The tiny config of ``--model``: the command line's sizes, dense MLPs only."""
    n = len(args.mixers)
    common: dict[str, Any] = {
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": args.ffn,
        "num_hidden_layers": n,
        "num_attention_heads": args.mla_heads,
        "num_key_value_heads": args.mla_heads,
    }
    if args.model == "deepseek-v3":
        return {**common, "first_k_dense_replace": n}
    kinds = {"kda": "linear_attention", "mla": "full_attention"}
    return {
        **common,
        "layer_types": [kinds[m] for m in args.mixers],
        "mlp_layer_types": ["dense"] * n,
        "linear_num_heads": args.kda_heads,
        "linear_head_dim": args.kda_head_dim,
    }


def build_mesh(args: argparse.Namespace, world: int) -> Any:
    """The ``("cp", "tp")`` mesh the model is parallelised over (process group initialised)."""
    from hyper_parallel.dtensor import init_device_mesh, unflatten

    root = init_device_mesh(args.device, (world,), mesh_dim_names=("world",))
    return unflatten(root, "world", (args.cp, args.tp), ("cp", "tp"))


def build_model(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """The stock Hugging Face model, seeded: ``model(input_ids=, labels=).loss``."""
    from hyper_parallel.models.testing import tiny_model

    kind = "kimi" if args.model == "kimi-linear" else "deepseek"
    dtype = getattr(torch, args.dtype)
    return tiny_model(kind, seed=args.seed, dtype=dtype, **config_overrides(args)).to(device)


def parallelize(model: torch.nn.Module, mesh: Any, args: argparse.Namespace) -> None:
    """hp-models' one call, in place."""
    from hyper_parallel.models import parallelize_model

    parallelize_model(
        model,
        mesh,
        mla_strategy=args.mla_strategy,
        overlap=not args.no_overlap,
        kda_protocol=args.kda_protocol,
        grad_reduction=args.grad_reduction,
    )


def shard_batch(tokens: torch.Tensor, mesh: Any) -> dict[str, torch.Tensor]:
    """This rank's block of a ``[B, S]`` batch (inputs, global positions, shifted labels)."""
    from hyper_parallel.models import shard_batch as shard

    return shard({"input_ids": tokens, "labels": tokens}, mesh)


def sync_gradients(model: torch.nn.Module) -> None:
    from hyper_parallel.models import sync_gradients as sync

    sync(model)


def metered_layers(model: torch.nn.Module, args: argparse.Namespace) -> list[tuple[str, Any]]:
    """``("<index>:<kind>", module)`` for each token mixer and MLP the table and trace show."""
    layers = model.model.layers
    out: list[tuple[str, Any]] = []
    for i, (layer, mixer) in enumerate(zip(layers, args.mixers)):
        out += [(f"{i}:{mixer}", layer.self_attn), (f"{i}:mlp", layer.mlp)]
    return out


class Progress:
    """A per-step progress bar (tqdm when installed, plain lines otherwise)."""

    def __init__(self, total: int, desc: str) -> None:
        try:
            from tqdm import tqdm

            self.bar: Any = tqdm(total=total, desc=desc, file=sys.stdout, dynamic_ncols=True)
        except ImportError:
            self.bar, self.desc, self.n = None, desc, 0

    def update(self, loss: float, step_s: float, tokens: int) -> None:
        info = f"loss={loss:.4f} step={step_s * 1e3:.0f}ms tok/s={tokens / step_s:,.0f}"
        if self.bar is not None:
            self.bar.set_postfix_str(info, refresh=False)
            self.bar.update(1)
        else:
            self.n += 1
            print(f"{self.desc} step {self.n}: {info}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---- the parallel worker (one per rank, under torchrun) ----------------------------------
class NonFiniteLoss(RuntimeError):
    """A rank's loss is NaN or infinite; raised on every rank at the same step."""


def _device(kind: str) -> torch.device:
    if kind == "cpu":
        torch.set_num_threads(1)
        return torch.device("cpu")
    if kind == "npu":
        import torch_npu  # noqa: F401  (from the NPU image; never pip-installed here)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    getattr(torch, kind).set_device(local)
    return torch.device(kind, local)


def _fail_file(out: Path, rank: int) -> Path:
    return out / f".rank{rank}.failed"


@dataclass
class RankRun:
    """One rank's state of the parallel run."""

    args: argparse.Namespace
    rank: int
    world: int
    device: torch.device
    mesh: Any
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    meter: LayerMeter
    batches: torch.Tensor
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    trace: dict[str, Any] = field(default_factory=dict)
    timed: dict[tuple[str, str], float] = field(default_factory=dict)


def _setup(args: argparse.Namespace, rank: int, world: int) -> RankRun:
    if world != args.tp * args.cp:
        raise ValueError(f"world size {world} != cp*tp = {args.cp * args.tp}")
    device = _device(args.device)
    dist.init_process_group(BACKENDS[args.device], timeout=timedelta(seconds=args.rank_timeout))
    mesh = build_mesh(args, world)
    model = build_model(args, device)
    parallelize(model, mesh, args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=False)
    meter = LayerMeter(metered_layers(model, args))
    return RankRun(args, rank, world, device, mesh, model, opt, meter, make_batches(args))


def checked_loss(loss: torch.Tensor, step: int, world: int) -> float:
    """The global loss (every rank holds it). Every rank sees every rank's value, so when one
    of them is not finite all ranks raise :class:`NonFiniteLoss` at this step (no rank is left
    waiting in a collective), naming the lowest rank where it appeared."""
    local = loss.detach().reshape(1).to(torch.float64)
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local)
    values = torch.cat(parts).cpu().tolist()
    bad = [r for r, v in enumerate(values) if not math.isfinite(v)]
    if bad:
        raise NonFiniteLoss(
            f"non-finite loss at step {step}, starting on rank {bad[0]} (loss {values[bad[0]]}; "
            f"non-finite on {len(bad)} of {world} ranks)"
        )
    return float(values[dist.get_rank()])


def _forward_backward(run: RankRun, step: int) -> float:
    args = run.args
    local = {k: v.to(run.device) for k, v in shard_batch(run.batches[step], run.mesh).items()}
    run.opt.zero_grad(set_to_none=True)
    loss = run.model(**local).loss
    if step == args.nan_step and args.nan_rank in (-1, run.rank):  # drill
        loss = loss * float("nan")
    loss.backward()
    run.meter.current = "grad sync"
    sync_gradients(run.model)
    run.meter.current = "other"
    return checked_loss(loss, step, run.world)


def train_step(run: RankRun, step: int) -> None:
    """One optimizer step; the step ``--trace-step`` is recorded for the trace."""
    from hyper_parallel.context_parallel import record_events

    profiling = step == run.args.trace_step
    run.meter.time.clear()
    t0 = time.perf_counter()
    with record_events() if profiling else nullcontext() as rec:
        run.meter.recorder = rec
        with run.meter if profiling else nullcontext():
            total = _forward_backward(run, step)
        run.opt.step()
        if run.args.device != "cpu":
            getattr(torch, run.args.device).synchronize()
    run.step_times.append(time.perf_counter() - t0)
    run.meter.recorder = None
    run.losses.append(total)
    if profiling:
        run.trace = rec.to_chrome_trace(pid=run.rank)
    elif step > 0:
        for key, v in run.meter.time.items():
            run.timed[key] = run.timed.get(key, 0.0) + v


def _finish(run: RankRun, out: Path) -> None:
    """Rank 0 writes parallel.json and trace_step.json from every rank's statistics."""
    args = run.args
    n_timed = max(1, sum(1 for s in range(1, args.steps) if s != args.trace_step))
    stats = {
        "bytes": run.meter.bytes,
        "time": {f"{k[0]}|{k[1]}": v / n_timed for k, v in run.timed.items()},
        "trace": run.trace,
    }
    gathered: list[Any] = [None] * run.world if run.rank == 0 else []
    dist.gather_object(stats, gathered if run.rank == 0 else None, dst=0)
    if run.rank == 0:
        _write_parallel_results(args, out, run, gathered)
    dist.barrier()
    dist.destroy_process_group()


def worker(args: argparse.Namespace) -> int:
    # hp-mc2's gated MLP returns its block as a view of the reduce-scatter output; FSDP2 warns
    # that an in-place op on it would skip its backward hook. The stock decoder layers add it
    # out of place (``residual + hidden_states``), so the warning does not apply here.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _jobctl.die_with_parent()  # torchrun gone (killed): this rank goes too
    _jobctl.pid_file(out, rank).write_text(f"{os.getpid()}\n")
    try:
        run = _setup(args, rank, world)
        bar = Progress(args.steps, f"parallel cp={args.cp} tp={args.tp}") if rank == 0 else None
        for step in range(args.steps):
            if step == args.fail_step and rank == args.fail_rank:  # drill
                _fail_file(out, rank).write_text(f"rank {rank}: injected failure at step {step}\n")
                os._exit(3)
            train_step(run, step)
            if bar is not None:
                bar.update(run.losses[-1], run.step_times[-1], args.batch * args.seq)
        if bar is not None:
            bar.close()
        _finish(run, out)
    except NonFiniteLoss as exc:
        _fail_file(out, rank).write_text(f"{exc}\n")
        print(f"rank {rank}: stopping: {exc}", file=sys.stderr, flush=True)
        dist.destroy_process_group()
        return 4
    except BaseException as exc:
        line = f"rank {rank}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        _fail_file(out, rank).write_text(line + "\n")
        raise
    return 0


def _write_parallel_results(
    args: argparse.Namespace, out: Path, run: RankRun, per_rank: list[Any]
) -> None:
    events: list[Any] = []
    for stats in per_rank:
        events.extend(stats["trace"].get("traceEvents", []))
    for r in range(len(per_rank)):
        events.append({"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"rank {r}"}})
    (out / "trace_step.json").write_text(json.dumps({"traceEvents": events,
                                                     "displayTimeUnit": "ms"}))  # fmt: skip
    rows = []
    for name in [*run.meter.names, "grad sync", "other"]:
        recv = [int(s["bytes"].get(name, 0)) for s in per_rank]
        # phases that are not timed (gradient sync, the rest) report None, not zero
        fwd = [s["time"][f"{name}|forward"] for s in per_rank if f"{name}|forward" in s["time"]]
        bwd = [s["time"][f"{name}|backward"] for s in per_rank if f"{name}|backward" in s["time"]]
        rows.append({"layer": name, "recv_bytes_per_rank": recv,
                     "fwd_s": max(fwd) if fwd else None,
                     "bwd_s": max(bwd) if bwd else None})  # fmt: skip
    record = {
        "mesh": {"tp": args.tp, "cp": args.cp},
        "losses": run.losses,
        "step_times": run.step_times,
        "layers": rows,
        "trace_step": args.trace_step,
    }
    (out / "parallel.json").write_text(json.dumps(record, indent=1))


# ---- the launcher ------------------------------------------------------------------------
def _torchrun(args: argparse.Namespace, argv: list[str]) -> tuple[list[str], dict[str, str]]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={args.tp * args.cp}", "--max-restarts=0", "--monitor-interval=0.5",
           str(Path(__file__).resolve()), *argv]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore::FutureWarning"}  # fmt: skip
    return cmd, env


def _failure_reason(out: Path, stderr_tail: list[str], rc: int) -> str:
    failed = sorted(out.glob(".rank*.failed"), key=lambda p: p.stat().st_mtime)
    if failed:
        return failed[0].read_text().strip()
    text = "".join(stderr_tail)
    m = re.search(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", text, re.S)
    if m:
        return f"rank {m.group(1)} exited with code {m.group(2)}"
    return f"torchrun exited with code {rc}"


def _launch_parallel(args: argparse.Namespace, argv: list[str]) -> tuple[int, str]:
    """Run the workers under torchrun; return (exit code, one-line reason on failure). Nothing
    of the job outlives this call (also on Ctrl-C / SIGTERM, which propagate)."""
    out = Path(args.out)
    for stale in [*out.glob(".rank*.failed"), *out.glob(".rank*.pid"), out / "parallel.json"]:
        stale.unlink(missing_ok=True)
    if args.device == "npu" and "ASCEND_RT_VISIBLE_DEVICES" not in os.environ:
        print("note: ASCEND_RT_VISIBLE_DEVICES not set; ranks use NPUs 0..N-1", flush=True)
    cmd, env = _torchrun(args, argv)
    rc, job = _jobctl.run_job(cmd, env, out, args.job_timeout)
    if rc is None:
        return 1, f"parallel run exceeded --job-timeout {args.job_timeout:g}s; torchrun and all " \
                  "ranks stopped"  # fmt: skip
    if rc == 0:
        return 0, ""
    return rc, _failure_reason(out, job.tail, rc)


def train_serial(args: argparse.Namespace) -> tuple[list[float], list[float]]:
    device = torch.device("cpu") if args.device == "cpu" else _device(args.device)
    model = build_model(args, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=False)
    batches = make_batches(args)
    bar = Progress(args.steps, "serial (1 process)")
    losses, times = [], []
    for step in range(args.steps):
        tokens = batches[step].to(device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
        bar.update(losses[-1], times[-1], args.batch * args.seq)
        if not math.isfinite(losses[-1]):
            break  # the comparison reports it
    bar.close()
    return losses, times


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def summarize(args: argparse.Namespace, record: dict[str, Any], serial: list[float],
              serial_times: list[float]) -> str:  # fmt: skip
    """Print the table, write the plots; return the reason the run failed ('' when OK)."""
    out = Path(args.out)
    parallel = record["losses"]
    rel, reason = _report.compare_curves(parallel, serial, args.tol)
    par_med, ser_med = _median(record["step_times"]), _median(serial_times)
    _report.print_layer_table(record, par_med, ser_med)
    slower = _report.slower_reason(args.device, args.tp * args.cp, par_med, ser_med)
    if slower:
        print(slower)
    png = out / "loss_curves.png"
    _report.plot_curves(png, parallel, serial, f"{args.model} {args.layers}, cp={args.cp} "
                        f"tp={args.tp}, max rel diff {rel:.1e} (tol {args.tol:.0e})")  # fmt: skip
    trace_json, trace_png = out / "trace_step.json", out / "trace_step.png"
    title = f"step {record['trace_step']}, cp={args.cp} x tp={args.tp}, {args.model} {args.layers}"
    plot_trace(json.loads(trace_json.read_text()), trace_png, title)
    print(
        f"\nloss: first {serial[0]:.4f}, last serial {serial[-1]:.4f} / parallel "
        f"{parallel[-1]:.4f}; max relative difference {rel:.2e} (tol {args.tol:.0e})"
    )
    print(f"loss curves: {png}")
    print(f"trace of step {record['trace_step']}: {trace_png} (timeline per rank); "
          f"{trace_json} (open in https://ui.perfetto.dev)")  # fmt: skip
    return reason


def launcher(args: argparse.Namespace, argv: list[str]) -> int:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("train_hybrid: FAILED: matplotlib is needed for the loss plot "
              "(pip install -r examples/requirements.txt)")  # fmt: skip
        return 1
    Path(args.out).mkdir(parents=True, exist_ok=True)
    _jobctl.raise_on_signals()
    t0 = time.perf_counter()
    try:
        rc, reason = _launch_parallel(args, argv)
        if rc != 0:
            print(f"train_hybrid: FAILED: {reason}", flush=True)
            return 1
        t_par = time.perf_counter() - t0
        record = json.loads((Path(args.out) / "parallel.json").read_text())
        serial, serial_times = train_serial(args)
        reason = summarize(args, record, serial, serial_times)
    except _jobctl.Interrupted as exc:
        print(f"train_hybrid: FAILED: interrupted by {exc} after {time.perf_counter() - t0:.0f}s;"
              " torchrun and every rank stopped", flush=True)  # fmt: skip
        return 128 + exc.signum
    print(f"parallel run {t_par:.1f} s, total {time.perf_counter() - t0:.1f} s")
    if reason:
        print(f"train_hybrid: FAILED: {reason}")
        return 1
    print("train_hybrid: OK: parallel and serial loss curves agree")
    return 0


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if "RANK" in os.environ and "LOCAL_RANK" in os.environ:
        return worker(args)
    return launcher(args, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
