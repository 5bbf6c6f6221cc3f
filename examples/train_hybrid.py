#!/usr/bin/env python3
"""The main job's harness: run examples/train.py under torchrun on local ranks, then the
unparallelised model with the same seed and data in one process, and check that the two loss
curves agree; meter, trace and report the parallel run, and keep every process under control.

    python examples/train_hybrid.py                        # 4 CPU ranks (cp=2 x tp=2), gloo
    python examples/train_hybrid.py --steps 2              # the shortest run (traced step 1)
    python examples/train_hybrid.py --device cuda          # NCCL, one GPU per rank
    python examples/train_hybrid.py --device npu           # HCCL (torch_npu from the image)
    python examples/train_hybrid.py --mesh 4,1 --steps 60 --autocast bf16
    python examples/train_hybrid.py --model deepseek-v3
    python examples/train_hybrid.py --model qwen3-next     # Gated DeltaNet + gated attention
    python examples/train_hybrid.py --ep 2 --experts 4     # experts split over 2 ranks
    python examples/train_hybrid.py --dtype float32        # train.py's dtype (CPU: float64)
    python examples/train_hybrid.py --model path/to/hf-folder [--no-serial]
    python examples/train_hybrid.py --pp 2 --schedule 1F1B --microbatches 4   # pipeline
    python examples/train_hybrid.py --overlap forward_backward --microbatches 2

Options of its own are listed below; every other one goes to examples/train.py (its --help
lists them). The harness starts torchrun on ``prod(--mesh)`` (times ``--pp``) local ranks,
each running ``train.main`` with hooks (:class:`RankHooks`) that meter every layer, trace step
``--trace-step`` (default: step 2, or the last one for shorter runs) and look for the rank
where a non-finite value first appeared. Output (``--out``, default ``out/``): what train.py
writes (``loss.png``, ``losses.json``, ``ckpt/``), plus ``loss_curves.png`` (parallel vs
serial), ``trace_step.json`` (Chrome / Perfetto trace of the traced step, one process per rank),
``trace_step.png`` (the same step as a timeline per rank) and ``parallel.json`` (losses, step
times, per-layer communication and time, and each layer's collectives by name on the traced
step: a MoE layer's ``moe:dispatch`` / ``moe:combine`` all-to-alls and ``moe:counts``).

``--pp N`` (train.py's): the model cut into pipeline stages (``pipeline_model``), trained with
``PipelinedModel.step``; the serial model and the comparison are the same. The report adds
each stage's decoder layers, ranks, and forward and backward time a step (torch's
``PipelineStage`` calls timed, every micro-batch summed: examples/_pipeline_meter.py), each
rank's idle share of ``PipelinedModel.step`` beside the schedule's bubble, and a ``p2p`` row
(the hidden states and gradients sent between stages); the trace shows each micro-batch's
forward and backward of each stage (``F k`` / ``B k``), the layers inside, the sends and
receives between the stages and the waits for them, every rank on one clock.

``--overlap forward_backward --microbatches 2`` (train.py's, pp = 1): the step's two
micro-batches run with micro-batch 1's forward interleaved with micro-batch 0's backward at
their exchanges (``pipeline_model(..., overlap="forward_backward")``); the serial model and the
comparison are the same. The trace adds a ``micro-batches`` lane under each rank's comm lane:
each micro-batch's running stretches (``forward mb1``, ``backward mb0``, from a hand-over to
the next), so a ``forward mb1`` stretch beside micro-batch 0's ``moe:combine0:grad`` on the
comm lane is one micro-batch's forward computing under the other's combine.
On CPU without ``--autocast`` the weights are float64 unless ``--dtype`` is given (train.py's
default is float32). The MoE routers pick experts by comparing float32 scores: from float32
weights the two runs' hidden states differ by rounding, a token whose scores are a near-tie
goes to different experts, and from then on the two models drift apart (measured on the
default job: routed differently at 11 of 40 steps, losses 1.4e-3 apart at step 40, tol 2e-3);
from float64 weights both routers see the same float32 inputs (40 of 40 steps alike, 1.6e-6).

MoE routers: the ranks count every router's (token, expert) assignments at each step; the
serial model applies ``balance_experts``' rule (``bias += rate · sign(mean(load) − load)``) to
its routers after every step from those loads of the whole batch, and the run fails unless its
bias equals the parallel model's at every step. It routes the batch itself: where a token's
scores are a near-tie in float32, the two models may pick different experts (reported, not a
failure); taking the parallel loads keeps one such token from moving the biases apart, which
would change the routing of many tokens from then on. Qwen3-Next's routers have no bias
(``balance_experts`` is not called; its auxiliary balancing loss is off, as in the stock
config): its routing is compared all the same.

``--model PATH`` (a Hugging Face folder): the ranks load it with ``from_pretrained`` (each
reads only its own slices; the report names the folder, its family and the bytes each rank
read) and the serial reference is the stock
``transformers.AutoModelForCausalLM.from_pretrained(PATH)`` (float64 on CPU, eager experts);
``--no-serial`` skips the serial model and the comparison (a model too large for one process),
and the report says that nothing was compared.

Exit status 0 when the curves agree within ``--tol`` (``--no-serial``: when the parallel run
ends); otherwise non-zero with a one-line
reason: curves that disagree (a NaN counts as disagreement), a router bias unlike the serial
model's, a non-finite loss (every rank
stops at that step; the reason names the rank and the layer output where it first appeared,
found before the loss is summed over the ranks), a failed rank (torchrun stops the others; a
rank stuck in a collective times out after ``--rank-timeout`` seconds), the ``--job-timeout``,
Ctrl-C or SIGTERM. In every case torchrun and all its workers are ended before the script
exits (examples/_jobctl.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _data
import _jobctl
import _plan_check
import _report
import torch
import train
from _fsdp_trace import FsdpCapture, add_spans
from _meter import LayerMeter
from _pipeline_meter import StageMeter, bubble, micro_batch_lane, p2p_spans
from _trace_plot import plot_trace

from hyper_parallel.dtensor.devices import bind_device

ROOT = Path(__file__).resolve().parent.parent


# ---- arguments: the harness's own; the rest is train.py's ---------------------------------
def harness_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False,
                                epilog="Every other option goes to examples/train.py.")  # fmt: skip
    p.add_argument("-h", "--help", action="store_true", help="this help, then train.py's")
    p.add_argument("--out", default=str(ROOT / "out"), help="train.py's outputs and the report")
    p.add_argument("--tol", type=float, help="max relative loss difference (2e-3; 1e-2 "
                   "under --autocast)")  # fmt: skip
    p.add_argument("--trace-step", type=int, help="step recorded in the trace")
    p.add_argument("--rank-timeout", type=float, default=60.0, help="collective timeout (s)")
    p.add_argument("--job-timeout", type=float, default=900.0, help="whole parallel run (s)")
    p.add_argument("--no-serial", action="store_true", help="skip the serial model and the "
                   "comparison (for a --model folder too large for one process)")  # fmt: skip
    # failure drills (hidden): a rank exits at a step; a NaN enters one rank's (or, with -1,
    # every rank's) embedding output at a step
    p.add_argument("--fail-rank", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--fail-step", type=int, default=3, help=argparse.SUPPRESS)
    p.add_argument("--nan-step", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--nan-rank", type=int, default=-1, help=argparse.SUPPRESS)
    return p


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str], argparse.Namespace]:
    """(harness options, train.py's argv, train.py's options)."""
    p = harness_parser()
    h, rest = p.parse_known_args(argv)
    if h.help:
        p.print_help()
        print("\n---- examples/train.py ----")
        train.parse_args(["--help"])
    if "--resume" in rest:
        p.error("--resume: the harness compares whole runs from step 0")
    targv = [*rest, "--out", h.out, "--timeout", str(h.rank_timeout)]
    t = train.parse_args(targv)
    given = any(a == "--dtype" or a.startswith("--dtype=") for a in rest)
    if not given and t.device == "cpu" and t.autocast == "off":  # see the module docstring
        targv += ["--dtype", "float64"]
        t = train.parse_args(targv)
    if h.trace_step is None:
        h.trace_step = min(2, t.steps - 1)
    if not 0 <= h.trace_step < t.steps:
        p.error("--trace-step must be in [0, steps)")
    if h.tol is None:
        h.tol = 2e-3 if t.autocast == "off" else 1e-2
    if h.job_timeout <= 0:
        p.error("--job-timeout must be positive")
    return h, targv, t


# ---- on every rank, under torchrun: train.main with these hooks -----------------------------
class NonFiniteLoss(RuntimeError):
    """The loss is NaN or infinite; raised on every rank at the same step."""


class RankHooks:
    """Meters, the trace of one step, the drills, and the rank where a non-finite value first
    appeared: each watched module's output is checked on its own rank (in the forward, before
    the loss is summed over the ranks; evaluated only once the summed loss is not finite)."""

    def __init__(self, h: argparse.Namespace, t: argparse.Namespace, rank: int) -> None:
        self.h, self.t, self.rank = h, t, rank
        self.flags: list[tuple[str, torch.Tensor]] = []  # (module, all finite) in call order
        self.losses: list[float] = []
        self.step_times: list[float] = []
        self.trace: dict[str, Any] = {}
        self.timed: dict[tuple[str, str], float] = {}
        self.collectives: dict[str, dict[str, int]] = {}  # traced step: layer -> name -> bytes
        self.loads: list[dict[str, list[int]]] = []  # per step: router -> this rank's counts
        self.bias: list[dict[str, list[float]]] = []  # per step, after balance_experts
        self.current = -1  # the step running
        self.fsdp = False  # FSDP2 reduces the gradients: its collectives from its named ranges
        self.plan_meter: _plan_check.PlanMeter | None = None  # the step set beside the plan
        # every watched output in model order (the same on every rank): where a non-finite
        # value first appeared, whichever rank (pipeline stage) holds the module
        self.order = ["embedding", *layer_names(t), "lm_head"]
        self.stage_meter: StageMeter | None = None  # --pp: each stage's forward and backward
        self.stage_times: list[dict[str, list[float]]] = []  # per step: stage -> [fwd, bwd] s
        self.pipeline_step_s: list[float] = []  # per step: PipelinedModel.step's wall time
        self.stages: list[int] = []
        self.stage_layers: list[list[int]] = []
        self.trace_origin_ns = 0  # the traced step's time 0 (perf_counter_ns: one clock a host)

    def on_model(self, model: Any, mesh: Any) -> None:
        from hyper_parallel.dtensor.rewrite import parallel_state
        from hyper_parallel.models.pretrained import load_report

        report = load_report(model)  # None unless loaded from a folder
        self.load = None if report is None else dataclasses.asdict(report)
        parts = held_parts(model)  # the model, or this rank's pipeline stages
        self.fsdp = parallel_state(parts[0][0], "hp-models").grad_reduction == "fsdp"
        self.router_loads = RouterLoads([part for part, *_ in parts])  # this rank's tokens
        if self.h.nan_step >= 0 and self.h.nan_rank in (-1, self.rank):  # drill: before watch
            part, held, first, _ = parts[0]  # the embeddings, or this rank's first layer
            target = part.model.embed_tokens if first else token_mixer(part.model.layers[held[0]])
            target.register_forward_hook(self._poison)
        layers: list[tuple[str, Any]] = []
        watched: list[tuple[str, Any]] = []
        for part, held, first, last in parts:
            base = part.model
            own = [(f"{i}:{self.t.mixers[i]}", token_mixer(base.layers[i])) for i in held]
            mlps = [(f"{i}:{self.t.mlps[i].replace('dense', 'mlp')}", base.layers[i].mlp)
                    for i in held]  # fmt: skip
            layers += [x for pair in zip(own, mlps, strict=True) for x in pair]
            watched += [("embedding", base.embed_tokens)] * first
            watched += [x for pair in zip(own, mlps, strict=True) for x in pair]
            watched += [("lm_head", part.lm_head)] * last
        for name, module in watched:
            module.register_forward_hook(self._watch(name))
        self.meter = LayerMeter(layers)
        self.plan_meter = _plan_check.PlanMeter(
            model, _plan_check.plan_step(self.h.trace_step, self.t.steps)
        )
        if getattr(model, "parts", None) is not None:  # a PipelinedModel
            self.stage_meter = StageMeter(model)
            self.stages = list(model.stages)
            self.stage_layers = [[r.start, r.stop] for r in model.layers]

    def _poison(self, _m: Any, _a: Any, out: Any) -> Any:
        if self.current != self.h.nan_step:
            return None
        if isinstance(out, tuple):  # a token mixer's (output, weights)
            return (out[0] * float("nan"), *out[1:])
        return out * float("nan")

    def _watch(self, name: str) -> Any:
        def hook(_m: Any, _a: Any, out: Any) -> None:
            t = out[0] if isinstance(out, tuple) else out
            self.flags.append((name, torch.isfinite(t.detach()).all()))

        return hook

    @contextmanager
    def step(self, step: int) -> Any:
        from hyper_parallel.dtensor.recorder import record_events

        self.current = step
        if step == self.h.fail_step and self.rank == self.h.fail_rank:  # drill
            _fail_file(Path(self.h.out), self.rank).write_text(
                f"rank {self.rank}: injected failure at step {step}\n"
            )
            os._exit(3)
        self.flags.clear()
        self.router_loads.clear()
        profiling = step == self.h.trace_step
        self.meter.time.clear()
        stages = self.stage_meter
        if stages is not None:
            stages.clear()
            stages.attach()  # torch's stages, once the first step has built them
        with record_events() if profiling else nullcontext() as rec:
            with FsdpCapture() if profiling and self.fsdp else nullcontext() as fsdp:
                self.meter.recorder = rec
                if stages is not None:
                    stages.recorder = rec
                pipe = p2p_spans(rec, self.meter) if profiling and stages else nullcontext()
                with self.meter if profiling else nullcontext(), pipe:
                    assert self.plan_meter is not None
                    with self.plan_meter.around(step):
                        yield
        self.meter.recorder = None
        if stages is not None:
            stages.recorder = None
            self.stage_times.append(stages.snapshot())
            self.pipeline_step_s.append(stages.step_s)
        if profiling:
            self.trace = rec.to_chrome_trace(pid=self.rank)
            micro_batch_lane(self.trace, rec.events, self.rank)  # --overlap forward_backward
            self.collectives = collectives_by_layer(rec.events)
            self.trace_origin_ns = rec.events[0].t_ns if rec.events else 0
            if fsdp is not None and rec.events:  # FSDP2's collectives on the comm lane too
                spans = fsdp.spans(rec.events[0].t_ns, self.rank)
                first = min((e["ts"] for e in spans), default=0.0)  # add_spans shifts by it
                self.trace_origin_ns += int(min(first, 0.0) * 1000)
                add_spans(self.trace, spans)
        elif step > 0:
            for key, v in self.meter.time.items():
                self.timed[key] = self.timed.get(key, 0.0) + v

    def on_step_end(self, step: int, loss: float, seconds: float) -> None:
        self.losses.append(loss)
        self.step_times.append(seconds)
        self.loads.append(self.router_loads.snapshot())
        self.bias.append(RouterLoads.biases(self.router_loads.routers))
        if math.isfinite(loss):  # the summed loss: the same on every rank, so is this branch
            return
        import torch.distributed as dist

        # the first in model order (one forward: the first in call order; a pipeline: its
        # stages' outputs of every micro-batch)
        bad = [self.order.index(name) for name, ok in self.flags if not bool(ok)]
        first = torch.tensor([min(bad) if bad else len(self.order)], device=self.t.device)
        every = [torch.empty_like(first) for _ in range(dist.get_world_size())]
        dist.all_gather(every, first)
        at = [int(v) for v in every]
        pos = min(at)
        if pos == len(self.order):
            raise NonFiniteLoss(f"non-finite loss at step {step} (loss {loss}; every watched "
                                "output finite on every rank: it arose in the loss)")  # fmt: skip
        ranks = [r for r, v in enumerate(at) if v == pos]
        raise NonFiniteLoss(
            f"non-finite loss at step {step}: first non-finite output {self.order[pos]} on "
            f"rank {ranks[0]} (there on {len(ranks)} of {len(at)} ranks; loss {loss})"
        )

    def stats(self) -> dict[str, Any]:
        n_timed = max(1, sum(1 for s in range(1, self.t.steps) if s != self.h.trace_step))
        return {
            "bytes": self.meter.bytes,
            "time": {f"{k[0]}|{k[1]}": v / n_timed for k, v in self.timed.items()},
            "trace": self.trace,
            "losses": self.losses,
            "step_times": self.step_times,
            "layers": self.meter.names,
            "collectives": self.collectives,
            "router_loads": self.loads,
            "router_bias": self.bias,
            "grad_reduction": "fsdp" if self.fsdp else "allreduce",
            "load": self.load,
            "plan": self.plan_meter.measured if self.plan_meter is not None else {},
            "stages": self.stages,  # --pp: this rank's stages, every stage's layers [start, stop)
            "stage_layers": self.stage_layers,
            "stage_times": self.stage_times,
            "pipeline_step_s": self.pipeline_step_s,
            "trace_origin_ns": self.trace_origin_ns,
        }


def layer_names(t: argparse.Namespace) -> list[str]:
    """The metered layers' names in model order: ``0:kda``, ``0:mlp``, ``1:mla``, ``1:moe``…"""
    return [n for i, (mixer, mlp) in enumerate(zip(t.mixers, t.mlps, strict=True))
            for n in (f"{i}:{mixer}", f"{i}:{mlp.replace('dense', 'mlp')}")]  # fmt: skip


def held_parts(model: Any) -> list[tuple[Any, range, bool, bool]]:
    """``(stock causal LM, its decoder layers, holds the embeddings, holds the LM head)`` of
    what this rank holds: the whole parallelised model, or each of its pipeline stages."""
    parts = getattr(model, "parts", None)
    if parts is None:
        return [(model, range(len(model.model.layers)), True, True)]
    last = model.num_stages - 1
    return [(part, model.layers[s], s == 0, s == last)
            for part, s in zip(parts, model.stages, strict=True)]  # fmt: skip


def token_mixer(layer: torch.nn.Module) -> torch.nn.Module:
    """A decoder layer's token mixer: Qwen3-Next's Gated DeltaNet is its ``linear_attn``, every
    other mixer (KDA and MLA too) its ``self_attn``."""
    mixer = getattr(layer, "linear_attn", None)
    return mixer if mixer is not None else layer.self_attn


def collective_family(name: str) -> str:
    """A collective's name without its chunk number: ``moe:dispatch1:grad`` ->
    ``moe:dispatch:grad`` (hp-moe numbers the chunks it dispatches and combines in)."""
    head, sep, rest = name.partition(":")
    kind, _, tail = rest.partition(":")
    return head + sep + kind.rstrip("0123456789") + (":" + tail if tail else "")


def collectives_by_layer(events: list[Any]) -> dict[str, dict[str, int]]:
    """Bytes this rank moved in each collective started through hp-dtensor's comm (the
    recorder's launches), by the layer span open at its launch (``other`` outside any) and
    name (:func:`collective_family`); forward and backward together."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    open_layers: list[str] = []
    for e in events:
        if e.kind in ("begin", "end") and e.name.startswith("layer "):
            layer = e.name.removeprefix("layer ")
            if e.kind == "begin":
                open_layers.append(layer)
            elif layer in open_layers:  # the innermost one of that name
                del open_layers[len(open_layers) - 1 - open_layers[::-1].index(layer)]
        elif e.kind == "launch":
            where = open_layers[-1] if open_layers else "other"
            out[where][collective_family(e.name)] += e.nbytes
    return {k: dict(v) for k, v in out.items()}


def _fail_file(out: Path, rank: int) -> Path:
    return out / f".rank{rank}.failed"


def _stats_file(out: Path, rank: int) -> Path:
    return out / f".rank{rank}.stats.json"


def worker(h: argparse.Namespace, targv: list[str], t: argparse.Namespace) -> int:
    import torch.distributed as dist

    rank, out = int(os.environ["RANK"]), Path(h.out)
    out.mkdir(parents=True, exist_ok=True)
    _jobctl.die_with_parent()  # torchrun gone (killed): this rank goes too
    _jobctl.pid_file(out, rank).write_text(f"{os.getpid()}\n")
    if t.device == "cpu":
        torch.set_num_threads(1)
    hooks = RankHooks(h, t, rank)
    try:
        train.main(targv, hooks)
    except NonFiniteLoss as exc:
        _fail_file(out, rank).write_text(f"{exc}\n")
        print(f"rank {rank}: stopping: {exc}", file=sys.stderr, flush=True)
        dist.destroy_process_group()
        return 4
    except BaseException as exc:
        line = f"rank {rank}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        _fail_file(out, rank).write_text(line + "\n")
        raise
    _stats_file(out, rank).write_text(json.dumps(hooks.stats()))
    return 0


# ---- the launcher --------------------------------------------------------------------------
def _torchrun(ranks: int, argv: list[str]) -> tuple[list[str], dict[str, str]]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={ranks}", "--max-restarts=0", "--monitor-interval=0.5",
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


def launch_parallel(h: argparse.Namespace, t: argparse.Namespace, argv: list[str]) -> str:
    """Run the ranks under torchrun; return '' or a one-line reason. Nothing of the job
    outlives this call (also on Ctrl-C / SIGTERM, which propagate)."""
    out = Path(h.out)
    stale = ["parallel.json", "losses.json", ".rank*.failed", ".rank*.pid", ".rank*.stats.json"]
    for pattern in stale:
        for f in out.glob(pattern):
            f.unlink()
    if t.device == "npu" and "ASCEND_RT_VISIBLE_DEVICES" not in os.environ:
        print("note: ASCEND_RT_VISIBLE_DEVICES not set; ranks use NPUs 0..N-1", flush=True)
    cmd, env = _torchrun(t.ranks, argv)
    rc, job = _jobctl.run_job(cmd, env, out, h.job_timeout)
    if rc is None:
        return f"parallel run exceeded --job-timeout {h.job_timeout:g}s; torchrun and all " \
               "ranks stopped"  # fmt: skip
    return "" if rc == 0 else _failure_reason(out, job.tail, rc)


def merge_rank_stats(h: argparse.Namespace, t: argparse.Namespace) -> dict[str, Any]:
    """parallel.json and trace_step.json from every rank's statistics."""
    out = Path(h.out)
    per_rank = [json.loads(_stats_file(out, r).read_text()) for r in range(t.ranks)]
    piped = t.pp > 1
    # a pipeline: every rank's timeline on one clock (the ranks are local, perf_counter_ns is
    # the host's monotonic clock), so that the stages' micro-batches line up
    origin = min(s["trace_origin_ns"] for s in per_rank) if piped else 0
    events: list[Any] = []
    for r, stats in enumerate(per_rank):
        shift = (stats["trace_origin_ns"] - origin) / 1000.0 if piped else 0.0
        for e in stats["trace"].get("traceEvents", []):
            events.append({**e, "ts": e["ts"] + shift} if "ts" in e else e)
        events.append({"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"rank {r}"}})
    (out / "trace_step.json").write_text(json.dumps({"traceEvents": events,
                                                     "displayTimeUnit": "ms"}))  # fmt: skip
    rows = []
    # every layer some rank holds, in model order (a pipeline: each on its stage's ranks)
    held = [n for n in layer_names(t) if any(n in s["layers"] for s in per_rank)]
    for name in [*held, *["p2p"] * piped, "other"]:
        recv = [int(s["bytes"].get(name, 0)) for s in per_rank]
        # phases that are not timed (the rest of the step) report None, not zero
        fwd = [s["time"][f"{name}|forward"] for s in per_rank if f"{name}|forward" in s["time"]]
        bwd = [s["time"][f"{name}|backward"] for s in per_rank if f"{name}|backward" in s["time"]]
        named = sorted({c for s in per_rank for c in s["collectives"].get(name, {})})
        by_name = {c: [int(s["collectives"].get(name, {}).get(c, 0)) for s in per_rank]
                   for c in named}  # fmt: skip
        rows.append({"layer": name, "recv_bytes_per_rank": recv,
                     "fwd_s": max(fwd) if fwd else None,
                     "bwd_s": max(bwd) if bwd else None,
                     "collectives": by_name})  # fmt: skip
    load = None
    if per_rank[0]["load"] is not None:  # from_pretrained's report: the folder, each rank's reads
        load = {k: per_rank[0]["load"][k] for k in ("path", "family", "folder_bytes")}
        for k in ("bytes_read", "regions", "tensors", "seconds"):
            load[f"{k}_per_rank"] = [s["load"][k] for s in per_rank]
    steps = range(len(per_rank[0]["losses"]))
    record = {
        "model": train.model_name(t),
        "family": t.family,
        "load": load,
        "mesh": dict(zip(t.dim_names, t.dims, strict=True)),
        "ep": t.ep,
        "experts": t.experts if "moe" in t.mlps else 0,
        "losses": per_rank[0]["losses"],
        "step_times": per_rank[0]["step_times"],
        "layers": rows,
        "trace_step": h.trace_step,
        "grad_reduction": per_rank[0]["grad_reduction"],
        "plan_measured": [s["plan"] for s in per_rank],  # _plan_check.PlanMeter's, by rank
        # per step: every router's loads of the whole batch (the counts of the ranks holding
        # it summed: every rank, or a pipeline stage's) and its bias after balance_experts
        # (the first holder's; whether every rank holding it has the same)
        "router_loads": [summed_loads([s["router_loads"][i] for s in per_rank]) for i in steps],
        "router_bias": [_first_holder([s["router_bias"][i] for s in per_rank]) for i in steps],
        "router_bias_same_on_every_rank": same_bias(per_rank),
        "pipeline": pipeline_record(h, t, per_rank) if piped else None,
    }
    (out / "parallel.json").write_text(json.dumps(record, indent=1))
    return record


def summed_loads(ranks: list[dict[str, list[int]]]) -> dict[str, list[int]]:
    """Each router's (token, expert) counts summed over the ranks holding it."""
    out: dict[str, list[int]] = {}
    for loads in ranks:
        for name, counts in loads.items():
            old = out.get(name, [0] * len(counts))
            out[name] = [a + b for a, b in zip(old, counts, strict=True)]
    return out


def _first_holder(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The union of ``ranks`` (router -> value), each key's value from the first holding it."""
    out: dict[str, Any] = {}
    for d in ranks:
        for k, v in d.items():
            out.setdefault(k, v)
    return out


def same_bias(per_rank: list[dict[str, Any]]) -> bool:
    """Whether every rank holding a router has the same bias after every step."""
    for i in range(len(per_rank[0]["router_bias"])):
        first = _first_holder([s["router_bias"][i] for s in per_rank])
        if any(b != first[n] for s in per_rank for n, b in s["router_bias"][i].items()):
            return False
    return True


def pipeline_record(h: argparse.Namespace, t: argparse.Namespace,
                    per_rank: list[dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    """The pipeline in parallel.json: each stage's layers, the ranks holding it and its forward
    and backward time a step (every micro-batch summed; the slowest of its ranks; the mean over
    the steps timed like the layers: past the first, less the traced one, or the traced one
    when no other is), and each rank's idle fraction of its ``PipelinedModel.step``."""
    steps = [s for s in range(1, t.steps) if s != h.trace_step] or [h.trace_step]

    def mean(values: list[float]) -> float:
        return sum(values) / max(len(values), 1)

    stages = []
    for st, (start, stop) in enumerate(per_rank[0]["stage_layers"]):
        holders = [r for r, s in enumerate(per_rank) if st in s["stages"]]
        times = [[mean([per_rank[r]["stage_times"][i].get(str(st), [0.0, 0.0])[k] for i in steps])
                  for r in holders] for k in (0, 1)]  # fmt: skip
        stages.append({"stage": st, "layers": [start, stop], "ranks": holders,
                       "forward_s": max(times[0], default=0.0),
                       "backward_s": max(times[1], default=0.0)})  # fmt: skip
    ranks = []
    for r, s in enumerate(per_rank):
        busy = mean([sum(sum(v) for v in s["stage_times"][i].values()) for i in steps])
        wall = mean([s["pipeline_step_s"][i] for i in steps])
        ranks.append({"rank": r, "stages": s["stages"], "busy_s": busy, "step_s": wall,
                      "idle": 1.0 - busy / wall if wall > 0 else None})  # fmt: skip
    return {
        "pp": t.pp,
        "schedule": t.schedule,
        "microbatches": t.microbatches,
        "stages_per_rank": t.stages_per_rank,
        "timed_steps": steps,
        "stages": stages,
        "ranks": ranks,
        "bubble": bubble(t.schedule, t.pp, t.microbatches, t.stages_per_rank),
    }


@dataclass
class SerialRun:
    losses: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    bias: list[dict[str, list[float]]] = field(default_factory=list)  # per step, balanced
    rerouted: list[int] = field(default_factory=list)  # per step: assignments unlike parallel


def train_serial(t: argparse.Namespace, record: dict[str, Any]) -> SerialRun:
    """The same model, data and step as train.py, unparallelised, in this process; after every
    step the routers' bias moves by ``balance_experts``' rule from the parallel run's loads of
    the step (``record["router_loads"]``), and this model's own routing is compared with them."""
    from tqdm import tqdm

    bind_device(t.device, 0)
    if t.device == "cpu":  # one thread, like each rank: on busy shared cores, OpenMP threads
        torch.set_num_threads(1)  # waiting for each other made serial steps 20-60x slower
    model = serial_model(t)
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr)
    loads = RouterLoads(model)
    par_loads = record.get("router_loads", [])
    run = SerialRun()
    for step in tqdm(range(t.steps), desc="serial (1 process)", file=sys.stdout):
        tokens = _data.tokens(t, step).to(t.device)
        t0 = time.perf_counter()
        loads.clear()
        with train.autocast(t):
            if t.packed:
                docs = _data.documents(t, step)
                loss = packed_loss(model, tokens, docs)
                route_single_tokens(model, tokens, docs)  # routed in the packed row too
            else:
                loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        own = loads.snapshot()
        theirs = par_loads[step] if step < len(par_loads) else own
        run.rerouted.append(assignments_apart(own, theirs))
        if t.balance_rate and "moe" in t.mlps:
            loads.balance(t.balance_rate, theirs)
        run.bias.append(RouterLoads.biases(loads.routers))
        run.losses.append(loss.item())
        run.times.append(time.perf_counter() - t0)
        if not math.isfinite(run.losses[-1]):
            break  # the comparison reports it
    return run


def serial_model(t: argparse.Namespace) -> torch.nn.Module:
    """train.py's tiny model, or for a folder the stock ``AutoModelForCausalLM`` loaded from it
    (eager experts: grouped_mm has no float64), in training mode as train.py's is."""
    if t.folder is None:
        return train.build_model(t).to(t.device)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(t.folder, dtype=getattr(torch, t.dtype),
                                                 experts_implementation="eager")  # fmt: skip
    return model.to(t.device).train()


def assignments_apart(a: dict[str, list[int]], b: dict[str, list[int]]) -> int:
    """How many (token, expert) assignments two routings of the same tokens differ in."""
    return sum(abs(x - y) for n in a for x, y in zip(a[n], b.get(n, a[n]), strict=True)) // 2


class RouterLoads:
    """Every MoE router's (token, expert) assignment counts over the forwards since
    :meth:`clear` (a forward hook on each ``mlp.gate`` router, which returns ``(logits,
    weights, expert indices)`` in every family; in the parallel model, this rank's tokens), and
    ``balance_experts``' bias step on the routers with an ``e_score_correction_bias``
    (Kimi-Linear's, DeepSeek-V3's; Qwen3-Next's have none)."""

    def __init__(self, model: torch.nn.Module | list[torch.nn.Module]) -> None:
        models = model if isinstance(model, list) else [model]  # a pipeline: this rank's stages
        self.routers = {
            n: m
            for one in models
            for n, m in one.named_modules()
            if n.endswith("mlp.gate") and hasattr(m, "num_experts")
        }
        self.loads: dict[str, torch.Tensor] = {}
        for name, router in self.routers.items():
            router.register_forward_hook(self._count(name))

    @staticmethod
    def biases(routers: dict[str, torch.nn.Module]) -> dict[str, list[float]]:
        return {
            n: r.e_score_correction_bias.detach().cpu().tolist()
            for n, r in routers.items()
            if hasattr(r, "e_score_correction_bias")
        }

    def _count(self, name: str) -> Any:
        def hook(router: torch.nn.Module, _a: Any, out: Any) -> None:
            counts = torch.bincount(out[2].detach().reshape(-1).cpu(), minlength=router.num_experts)
            self.loads[name] = self.loads.get(name, 0) + counts

        return hook

    def clear(self) -> None:
        self.loads.clear()

    def snapshot(self) -> dict[str, list[int]]:
        return {
            n: [int(v) for v in self.loads.get(n, [0] * r.num_experts)]
            for n, r in self.routers.items()
        }

    def balance(self, rate: float, loads: dict[str, list[int]]) -> None:
        """``bias += rate · sign(mean(load) − load)``, the load in float64 (balance_experts')."""
        for name, router in self.routers.items():
            if not hasattr(router, "e_score_correction_bias"):
                continue
            load = torch.tensor(loads[name], dtype=torch.float64)
            bias = router.e_score_correction_bias
            with torch.no_grad():
                bias.add_((rate * torch.sign(load.mean() - load)).to(bias.device, bias.dtype))


def route_single_tokens(model: torch.nn.Module, tokens: torch.Tensor,
                        docs: list[list[int]]) -> None:  # fmt: skip
    """Run the one-token documents that :func:`packed_loss` skips (no target), without
    gradient: the parallel model routes every token of the packed row, so the routers' loads
    count them."""
    with torch.no_grad():
        for row, offsets in enumerate(docs):
            for a, b in zip(offsets, offsets[1:]):
                if b - a == 1:
                    model(input_ids=tokens[row : row + 1, a:b], use_cache=False)


def packed_loss(model: torch.nn.Module, tokens: torch.Tensor, docs: list[list[int]]) -> Any:
    """The loss of packed rows as the parallel model defines it, from the stock model run on
    each document alone (its sdpa path does not isolate documents given in one row): the mean
    cross-entropy over every labelled token (each document's next-token targets; a
    document's last token has none)."""
    total, count = 0.0, 0
    for row, offsets in enumerate(docs):
        for a, b in zip(offsets, offsets[1:]):
            if b - a < 2:
                continue  # one token: no target (its label is -100, the next document's too)
            logits = model(input_ids=tokens[row : row + 1, a:b], use_cache=False).logits
            total = total + torch.nn.functional.cross_entropy(
                logits[0, :-1].float(), tokens[row, a + 1 : b], reduction="sum"
            )
            count += b - a - 1
    return total / count


def summarize(h: argparse.Namespace, t: argparse.Namespace, record: dict[str, Any],
              run: SerialRun | None) -> str:  # fmt: skip
    """Print the table, write the plots; return the reason the run failed ('' when OK).
    ``run`` None: ``--no-serial``, nothing compared."""
    out = Path(h.out)
    parallel, serial = record["losses"], run.losses if run is not None else []
    rel, reason, bias_reason = math.nan, "", ""
    if run is not None:
        rel, reason = _report.compare_curves(parallel, serial, h.tol)
        bias_reason = check_router_bias(record, run)
    reason = reason or bias_reason
    par_med = _median(record["step_times"])
    ser_med = _median(run.times) if run is not None else None
    if record.get("load"):
        print(_report.load_lines(record["load"]))
    _report.print_layer_table(record, par_med, ser_med)
    if record.get("pipeline"):
        print(_report.pipeline_lines(record, train.layer_span, t.mixers))
    slower = _report.slower_reason(t.device, t.ranks, par_med, ser_med) if ser_med else ""
    if slower:
        print(slower)
    if record.get("plan_measured") and not t.packed and t.autocast == "off":
        step = _plan_check.plan_step(h.trace_step, t.steps)
        config = _plan_check.job_config(t)
        pipe = record.get("pipeline")
        stages = [r["stages"] for r in pipe["ranks"]] if pipe else None
        print(_plan_check.plan_lines(config, t, step, record["grad_reduction"],
                                     record["plan_measured"], stages))  # fmt: skip
    mesh = " x ".join(f"{k}={v}" for k, v in record["mesh"].items())
    moe = f", {t.experts} experts over ep={t.ep}" if "moe" in t.mlps else ""
    pipe = f", {t.schedule} x {t.microbatches} micro-batches" if t.pp > 1 else ""
    if t.overlap == train.FB:
        pipe = f", forward/backward overlap x {t.microbatches} micro-batches"
    what = f"{train.model_name(t)} {','.join(t.mixers)}{moe}, {mesh}{pipe}"
    png = out / "loss_curves.png"
    versus = f"max rel diff {rel:.1e} (tol {h.tol:.0e})" if run is not None else "no serial run"
    _report.plot_curves(png, parallel, serial, f"{what}, {versus}")
    trace_json, trace_png = out / "trace_step.json", out / "trace_step.png"
    xlabel = {"xlabel": "ms since the first event of any rank (one clock)"} if pipe else {}
    plot_trace(json.loads(trace_json.read_text()), trace_png, f"step {h.trace_step}, {what}",
               **xlabel)  # fmt: skip
    if run is None:
        print(
            f"\nloss: first {parallel[0]:.4f}, last {parallel[-1]:.4f}; serial comparison "
            "SKIPPED (--no-serial): the loss curves and router biases were not checked"
        )
    else:
        print(
            f"\nloss: first {serial[0]:.4f}, last serial {serial[-1]:.4f} / parallel "
            f"{parallel[-1]:.4f}; max relative difference {rel:.2e} (tol {h.tol:.0e})"
        )
    if run is not None and "moe" in t.mlps and record["router_loads"]:
        print(_report.routing_lines(t.balance_rate, run.bias[-1] if run.bias else {},
                                    run.rerouted, not bias_reason))  # fmt: skip
    print(f"loss curves: {png}")
    print(f"trace of step {h.trace_step}: {trace_png} (timeline per rank); "
          f"{trace_json} (open in https://ui.perfetto.dev)")  # fmt: skip
    return reason


def check_router_bias(record: dict[str, Any], run: SerialRun) -> str:
    """'' when every router's bias equals the serial model's after every step (the rule
    replayed on the same loads), and every rank has the same; otherwise the reason."""
    if not record.get("router_bias_same_on_every_rank", True):
        return "router bias differs between the ranks after balance_experts"
    for step, (par, ser) in enumerate(zip(record.get("router_bias", []), run.bias)):
        diff = bias_difference(par, ser)
        if diff > 0:
            return (
                f"router bias after step {step} is not balance_experts' rule on the batch's "
                f"routing (max difference {diff:.1e} from the serial model's)"
            )
    return ""


def bias_difference(parallel: dict[str, list[float]], serial: dict[str, list[float]]) -> float:
    """The largest difference between the two models' router biases (``inf``: other routers)."""
    if parallel.keys() != serial.keys():
        return math.inf
    return max(
        (abs(a - b) for n in serial for a, b in zip(parallel[n], serial[n], strict=True)),
        default=0.0,
    )


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def launcher(h: argparse.Namespace, t: argparse.Namespace, argv: list[str]) -> int:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("train_hybrid: FAILED: matplotlib is needed for the loss plot "
              "(pip install -r examples/requirements.txt)")  # fmt: skip
        return 1
    Path(h.out).mkdir(parents=True, exist_ok=True)
    _jobctl.raise_on_signals()
    t0 = time.perf_counter()
    try:
        reason = launch_parallel(h, t, argv)
        if reason:
            print(f"train_hybrid: FAILED: {reason}", flush=True)
            return 1
        t_par = time.perf_counter() - t0
        record = merge_rank_stats(h, t)
        serial = None if h.no_serial else train_serial(t, record)
        reason = summarize(h, t, record, serial)
    except _jobctl.Interrupted as exc:
        print(f"train_hybrid: FAILED: interrupted by {exc} after {time.perf_counter() - t0:.0f}s;"
              " torchrun and every rank stopped", flush=True)  # fmt: skip
        return 128 + exc.signum
    print(f"parallel run {t_par:.1f} s, total {time.perf_counter() - t0:.1f} s")
    if reason:
        print(f"train_hybrid: FAILED: {reason}")
        return 1
    if h.no_serial:
        print("train_hybrid: OK: parallel run finished; serial comparison skipped (--no-serial)")
    else:
        print("train_hybrid: OK: parallel and serial loss curves agree")
    return 0


def main(argv: list[str]) -> int:
    h, targv, t = parse_args(argv)
    if "RANK" in os.environ and "LOCAL_RANK" in os.environ:
        return worker(h, targv, t)
    return launcher(h, t, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
