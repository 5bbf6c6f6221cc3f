"""shard_batch gives rank (c, t) block c·tp + t with global positions and labels shifted on
the full sequence; gather_sequence puts the blocks back in order; on every mesh shape."""

from __future__ import annotations

import pytest
import torch

from hyper_parallel.dtensor import init_device_mesh, unflatten
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.models import IGNORE_INDEX, gather_sequence, sequence_mesh, shard_batch


def _blocks(shapes):
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    ids = torch.arange(2 * 16).view(2, 16) + 100
    labels = ids.clone()
    labels[1, 9] = IGNORE_INDEX
    out = {}
    for cp, tp in shapes:
        mesh = unflatten(world, "world", (cp, tp), ("cp", "tp"))
        local = shard_batch({"input_ids": ids, "labels": labels}, mesh)
        x = torch.randn(2, 4, 3, generator=torch.Generator().manual_seed(sequence_mesh(mesh).block))
        out[(cp, tp)] = {
            "coord": tuple(mesh.get_coordinate()),
            "block": sequence_mesh(mesh).block,
            "local": local,
            "gathered": gather_sequence(local["input_ids"], mesh),
            "gathered_x": gather_sequence(x, mesh, seq_dim=1),
            "x": x,
        }
    return out


@pytest.mark.timeout(120)
def test_shard_batch_and_gather_sequence_follow_block_order():
    shapes = [(2, 2), (4, 1), (1, 4)]
    results = run_distributed(_blocks, 4, shapes, timeout=90)
    ids = torch.arange(2 * 16).view(2, 16) + 100
    shifted = torch.cat([ids[:, 1:], torch.full((2, 1), IGNORE_INDEX)], dim=1)
    shifted[1, 8] = IGNORE_INDEX
    for cp, tp in shapes:
        xs = {}
        for rank, res in enumerate(results):
            r = res[(cp, tp)]
            c, t = r["coord"]
            assert rank == c * tp + t  # row-major (cp outer, tp inner)
            b = r["block"]
            assert b == c * tp + t
            cols = slice(4 * b, 4 * b + 4)
            assert torch.equal(r["local"]["input_ids"], ids[:, cols])
            assert torch.equal(r["local"]["position_ids"], torch.arange(16)[cols].expand(2, 4))
            # the last target of block b is the first token of block b + 1
            assert torch.equal(r["local"]["shift_labels"], shifted[:, cols])
            assert r["local"]["labels"] is r["local"]["shift_labels"]
            assert torch.equal(r["gathered"], ids)
            xs[b] = r["x"]
        full = torch.cat([xs[b] for b in range(4)], dim=1)
        for res in results:
            assert torch.equal(res[(cp, tp)]["gathered_x"], full)
