"""Loading and saving a stock Hugging Face folder at real size on 4 ranks: each rank's peak
growth of anonymous memory, the bytes it read, and the time, against the ways a user has
without hp-models' ``from_pretrained``.

The folder: a stock ``KimiLinearForCausalLM`` (``kimi_config``: hidden 1024, 4 layers KDA,
MLA, KDA, MLA, the last three MoE with 32 experts of 512, vocab 16384: ~212M parameters,
~424 MB in bf16), written once by stock ``save_pretrained(folder, max_shard_size="100MB")``
into a temporary folder (``--family deepseek``: a DeepSeek-V3 of the same size). Every load
below reads that folder from the page cache (it was just written). On 4 ranks, mesh (cp, tp)
= (2, 2), ``ep=4``, ``grad_reduction="fsdp"``, bf16:

- ``hp``: ``hyper_parallel.models.from_pretrained(folder, mesh, ep=4)`` (meta build, each
  rank reads its own regions), then ``model.save_pretrained(out)`` (every rank writes its
  share);
- ``old``: every rank ``AutoModelForCausalLM.from_pretrained(folder)`` (the whole model),
  then ``parallelize_model``; saving: torch's ``get_model_state_dict(model,
  StateDictOptions(full_state_dict=True, cpu_offload=True))`` (the whole state dict gathered
  on rank 0), which rank 0 writes with safetensors' ``save_file`` in 100 MB files (the runtime
  layout: the hub conversion is left out, which only flatters it);
- ``stock``: ``AutoModelForCausalLM.from_pretrained(folder)`` in one process;
- ``hf_dist``: transformers 5.23's own distributed load on the same 4 ranks,
  ``from_pretrained(folder, distributed_config=DistributedConfig(...))``: first
  ``tp_size=2, fsdp_size=2, ep_size=4`` (the nearest to ours), then ``tp_size=4`` (``tp_plan
  "auto"``); the first that runs is measured, and why each failed is recorded in one line.
  transformers needs ``accelerate`` for it, which hp-models' environment does not install: the
  record then says so; ``--accelerate DIR`` (``pip install --no-deps --target DIR
  accelerate``) puts it on ``sys.path`` in that process group only, so the other
  configurations run without it.

Before its measured load each process group loads (and saves) a tiny folder of the same
family the same way, so imports and first-call costs stay out of the figures (not with
``--quick``, a smoke run of a ~18 MB model in which they dominate). Default: both families
(``--quick``: Kimi-Linear only).

Memory: each rank's ``RssAnon`` (``/proc/self/status``: resident memory not backed by a
file, so the mmapped safetensors pages a rank touches are not counted; ``RssFile`` growth is
recorded beside it) sampled every 2 ms by a thread, peak minus the value just before the
phase, as a fraction of the model's bytes. glibc's malloc is made to return freed memory
(``mallopt``: fixed mmap and trim thresholds of 128 KiB, the defaults without their dynamic
growth) so that one phase's freed memory does not hide the next one's peak; each
configuration also runs in its own process group. Goal for ``hp``: ≤ 1/P + the largest
tensor of the folder. Time: the slowest rank's, ranks starting together after a barrier; one
load per configuration (a load is a one-off), so expect the host's noise.

    python packages/hp-models/benchmarks/bench_pretrained.py --out f.json [--quick]
        [--family kimi|deepseek|both] [--accelerate DIR]
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import shutil
import tempfile
import threading
import time
from typing import Any, cast

import torch
import torch.distributed as dist

from hyper_parallel.dtensor import init_device_mesh, unflatten
from hyper_parallel.dtensor.benchmarking import bench_arguments, bench_record, write_records
from hyper_parallel.dtensor.testing import run_distributed

WORLD = 4
MESH = (2, 2)
EP = 4
SHARD = "100MB"
DTYPE = torch.bfloat16


# ---------------------------------------------------------------- memory


def plain_malloc() -> None:
    """glibc: fixed mmap / trim thresholds (128 KiB, the defaults, without the dynamic growth
    that keeps freed blocks of up to 32 MiB in the heap), so RssAnon follows live memory."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD
        libc.malloc_trim(0)
    except OSError:
        pass


def _status() -> tuple[int, int]:
    """(RssAnon, RssFile) of this process in bytes."""
    anon = file = 0
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                anon = int(line.split()[1]) * 1024
            elif line.startswith("RssFile:"):
                file = int(line.split()[1]) * 1024
    return anon, file


class RssPeak:
    """Peak growth of RssAnon (and RssFile) over the ``with`` block, sampled every
    ``every`` seconds by a thread (and at both ends)."""

    def __init__(self, every: float = 0.002):
        self.every = every
        self.anon = self.file = self.after = 0

    def __enter__(self) -> RssPeak:
        gc.collect()
        self.start_anon, self.start_file = _status()
        self._peak = [self.start_anon, self.start_file]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        a, f = _status()
        self._peak[0] = max(self._peak[0], a)
        self._peak[1] = max(self._peak[1], f)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._sample()

    def __exit__(self, *exc: Any) -> None:
        self._sample()
        self._stop.set()
        self._thread.join()
        self.anon = self._peak[0] - self.start_anon
        self.file = self._peak[1] - self.start_file
        self.after = _status()[0] - self.start_anon


# ---------------------------------------------------------------- the folder


def shapes(family: str, quick: bool) -> dict[str, Any]:
    """The config overrides of the benchmark's model."""
    if quick:
        h, heads, hd, experts, inter, vocab = 256, 8, 32, 16, 128, 4096
    else:
        h, heads, hd, experts, inter, vocab = 1024, 16, 64, 32, 512, 16384
    common = {
        "vocab_size": vocab,
        "hidden_size": h,
        "intermediate_size": 4 * h,
        "moe_intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "kv_lora_rank": 4 * hd,
        "qk_nope_head_dim": hd,
        "qk_rope_head_dim": hd // 2,
        "v_head_dim": hd,
        "num_hidden_layers": 4,
    }
    if family == "kimi":
        return {
            **common,
            "num_experts": experts,
            "num_experts_per_token": 4,
            "linear_num_heads": heads,
            "linear_head_dim": hd,
            "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
        }
    return {
        **common,
        "q_lora_rank": 6 * hd,
        "n_routed_experts": experts,
        "num_experts_per_tok": 4,
        "first_k_dense_replace": 1,
    }


def write_folder(family: str, quick: bool, folder: str, tiny: bool = False) -> dict[str, Any]:
    """A seeded stock model of ``family`` in bf16, saved by stock ``save_pretrained``; its
    tensor bytes and largest tensor (from the safetensors headers). ``tiny``: the testing
    defaults with 8 experts (the warm-up folder)."""
    from hyper_parallel.models.hub import HubFolder
    from hyper_parallel.models.testing import deepseek_config, import_transformers, kimi_config

    tf = import_transformers()
    make = kimi_config if family == "kimi" else deepseek_config
    moe = {"num_experts": 8} if family == "kimi" else {"n_routed_experts": 8}
    cfg = make(**(moe if tiny else shapes(family, quick)))
    cls = tf.KimiLinearForCausalLM if family == "kimi" else tf.DeepseekV3ForCausalLM
    torch.manual_seed(0)
    model = cls._from_config(cfg, dtype=DTYPE)
    model.save_pretrained(folder, max_shard_size=SHARD)
    params = sum(p.numel() for p in model.parameters())
    del model
    gc.collect()
    hub = HubFolder(folder)
    sizes = {k: hub.nbytes(k) for k in hub.meta}
    largest = max(sizes, key=lambda k: sizes[k])
    return {
        "params": params,
        "model_bytes": sum(sizes.values()),
        "largest_tensor": largest,
        "largest_tensor_bytes": sizes[largest],
        "files": len({hub.files[k] for k in hub.meta}),
    }


# ---------------------------------------------------------------- rank bodies


def _mesh() -> Any:
    world = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("world",))
    return unflatten(world, "world", MESH, ("cp", "tp"))


def _slowest(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _local_bytes(model: Any) -> int:
    from hyper_parallel.models.hub import model_tensors

    n = 0
    for t in model_tensors(model).values():
        local = t.to_local() if hasattr(t, "to_local") else t
        n += local.numel() * local.element_size()
    return n


def _timed(fn: Any) -> tuple[Any, float, RssPeak]:
    """``fn()`` on every rank, started together: (result, slowest rank's seconds, memory)."""
    dist.barrier()
    with RssPeak() as mem:
        start = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - start
    return out, _slowest(seconds), mem


def hp_body(folder: str, out: str, warm: str | None) -> dict[str, Any]:
    """hp-models: ``from_pretrained`` then the every-rank ``save_pretrained`` (after both on
    the tiny ``warm`` folder: imports and first-call costs out of the measurement)."""
    from hyper_parallel.models import from_pretrained, load_report

    plain_malloc()
    mesh = _mesh()
    if warm is not None:
        tiny: Any = from_pretrained(warm, mesh, dtype=DTYPE, ep=EP, grad_reduction="fsdp")
        tiny.save_pretrained(out + "-warm")
        del tiny
    model, load_s, load_mem = _timed(
        lambda: from_pretrained(folder, mesh, dtype=DTYPE, ep=EP, grad_reduction="fsdp")
    )
    report = load_report(model)
    assert report is not None
    _, save_s, save_mem = _timed(lambda: model.save_pretrained(out, max_shard_size=SHARD))
    mine = [f for f in os.listdir(out) if f.endswith(".safetensors")]
    return {
        "load_s": load_s,
        "load_anon": load_mem.anon,
        "load_file": load_mem.file,
        "load_anon_after": load_mem.after,
        "held": _local_bytes(model),
        "bytes_read": report.bytes_read,
        "folder_bytes": report.folder_bytes,
        "regions": report.regions,
        "tensors": report.tensors,
        "save_s": save_s,
        "save_anon": save_mem.anon,
        "save_file": save_mem.file,
        "files_written": len(mine),
    }


def old_body(folder: str, out: str, warm: str | None) -> dict[str, Any]:
    """The way without hp-models' loader: every rank loads the whole model with stock
    ``from_pretrained`` and ``parallelize_model`` splits it; saving gathers the full state
    dict on rank 0, which writes it."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from hyper_parallel.models import parallelize_model
    from hyper_parallel.models.testing import import_transformers

    tf = import_transformers()
    plain_malloc()
    mesh = _mesh()

    def load(path: str) -> Any:
        model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=DTYPE)
        return parallelize_model(model, mesh, ep=EP, grad_reduction="fsdp")

    def save(model: Any, out: str) -> None:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        sd = cast(dict[str, torch.Tensor], get_model_state_dict(model, options=options))
        if dist.get_rank() == 0:
            os.makedirs(out, exist_ok=True)
            files: list[list[str]] = [[]]
            size = 0
            for key, t in sd.items():
                n = t.numel() * t.element_size()
                if files[-1] and size + n > 100 * 10**6:
                    files.append([])
                    size = 0
                files[-1].append(key)
                size += n
            for i, keys in enumerate(files):
                part = {k: sd[k].contiguous() for k in keys}
                save_file(part, os.path.join(out, f"model-{i + 1:05d}.safetensors"))
        del sd

    if warm is not None:
        save(load(warm), out + "-warm")  # the warm-up
    model, load_s, load_mem = _timed(lambda: load(folder))
    _, save_s, save_mem = _timed(lambda: save(model, out))
    return {
        "load_s": load_s,
        "load_anon": load_mem.anon,
        "load_file": load_mem.file,
        "load_anon_after": load_mem.after,
        "held": _local_bytes(model),
        "save_s": save_s,
        "save_anon": save_mem.anon,
        "save_file": save_mem.file,
    }


HF_CONFIGS: list[dict[str, Any]] = [
    {"tp_size": 2, "fsdp_size": 2, "ep_size": 4},
    {"tp_size": 4, "tp_plan": "auto"},
]


def hf_body(folder: str, warm: str | None, accelerate_dir: str | None) -> dict[str, Any]:
    """transformers' own distributed load on the same ranks: the first of ``HF_CONFIGS`` that
    runs (after one load of the tiny ``warm`` folder with it); the others' failures, one line
    each. ``accelerate_dir``: a folder holding the ``accelerate`` package (transformers needs it for
    a distributed load), put on ``sys.path`` in this process group only."""
    if accelerate_dir:
        import importlib
        import sys

        sys.path.insert(0, accelerate_dir)
        importlib.invalidate_caches()
    from transformers.distributed.configuration_utils import DistributedConfig

    from hyper_parallel.models.testing import import_transformers

    tf = import_transformers()
    plain_malloc()
    failures: list[str] = []
    try:
        import accelerate

        version: str | None = accelerate.__version__
    except ImportError:
        version = None

    def load(path: str, kw: dict[str, Any]) -> Any:
        config = DistributedConfig(**kw)
        return tf.AutoModelForCausalLM.from_pretrained(path, dtype=DTYPE, distributed_config=config)

    for kw in HF_CONFIGS:
        label = ", ".join(f"{k}={v!r}" for k, v in kw.items())
        dist.barrier()
        try:
            if warm is not None:
                load(warm, kw)
            model, load_s, mem = _timed(lambda kw=kw: load(folder, kw))
        except Exception as exc:  # every rank fails alike here (same folder, same config)
            first = (str(exc).strip().splitlines() or [""])[0][:240]
            failures.append(f"DistributedConfig({label}): {type(exc).__name__}: {first}")
            continue
        return {
            "config": f"DistributedConfig({label})",
            "load_s": load_s,
            "load_anon": mem.anon,
            "load_file": mem.file,
            "held": _local_bytes(model),
            "failures": failures,
            "accelerate": version,
        }
    return {"config": None, "failures": failures, "accelerate": version}


def stock_load(folder: str) -> dict[str, Any]:
    """Stock ``from_pretrained`` in this one process (no process group)."""
    from hyper_parallel.models.testing import import_transformers

    tf = import_transformers()
    plain_malloc()
    with RssPeak() as mem:
        start = time.perf_counter()
        model = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPE)
        seconds = time.perf_counter() - start
    del model
    gc.collect()
    return {"load_s": seconds, "load_anon": mem.anon, "load_file": mem.file}


# ---------------------------------------------------------------- report


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _frac(n: float, d: float) -> float:
    return n / d if d else float("nan")


def run_family(
    family: str, quick: bool, accelerate: str | None, timeout: float
) -> tuple[list[dict[str, Any]], str]:
    load_start = _loadavg()
    tmp = tempfile.mkdtemp(prefix="hp-bench-pretrained-")
    try:
        folder = os.path.join(tmp, "stock")
        # --quick: no warm-up loads (a smoke run: at its size the first-call costs dominate)
        warm = None if quick else os.path.join(tmp, "warm")
        if warm is not None:
            write_folder(family, quick, warm, tiny=True)
            stock_load(warm)
        t0 = time.perf_counter()
        info = write_folder(family, quick, folder)
        write_s = time.perf_counter() - t0
        wall: dict[str, float] = {"write_folder": write_s}

        def run(label: str, fn: Any, *args: Any) -> Any:
            start = time.perf_counter()
            out = (
                fn(*args)
                if label == "stock"
                else run_distributed(fn, WORLD, *args, timeout=timeout)
            )
            wall[label] = time.perf_counter() - start
            return out

        stock = run("stock", stock_load, folder)
        hp = run("hp", hp_body, folder, os.path.join(tmp, "hp"), warm)
        old = run("old", old_body, folder, os.path.join(tmp, "old"), warm)
        hf = run("hf_dist", hf_body, folder, warm, accelerate)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    model_b = info["model_bytes"]
    goal = model_b / WORLD + info["largest_tensor_bytes"]
    hf0 = hf[0]

    def worst(rows: list[dict[str, Any]], key: str) -> int:
        return max(r[key] for r in rows)

    common = {
        "device": "cpu",
        "family": family,
        "params": info["params"],
        "model_bytes": model_b,
        "largest_tensor": info["largest_tensor"],
        "largest_tensor_bytes": info["largest_tensor_bytes"],
        "goal_fraction": goal / model_b,
        "stock_files": info["files"],
        "dtype": "bfloat16",
        "mesh": f"cp={MESH[0]} x tp={MESH[1]}",
        "ep": EP,
        "grad_reduction": "fsdp",
        "quick": quick,
        "write_folder_s": write_s,
        "wall_s": wall,
        "load_avg_start": load_start,
        "load_avg_end": _loadavg(),
        "accelerate": hf0["accelerate"],
    }
    hp_fields = {
        "anon_load_fraction_ranks": [r["load_anon"] / model_b for r in hp],
        "anon_load_after_fraction_ranks": [r["load_anon_after"] / model_b for r in hp],
        "held_fraction_ranks": [r["held"] / model_b for r in hp],
        "bytes_read_fraction_ranks": [r["bytes_read"] / r["folder_bytes"] for r in hp],
        "bytes_read_sum_fraction": sum(r["bytes_read"] for r in hp) / hp[0]["folder_bytes"],
        "regions_ranks": [r["regions"] for r in hp],
        "file_load_fraction_ranks": [r["load_file"] / model_b for r in hp],
    }
    name = f"models_pretrained_{family}"
    hf_ok = hf0["config"] is not None
    records = [
        bench_record(
            f"{name}/load_hp_vs_every_rank_whole",
            hp[0]["load_s"],
            old[0]["load_s"],
            peak_mem_ours=worst(hp, "load_anon"),
            peak_mem_baseline=worst(old, "load_anon"),
            ours="from_pretrained(folder, mesh, ep=4) on 4 ranks",
            baseline="AutoModelForCausalLM.from_pretrained + parallelize_model on every rank",
            peak_mem="max over ranks of the RssAnon peak growth, bytes",
            **common,
            **hp_fields,
            anon_load_fraction_baseline_ranks=[r["load_anon"] / model_b for r in old],
            held_fraction_baseline_ranks=[r["held"] / model_b for r in old],
        ),
        bench_record(
            f"{name}/load_hp_vs_stock_one_process",
            hp[0]["load_s"],
            stock["load_s"],
            peak_mem_ours=worst(hp, "load_anon"),
            peak_mem_baseline=stock["load_anon"],
            ours="from_pretrained(folder, mesh, ep=4) on 4 ranks",
            baseline="AutoModelForCausalLM.from_pretrained in one process",
            **common,
        ),
        bench_record(
            f"{name}/save_hp_vs_full_state_dict_rank0",
            hp[0]["save_s"],
            old[0]["save_s"],
            peak_mem_ours=worst(hp, "save_anon"),
            peak_mem_baseline=worst(old, "save_anon"),
            ours="model.save_pretrained(out) on every rank",
            baseline="get_model_state_dict(full_state_dict, cpu_offload) + save_file on rank 0",
            **common,
            anon_save_fraction_ranks=[r["save_anon"] / model_b for r in hp],
            anon_save_fraction_baseline_ranks=[r["save_anon"] / model_b for r in old],
            files_written_ranks=[r["files_written"] for r in hp],
        ),
    ]
    hf_fields = {"hf_distributed_failures": hf0["failures"]}
    if hf_ok:
        records.append(
            bench_record(
                f"{name}/load_hp_vs_hf_distributed",
                hp[0]["load_s"],
                hf0["load_s"],
                peak_mem_ours=worst(hp, "load_anon"),
                peak_mem_baseline=worst(hf, "load_anon"),
                ours="from_pretrained(folder, mesh, ep=4) on 4 ranks",
                baseline=f"transformers from_pretrained(distributed_config={hf0['config']})",
                **common,
                **hf_fields,
                anon_load_fraction_baseline_ranks=[r["load_anon"] / model_b for r in hf],
                held_fraction_baseline_ranks=[r["held"] / model_b for r in hf],
            )
        )
    else:  # the failure goes with the stock comparison
        records[1].update(hf_fields)
    table = _table(family, info, goal, stock, hp, old, hf)
    table += "\nwall seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in wall.items())
    return records, table


def _mb(n: float) -> str:
    return f"{n / 1e6:.0f} MB"


def _table(
    family: str,
    info: dict[str, Any],
    goal: float,
    stock: dict[str, Any],
    hp: list[dict[str, Any]],
    old: list[dict[str, Any]],
    hf: list[dict[str, Any]],
) -> str:
    m = info["model_bytes"]

    def fr(rows: list[dict[str, Any]], key: str) -> str:
        vals = [r[key] / m for r in rows]
        return f"{min(vals):.2f}–{max(vals):.2f}" if len(vals) > 1 else f"{vals[0]:.2f}"

    read = [r["bytes_read"] / r["folder_bytes"] for r in hp]
    lines = [
        f"{family}: {info['params'] / 1e6:.0f}M parameters, {_mb(m)} bf16 in "
        f"{info['files']} files; largest tensor {info['largest_tensor']} "
        f"{_mb(info['largest_tensor_bytes'])}; goal 1/P + largest = {goal / m:.2f} of the model",
        "",
        "| 4 ranks, (cp, tp) = (2, 2), ep 4, FSDP2 | time (s) | anon peak growth per rank "
        "(× model) | file pages touched per rank (× model) | read per rank (× folder) |",
        "|---|---:|---:|---:|---:|",
        f"| load: hp-models `from_pretrained` | {hp[0]['load_s']:.2f} | {fr(hp, 'load_anon')} | "
        f"{fr(hp, 'load_file')} | {min(read):.2f}–{max(read):.2f} |",
        f"| load: stock `from_pretrained` on every rank + `parallelize_model` | "
        f"{old[0]['load_s']:.2f} | {fr(old, 'load_anon')} | {fr(old, 'load_file')} | 1 |",
        f"| load: stock `from_pretrained`, one process | {stock['load_s']:.2f} | "
        f"{stock['load_anon'] / m:.2f} | {stock['load_file'] / m:.2f} | 1 |",
    ]
    hf0 = hf[0]
    if hf0["config"] is not None:
        lines.append(
            f"| load: transformers `{hf0['config']}` | {hf0['load_s']:.2f} | "
            f"{fr(hf, 'load_anon')} | {fr(hf, 'load_file')} | - |"
        )
    lines += [
        f"| save: hp-models `save_pretrained` (every rank writes) | {hp[0]['save_s']:.2f} | "
        f"{fr(hp, 'save_anon')} | - | - |",
        f"| save: full state dict on rank 0 (`get_model_state_dict`) + `save_file` | "
        f"{old[0]['save_s']:.2f} | {fr(old, 'save_anon')} | - | - |",
    ]
    held = [r["held"] / m for r in hp]
    lines.append("")
    lines.append(
        f"hp-models: each rank holds {min(held):.3f}–{max(held):.3f} of the model after the "
        f"load; its anonymous memory stays {fr(hp, 'load_anon_after')} above the start."
    )
    for f in hf0["failures"]:
        lines.append(f"transformers distributed load failed: {f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = bench_arguments(__doc__)
    p.add_argument(
        "--family",
        choices=("kimi", "deepseek", "both"),
        default=None,
        help="default: both (kimi with --quick)",
    )
    p.add_argument(
        "--accelerate",
        default=None,
        metavar="DIR",
        help="a folder holding the accelerate package (pip install --no-deps --target DIR "
        "accelerate), put on sys.path for transformers' distributed load only",
    )
    a = p.parse_args(argv)
    if a.device != "cpu":
        raise SystemExit("bench_pretrained measures host memory: --device cpu only")
    plain_malloc()
    family = a.family or ("kimi" if a.quick else "both")
    families = ["kimi", "deepseek"] if family == "both" else [family]
    records: list[dict[str, Any]] = []
    for family in families:
        recs, table = run_family(family, a.quick, a.accelerate, timeout=600.0)
        records += recs
        print(table)
        print()
    write_records(a.out, records)
    print(json.dumps({"load_avg_end": _loadavg()}))


if __name__ == "__main__":
    main()
