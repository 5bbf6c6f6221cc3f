"""The setup every stock Kimi-Linear benchmark here shares (bench_models, bench_precision,
bench_checkpointing): the command line, the model's shape, the (cp, tp) mesh over all ranks,
the float32 model and the batch (B = 1, ``seq`` tokens) with this rank's block of it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hyper_parallel.dtensor import init_device_mesh, unflatten
from hyper_parallel.dtensor.benchmarking import bench_arguments
from hyper_parallel.models import shard_batch
from hyper_parallel.models.testing import random_batch, tiny_model

VOCAB = 512


def config(
    doc: str | None, argv: list[str] | None, quick: tuple[int, int, int], full: tuple[int, int, int]
) -> tuple[dict[str, Any], str]:
    """``(cfg, out)`` from the command line; ``quick`` / ``full``: default (seq, hidden,
    repeats) with and without ``--quick``."""
    p = bench_arguments(doc)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    a = p.parse_args(argv)
    seq, hidden, repeats = quick if a.quick else full
    cfg = {
        "device": a.device,
        "seq": a.seq or seq,
        "hidden": a.hidden or hidden,
        "ffn": 2 * (a.hidden or hidden),
        "heads": 8,
        "head_dim": 32 if a.quick else 64,
        "repeats": a.repeats or repeats,
    }
    return cfg, a.out


@dataclass
class Setup:
    device: torch.device
    world: Any  # the 1-D mesh over every rank
    mesh: Any  # ("cp", "tp") = (2, world size / 2)
    cfg: dict[str, Any]
    batch: dict[str, torch.Tensor]  # the whole batch [1, seq], on the device
    local: dict[str, torch.Tensor]  # this rank's block (shard_batch), on the device

    def build(self) -> nn.Module:
        """A fresh float32 stock Kimi-Linear (KDA, MLA, KDA, MLA; dense MLPs), seed 0."""
        cfg = self.cfg
        shape = {
            "hidden_size": cfg["hidden"],
            "intermediate_size": cfg["ffn"],
            "num_attention_heads": cfg["heads"],
            "num_key_value_heads": cfg["heads"],
            "linear_num_heads": cfg["heads"],
            "linear_head_dim": cfg["head_dim"],
            "kv_lora_rank": cfg["head_dim"],
            "qk_nope_head_dim": cfg["head_dim"],
            "v_head_dim": cfg["head_dim"],
            "qk_rope_head_dim": 16,
            "vocab_size": VOCAB,
            "mlp_layer_types": ["dense"] * 4,
        }
        return tiny_model("kimi", seed=0, dtype=torch.float32, **shape).to(self.device)

    def extra(self) -> dict[str, Any]:
        """The shape fields every record carries."""
        return {
            "seq": self.cfg["seq"],
            "hidden": self.cfg["hidden"],
            "heads": self.cfg["heads"],
            "head_dim": self.cfg["head_dim"],
            "mesh": f"cp=2 x tp={self.mesh.shape[1]}",
            "repeats": self.cfg["repeats"],
        }


def setup(cfg: dict[str, Any]) -> Setup:
    """On every rank, inside the benchmark's body."""
    device = torch.device(cfg["device"])
    ws = dist.get_world_size()
    world = init_device_mesh(device.type, (ws,), mesh_dim_names=("world",))
    mesh = unflatten(world, "world", (2, ws // 2), ("cp", "tp"))
    batch = random_batch(vocab=VOCAB, bsz=1, seq=cfg["seq"], seed=1)
    local = {k: v.to(device) for k, v in shard_batch(batch, mesh).items()}
    full = {k: v.to(device) for k, v in batch.items()}
    return Setup(device, world, mesh, cfg, full, local)
