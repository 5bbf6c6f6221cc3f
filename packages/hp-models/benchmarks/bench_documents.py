"""Packed documents under context parallelism: many short documents vs one document of the
same length, at 2 gloo ranks on CPU, float32, forward + backward, interleaved, median.

1. The stock Hugging Face ``KimiLinearDeltaAttention`` under ``parallelize_kda`` (hidden 256,
   4 heads of 64, T = 2048 over 2 ranks): one document vs 64 documents of 32 tokens.
2. A whole Kimi-Linear step (``tiny_model("kimi")`` widened to hidden 128, 4 layers: KDA, MLA,
   KDA, MLA) under ``parallelize_model`` on (cp, tp) = (2, 1): ``model(**shard_batch(batch))``
   loss + backward, one document vs 32 documents of 32 tokens (T = 1024).

Bytes received per rank are counted at the torch.distributed calls (receives, the received
part of all-gathers and all-to-alls, all-reduces, broadcasts from other ranks).

    python packages/hp-models/benchmarks/bench_documents.py
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from hyper_parallel.dtensor import init_device_mesh, unflatten
from hyper_parallel.dtensor.benchmarking import interleaved_timing
from hyper_parallel.dtensor.testing import run_distributed


class ByteCounter:
    """Bytes this rank receives in torch.distributed calls while active."""

    NAMES = ("recv", "irecv", "broadcast", "all_reduce", "all_gather_into_tensor",
             "_all_gather_base", "all_gather_single", "all_to_all_single",
             "reduce_scatter_tensor", "reduce_scatter_single")  # fmt: skip

    def __init__(self) -> None:
        self.bytes = 0
        self.saved: dict[str, Any] = {}

    def _received(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        P = dist.get_world_size(kwargs.get("group"))
        t = args[0]
        if name in ("recv", "irecv", "all_reduce"):
            return int(t.nbytes)
        if name == "broadcast":
            src = args[1] if len(args) > 1 else kwargs.get("src")
            return 0 if src == dist.get_rank() else int(t.nbytes)
        if name in ("all_gather_into_tensor", "_all_gather_base", "all_gather_single"):
            return int(t.nbytes - args[1].nbytes)
        if name == "all_to_all_single":
            return int(t.nbytes * (P - 1) // P)
        if name in ("reduce_scatter_tensor", "reduce_scatter_single"):
            return int(args[1].nbytes - t.nbytes)
        return 0

    def __enter__(self) -> ByteCounter:
        for name in self.NAMES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self.saved[name] = fn

            def wrapped(*args: Any, _n: str = name, _f: Any = fn, **kwargs: Any) -> Any:
                self.bytes += self._received(_n, args, kwargs)
                return _f(*args, **kwargs)

            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def _offsets(T: int, n_docs: int) -> list[int]:
    return [T * i // n_docs for i in range(n_docs + 1)]


def _measure(cases: dict[str, Callable[[], None]]) -> dict[str, tuple[float, int]]:
    times = interleaved_timing(cases, repeats=7, warmup=1)
    out = {}
    for name, fn in cases.items():
        with ByteCounter() as counter:
            fn()
        out[name] = (times[name], counter.bytes)
    return out


def bench_layer() -> dict[str, tuple[float, int]]:
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi

    from hyper_parallel.kda import parallelize_kda
    from hyper_parallel.kda.testing import import_torch_path

    kimi = import_torch_path(kimi.__name__)
    torch.manual_seed(0)
    config = KimiLinearConfig(
        hidden_size=256, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
        linear_attn_config={"head_dim": 64, "num_heads": 4, "short_conv_kernel_size": 4},
    )  # fmt: skip
    layer = kimi.KimiLinearDeltaAttention(config, layer_idx=0)
    for p in layer.parameters():  # the bare layer leaves the gate parameters uninitialised
        torch.nn.init.normal_(p, std=0.02)
    with torch.no_grad():
        layer.forget_gate.A_log.fill_(0.0)
        layer.forget_gate.dt_bias.fill_(-3.0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    layer = parallelize_kda(copy.deepcopy(layer), mesh, protocol="auto")
    T, P, r = 2048, dist.get_world_size(), dist.get_rank()
    x = torch.randn(1, T, 256, generator=torch.Generator().manual_seed(1))
    x = x[:, r * T // P : (r + 1) * T // P].clone().requires_grad_()

    def step(n_docs: int) -> Callable[[], None]:
        table = torch.tensor(_offsets(T, n_docs))

        def run() -> None:
            kw = {} if n_docs == 1 else {"cu_seqlens": table}
            layer(x, **kw).sum().backward()

        return run

    return _measure({"1 document": step(1), "64 documents": step(64)})


def bench_model() -> dict[str, tuple[float, int]]:
    from hyper_parallel.models import parallelize_model, shard_batch
    from hyper_parallel.models.testing import tiny_model

    P = dist.get_world_size()
    world = init_device_mesh("cpu", (P,), mesh_dim_names=("world",))
    mesh = unflatten(world, "world", (P, 1), ("cp", "tp"))
    model = tiny_model(
        "kimi", dtype=torch.float32, hidden_size=128, intermediate_size=256,
        linear_head_dim=32, max_position_embeddings=4096,
    )  # fmt: skip
    model = parallelize_model(model, mesh, grad_reduction="allreduce")
    T = 1024
    ids = torch.randint(3, 48, (1, T), generator=torch.Generator().manual_seed(2))

    def step(n_docs: int) -> Callable[[], None]:
        offsets = _offsets(T, n_docs)
        pos = torch.cat([torch.arange(b - a) for a, b in zip(offsets, offsets[1:])])[None]
        labels = ids.clone()
        labels[0, offsets[:-1]] = -100
        local = shard_batch({"input_ids": ids, "labels": labels, "position_ids": pos}, mesh)

        def run() -> None:
            model.zero_grad(set_to_none=True)
            model(**local).loss.backward()

        return run

    return _measure({"1 document": step(1), "32 documents": step(32)})


def _body() -> dict[str, Any]:
    torch.set_num_threads(1)
    return {"layer": bench_layer(), "model": bench_model()}


def _records(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per comparison: ours = many documents, baseline = one document of the same
    length (the slowest rank's median step; bytes received per rank, the largest rank's)."""
    out = []
    for what, name in (("layer", "models_documents/kda_layer_T2048"),
                       ("model", "models_documents/kimi_step_T1024")):  # fmt: skip
        one, many = list(results[0][what])
        t = {c: max(r[what][c][0] for r in results) for c in (one, many)}
        b = {c: max(r[what][c][1] for r in results) for c in (one, many)}
        out.append({
            "name": f"{name}/{many.split()[0]}_docs_vs_1_doc", "ours_s": t[many],
            "baseline_s": t[one], "ratio": t[many] / t[one], "bytes_ours": b[many],
            "bytes_baseline": b[one], "device": "cpu", "world_size": len(results),
        })  # fmt: skip
    return out


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="append the records to this JSON list")
    parser.add_argument("--quick", action="store_true", help="accepted; the shapes are fixed")
    cli = parser.parse_args()
    results = run_distributed(_body, 2, timeout=1200)
    for what, title in (("layer", "KDA layer (T=2048)"), ("model", "Kimi-Linear step (T=1024)")):
        for case in results[0][what]:
            times = [r[what][case][0] for r in results]
            sent = [r[what][case][1] for r in results]
            print(f"{title}, {case}: {max(times) * 1e3:.1f} ms, bytes received per rank {sent}")
    if cli.out:
        from hyper_parallel.dtensor.benchmarking import write_records

        write_records(cli.out, _records(results))
