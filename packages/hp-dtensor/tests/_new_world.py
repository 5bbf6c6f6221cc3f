"""A new default process group over the same ranks, for tests that check what follows a new
world (caches, groups, both mesh paths in one spawn)."""

from __future__ import annotations

import uuid

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store


def new_world() -> None:
    """Replace the default process group by a new one over the same ranks, every rank calling
    it. The ranks meet again in the old world's store under a fresh prefix that rank 0 names
    (sent to every rank): no new TCP port, for a port found free and bound only later can
    meanwhile be taken by another process of the machine (another test lane's store), and the
    ranks would meet in that process's store."""
    name = torch.zeros(32, dtype=torch.uint8)
    if dist.get_rank() == 0:
        name = torch.tensor(list(uuid.uuid4().hex.encode()), dtype=torch.uint8)
    dist.broadcast(name, src=0)
    store = _get_default_store()  # held here: it outlives the old group
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    prefix = f"new-world-{bytes(name.tolist()).decode()}/"
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(prefix, store), rank=rank, world_size=world
    )
