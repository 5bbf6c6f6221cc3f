#!/usr/bin/env python3
"""The main job: train a small Kimi-Linear-style hybrid model (KDA, MLA and MLP layers) with
tensor + sequence parallelism (hp-mc2) and context parallelism (hp-context-parallel for MLA,
hp-kda-kernels for KDA) on local ranks, then train the serial model with the same seed and data
in one process and check that the two loss curves agree.

    python examples/train_hybrid.py                       # 4 CPU ranks (tp=2 x cp=2), gloo
    python examples/train_hybrid.py --device cuda         # NCCL, one GPU per rank
    python examples/train_hybrid.py --device npu          # HCCL (torch_npu from the image)
    python examples/train_hybrid.py --mesh 1,4 --kda-protocol allgather --steps 60

Started plainly, the script launches itself under torchrun (``torch.distributed.run``) on
``tp * cp`` local ranks; under torchrun it is a worker. Output (``--out``, default ``out/``):
``loss_curves.png`` (parallel vs serial), ``trace_step.json`` (Chrome / Perfetto trace of one
training step, one process per rank), ``parallel.json`` (losses, step times, per-layer
communication and time). Exit status 0 when the curves agree within ``--tol``; otherwise 1 with
a one-line reason, also when a rank fails (torchrun stops the other ranks; a rank stuck in a
collective times out after ``--rank-timeout`` seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "integration"))  # the hybrid model lives with its tests

import _hybrid_model as hm  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


# ---- arguments ----------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=sorted(BACKENDS), default="cpu")
    p.add_argument("--mesh", default="2,2", help="tp,cp (default 2,2: 4 ranks)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--layers", default="kda,mlp,kda,mlp,mla,mlp", help="kda / mla / mlp list")
    p.add_argument("--kda-heads", type=int, default=4)
    p.add_argument("--kda-head-dim", type=int, default=16)
    p.add_argument("--mla-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--kda-protocol", default="auto", help="auto | p2p | allgather | grouped")
    p.add_argument("--mla-strategy", default="latent", choices=["expanded", "latent"])
    p.add_argument("--no-overlap", action="store_true", help="blocking MLA collectives")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tol", type=float, default=2e-3, help="max relative loss difference")
    p.add_argument("--trace-step", type=int, default=2, help="step recorded in the trace")
    p.add_argument("--out", default=str(ROOT / "out"))
    p.add_argument("--rank-timeout", type=float, default=60.0, help="collective timeout (s)")
    p.add_argument("--job-timeout", type=float, default=900.0, help="whole parallel run (s)")
    p.add_argument("--fail-rank", type=int, default=-1, help=argparse.SUPPRESS)  # failure drill
    p.add_argument("--fail-step", type=int, default=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        args.tp, args.cp = (int(v) for v in args.mesh.split(","))
    except ValueError:
        p.error(f"--mesh must be 'tp,cp', got {args.mesh!r}")
    if args.tp < 1 or args.cp < 1:
        p.error("--mesh sizes must be positive")
    if args.seq % (args.tp * args.cp):
        p.error(f"--seq {args.seq} must be divisible by tp*cp = {args.tp * args.cp}")
    if not 0 <= args.trace_step < args.steps:
        p.error("--trace-step must be in [0, steps)")
    return args


def config_of(args: argparse.Namespace) -> hm.HybridConfig:
    return hm.HybridConfig(
        hidden=args.hidden,
        ffn=args.ffn,
        layers=tuple(s.strip() for s in args.layers.split(",") if s.strip()),
        kda_heads=args.kda_heads,
        kda_head_dim=args.kda_head_dim,
        kda_chunk_size=min(64, args.seq // (args.tp * args.cp)),
        mla_heads=args.mla_heads,
        vocab=args.vocab,
    )


def make_batches(args: argparse.Namespace) -> torch.Tensor:
    """``[steps, B, S + 1]`` token ids from a fixed random Markov chain (learnable, seeded)."""
    g = torch.Generator().manual_seed(args.seed + 1234)
    trans = torch.softmax(torch.randn(args.vocab, args.vocab, generator=g) * 3.0, dim=-1)
    n = args.steps * args.batch
    toks = torch.empty(n, args.seq + 1, dtype=torch.long)
    toks[:, 0] = torch.randint(0, args.vocab, (n,), generator=g)
    for i in range(1, args.seq + 1):
        toks[:, i] = torch.multinomial(trans[toks[:, i - 1]], 1, generator=g).squeeze(1)
    return toks.view(args.steps, args.batch, args.seq + 1)


def build_model(args: argparse.Namespace, device: torch.device) -> hm.HybridLM:
    torch.manual_seed(args.seed)
    return hm.HybridLM(config_of(args)).to(device=device, dtype=getattr(torch, args.dtype))


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


# ---- per-layer time and communication ----------------------------------------------------
class _Stamp(torch.autograd.Function):
    """Identity that calls ``hook`` when its gradient passes (marks a layer's backward)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, hook: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.hook = hook
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.hook()
        return grad, None


class LayerMeter(TorchDispatchMode):
    """Per-layer forward/backward wall time (every step) and bytes received from peers by
    this rank's collectives (while the dispatch mode is on), attributed to the layer running.

    Bytes are what a rank receives in a direct exchange: all-gather ``(P-1)`` shards,
    reduce-scatter ``(P-1)`` shard-sized partials, all-to-all ``(P-1)/P`` of the output,
    recv and non-root broadcast the tensor, all-reduce ``(P-1)`` copies."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.names: list[str] = []
        self.time: dict[tuple[str, str], float] = {}
        self.bytes: dict[str, int] = {}
        self.current = "other"
        self.recorder: Any = None
        self._t: dict[tuple[str, str], float] = {}
        for i, layer in enumerate(m for m in model.modules() if isinstance(m, hm.Residual)):
            name = f"{i}:{layer.kind}"
            self.names.append(name)
            layer.register_forward_pre_hook(self._pre(name))
            layer.register_forward_hook(self._post(name))

    def _mark(self, name: str, phase: str, begin: bool) -> None:
        now = time.perf_counter()
        if begin:
            self._t[(name, phase)] = now
            self.current = name
        else:
            key = (name, phase)
            self.time[key] = self.time.get(key, 0.0) + now - self._t.pop(key, now)
            self.current = "other"
        if self.recorder is not None:
            self.recorder.add("begin" if begin else "end", f"layer {name}", phase)

    def _pre(self, name: str) -> Any:
        def hook(_m: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
            self._mark(name, "forward", True)
            x = _Stamp.apply(args[0], lambda: self._mark(name, "backward", False))
            return (x, *args[1:])

        return hook

    def _post(self, name: str) -> Any:
        def hook(_m: Any, _a: Any, out: torch.Tensor) -> torch.Tensor:
            self._mark(name, "forward", False)
            return _Stamp.apply(out, lambda: self._mark(name, "backward", True))

        return hook

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if name.startswith("c10d."):
            n = _received_bytes(name, args)
            if n:
                self.bytes[self.current] = self.bytes.get(self.current, 0) + n
        return out


def _received_bytes(op: str, args: Any) -> int:
    pg = None
    for a in args:  # the process group arrives as a TorchScript object
        if type(a).__name__ == "ScriptObject":
            try:
                pg = torch._C._distributed_c10d.ProcessGroup.unbox(a)
                break
            except Exception:
                continue
    ws = pg.size() if pg is not None else 1

    def nbytes(t: Any) -> int:
        if isinstance(t, torch.Tensor):
            return t.numel() * t.element_size()
        return sum(nbytes(x) for x in t) if isinstance(t, list | tuple) else 0

    if "_allgather_base_" in op:
        return nbytes(args[0]) - nbytes(args[1])
    if "_reduce_scatter_base_" in op:
        return nbytes(args[1]) - nbytes(args[0])
    if "alltoall_base_" in op:
        return nbytes(args[0]) * (ws - 1) // ws
    if "allgather_" in op or "alltoall_" in op:
        return nbytes(args[0]) * (ws - 1) // ws
    if "reduce_scatter_" in op:
        return nbytes(args[1]) * (ws - 1) // ws
    if "recv_" in op:
        return nbytes(args[0])
    if "broadcast_" in op:
        root = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
        return 0 if pg is None or pg.rank() == root else nbytes(args[0])
    if "allreduce_" in op:
        return nbytes(args[0]) * (ws - 1)
    return 0


# ---- the parallel worker (one per rank, under torchrun) ----------------------------------
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


def worker(args: argparse.Namespace) -> None:
    from hyper_parallel.context_parallel import record_events
    from hyper_parallel.dtensor import init_device_mesh, unflatten

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = Path(args.out)
    try:
        if world != args.tp * args.cp:
            raise ValueError(f"world size {world} != tp*cp = {args.tp * args.cp}")
        device = _device(args.device)
        dist.init_process_group(BACKENDS[args.device], timeout=timedelta(seconds=args.rank_timeout))
        root = init_device_mesh(args.device, (world,), mesh_dim_names=("world",))
        mesh = unflatten(root, "world", (args.tp, args.cp), ("tp", "cp"))
        model = build_model(args, device)
        hm.parallelize_hybrid(
            model,
            mesh,
            mla_strategy=args.mla_strategy,
            mla_overlap=not args.no_overlap,
            kda_protocol=args.kda_protocol,
        )
        meter = LayerMeter(model)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=False)
        batches = make_batches(args)
        n_targets = args.batch * args.seq
        bar = Progress(args.steps, f"parallel tp={args.tp} cp={args.cp}") if rank == 0 else None
        losses: list[float] = []
        step_times: list[float] = []
        trace: dict[str, Any] = {}
        timed: dict[tuple[str, str], float] = {}
        for step in range(args.steps):
            if step == args.fail_step and rank == args.fail_rank:
                _fail_file(out, rank).write_text(f"rank {rank}: injected failure at step {step}\n")
                os._exit(3)
            tokens = batches[step]
            inp = hm.shard_tokens(tokens[:, :-1], mesh).to(device)
            tgt = hm.shard_tokens(tokens[:, 1:], mesh).to(device)
            profiling = step == args.trace_step
            meter.time.clear()
            t0 = time.perf_counter()
            with record_events() if profiling else _null() as rec:
                meter.recorder = rec
                with meter if profiling else _null():
                    opt.zero_grad(set_to_none=True)
                    logits = model(inp)
                    loss = F.cross_entropy(logits.flatten(0, 1).float(), tgt.flatten(),
                                           reduction="sum") / n_targets  # fmt: skip
                    loss.backward()
                    meter.current = "grad sync"
                    hm.sync_gradients(model, mesh)
                    meter.current = "other"
                opt.step()
                total = loss.detach().clone()
                dist.all_reduce(total)
                if args.device != "cpu":
                    getattr(torch, args.device).synchronize()
            dt = time.perf_counter() - t0
            meter.recorder = None
            if profiling:
                trace = rec.to_chrome_trace(pid=rank)
            elif step > 0:
                for key, v in meter.time.items():
                    timed[key] = timed.get(key, 0.0) + v
            losses.append(total.item())
            step_times.append(dt)
            if bar is not None:
                bar.update(losses[-1], dt, args.batch * args.seq)
        if bar is not None:
            bar.close()
        n_timed = max(1, sum(1 for s in range(1, args.steps) if s != args.trace_step))
        stats = {
            "bytes": meter.bytes,
            "time": {f"{k[0]}|{k[1]}": v / n_timed for k, v in timed.items()},
            "trace": trace,
        }
        gathered: list[Any] = [None] * world if rank == 0 else []
        dist.gather_object(stats, gathered if rank == 0 else None, dst=0)
        if rank == 0:
            _write_parallel_results(args, out, losses, step_times, meter.names, gathered)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:
        line = f"rank {rank}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        _fail_file(out, rank).write_text(line + "\n")
        raise


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _write_parallel_results(
    args: argparse.Namespace,
    out: Path,
    losses: list[float],
    step_times: list[float],
    names: list[str],
    per_rank: list[Any],
) -> None:
    events: list[Any] = []
    for stats in per_rank:
        events.extend(stats["trace"].get("traceEvents", []))
    for r in range(len(per_rank)):
        events.append({"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"rank {r}"}})
    (out / "trace_step.json").write_text(json.dumps({"traceEvents": events,
                                                     "displayTimeUnit": "ms"}))  # fmt: skip
    rows = []
    for name in [*names, "grad sync", "other"]:
        recv = [int(s["bytes"].get(name, 0)) for s in per_rank]
        # phases that are not timed (gradient sync, the rest) report None, not zero
        fwd = [s["time"][f"{name}|forward"] for s in per_rank if f"{name}|forward" in s["time"]]
        bwd = [s["time"][f"{name}|backward"] for s in per_rank if f"{name}|backward" in s["time"]]
        rows.append({"layer": name, "recv_bytes_per_rank": recv,
                     "fwd_s": max(fwd) if fwd else None,
                     "bwd_s": max(bwd) if bwd else None})  # fmt: skip
    record = {
        "mesh": {"tp": args.tp, "cp": args.cp},
        "losses": losses,
        "step_times": step_times,
        "layers": rows,
        "trace_step": args.trace_step,
    }
    (out / "parallel.json").write_text(json.dumps(record, indent=1))


# ---- the launcher ------------------------------------------------------------------------
def _launch_parallel(args: argparse.Namespace, argv: list[str]) -> tuple[int, str]:
    """Run the workers under torchrun; return (exit code, one-line reason on failure)."""
    out = Path(args.out)
    for stale in [*out.glob(".rank*.failed"), out / "parallel.json"]:
        stale.unlink(missing_ok=True)
    nproc = args.tp * args.cp
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "--max-restarts=0", "--monitor-interval=0.5",
           str(Path(__file__).resolve()), *argv]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore::FutureWarning"}  # fmt: skip
    if args.device == "npu" and "ASCEND_RT_VISIBLE_DEVICES" not in env:
        print("note: ASCEND_RT_VISIBLE_DEVICES not set; ranks use NPUs 0..N-1", flush=True)
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    tail: list[str] = []

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            sys.stderr.write(line)
            tail.append(line)
            del tail[:-200]

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=args.job_timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return 1, f"parallel run exceeded --job-timeout {args.job_timeout:.0f}s; all ranks killed"
    reader.join(timeout=5)
    if rc == 0:
        return 0, ""
    failed = sorted(out.glob(".rank*.failed"), key=lambda p: p.stat().st_mtime)
    if failed:
        return rc, failed[0].read_text().strip()
    text = "".join(tail)
    m = re.search(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", text, re.S)
    if m:
        return rc, f"rank {m.group(1)} exited with code {m.group(2)}"
    return rc, f"torchrun exited with code {rc}"


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
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
        bar.update(losses[-1], times[-1], args.batch * args.seq)
    bar.close()
    return losses, times


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def print_layer_table(record: dict[str, Any], parallel_s: float, serial_s: float) -> None:
    mesh = record["mesh"]
    print(
        f"\nper layer, one step (tp={mesh['tp']} x cp={mesh['cp']}; bytes each rank receives "
        "from its peers, counted on the traced step; time: slowest rank, mean over steps)"
    )
    head = f"{'layer':<12} {'parallelism':<42} {'recv/rank (max)':>16} {'total recv':>12} " \
           f"{'fwd ms':>8} {'bwd ms':>8}"  # fmt: skip
    print(head)
    print("-" * len(head))
    how = {
        "kda": "KDA state exchange over cp",
        "mla": "Ulysses MLA over cp",
        "mlp": "MC2 TP+SP over tp",
        "grad sync": "all-reduce (world / cp)",
        "other": "embedding, head, loss",
    }
    for row in record["layers"]:
        kind = row["layer"].split(":")[-1]
        par = how.get(kind, "")
        if kind in ("kda", "mla") and mesh["tp"] > 1:
            par += " + tp gather"
        recv = row["recv_bytes_per_rank"]
        fwd, bwd = (
            f"{row[k] * 1e3:.1f}" if row[k] is not None else "-" for k in ("fwd_s", "bwd_s")
        )
        print(
            f"{row['layer']:<12} {par:<42} {_fmt_bytes(max(recv)):>16} "
            f"{_fmt_bytes(sum(recv)):>12} {fwd:>8} {bwd:>8}"
        )
    print(f"median step: parallel {parallel_s * 1e3:.0f} ms, serial {serial_s * 1e3:.0f} ms")


def plot_curves(path: Path, parallel: list[float], serial: list[float], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = range(1, len(serial) + 1)
    ax.plot(steps, serial, label="serial (1 process)", linewidth=2.5, alpha=0.6)
    ax.plot(steps, parallel, label="parallel (TP + CP)", linestyle="--", marker=".")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title, fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def launcher(args: argparse.Namespace, argv: list[str]) -> int:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("train_hybrid: FAILED: matplotlib is needed for the loss plot "
              "(pip install -r examples/requirements.txt)")  # fmt: skip
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rc, reason = _launch_parallel(args, argv)
    if rc != 0:
        print(f"train_hybrid: FAILED: {reason}", flush=True)
        return 1
    record = json.loads((out / "parallel.json").read_text())
    t_par = time.perf_counter() - t0
    serial, serial_times = train_serial(args)
    parallel = record["losses"]
    rel = max(abs(p - s) / max(abs(s), 1e-12) for p, s in zip(parallel, serial))
    par_med = sorted(record["step_times"])[len(parallel) // 2]
    ser_med = sorted(serial_times)[len(serial) // 2]
    print_layer_table(record, par_med, ser_med)
    png = out / "loss_curves.png"
    plot_curves(png, parallel, serial, f"hybrid {args.layers}, tp={args.tp} cp={args.cp}, "
                f"max rel diff {rel:.1e} (tol {args.tol:.0e})")  # fmt: skip
    print(
        f"\nloss: first {serial[0]:.4f}, last serial {serial[-1]:.4f} / parallel "
        f"{parallel[-1]:.4f}; max relative difference {rel:.2e} (tol {args.tol:.0e})"
    )
    print(f"loss curves: {png}")
    print(
        f"trace of step {record['trace_step']} (open in https://ui.perfetto.dev): "
        f"{out / 'trace_step.json'}"
    )
    print(f"parallel run {t_par:.1f} s, total {time.perf_counter() - t0:.1f} s")
    if not rel <= args.tol:
        worst = max(range(len(serial)), key=lambda i: abs(parallel[i] - serial[i]))
        print(f"train_hybrid: FAILED: loss curves disagree: max relative difference {rel:.2e} "
              f"> tol {args.tol:.0e} (step {worst + 1}: parallel {parallel[worst]:.6f}, "
              f"serial {serial[worst]:.6f})")  # fmt: skip
        return 1
    print("train_hybrid: OK: parallel and serial loss curves agree")
    return 0


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if "RANK" in os.environ and "LOCAL_RANK" in os.environ:
        worker(args)
        return 0
    return launcher(args, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
