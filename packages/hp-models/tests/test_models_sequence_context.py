"""One sequence context per forward: a parallelised stock Kimi-Linear (KDA + MLA) and
DeepSeek-V3 (MLA) on 4 gloo ranks, float64, consistency mode off.

- A packed forward hands every layer hp-dtensor's ``SequenceContext``: with labels it issues
  exactly the collectives of the same forward without documents (no block-lengths all-gather,
  no fingerprint all-gather: the fingerprint rides on the loss-token all-reduce), and no layer
  reads the table back to the host (the forward reads it once).
- Ranks of one sequence given different ``cu_seqlens`` tables (rank 0's differs): with labels,
  and without (the first layer compares the fingerprint: Kimi-Linear's KDA with one small
  all-gather, DeepSeek-V3's MLA in its first exchange), every rank raises the same
  ``SequenceMismatchError``, on (cp, tp) = (2, 2) and on (dp, cp, tp) = (2, 2, 1) with only
  replica 1's ranks disagreeing (with labels every rank of the batch raises, the loss-token
  all-reduce spanning the replicas; without, the ranks of replica 1); afterwards the model
  runs a good batch again.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from hyper_parallel.dtensor import init_device_mesh, unflatten
from hyper_parallel.dtensor.recorder import record_events
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.models import IGNORE_INDEX, parallelize_model, shard_batch
from hyper_parallel.models.testing import tiny_model

SEQ = 16
OFFSETS = [0, 3, 4, 8, 9, 16]


class _TableReads(TorchFunctionMode):
    """Counts the ``tolist`` calls on one tensor (the table)."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table, self.n = table, 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") == "tolist" and args and args[0] is self.table:
            self.n += 1
        return func(*args, **(kwargs or {}))


def _batch(rows: int, packed: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 48, (rows, SEQ), generator=g)
    labels = ids.clone()
    batch = {"input_ids": ids, "labels": labels}
    if packed:
        pos = torch.cat([torch.arange(b - a) for a, b in zip(OFFSETS, OFFSETS[1:])])
        labels[:, OFFSETS[:-1]] = IGNORE_INDEX
        batch["position_ids"] = pos[None].expand(rows, SEQ).contiguous()
    return batch


def _caught(fn: Any) -> str:
    try:
        fn()
    except ValueError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _launches(model: Any, local: dict[str, Any]) -> list[str]:
    with record_events() as rec:
        model(**local)
    return sorted(rec.names("launch", "forward"))


MESHES = {2: ((2, 2), ("cp", "tp")), 3: ((2, 2, 1), ("dp", "cp", "tp"))}


def _run(dims: int) -> dict[str, Any]:
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    rank = dist.get_rank()
    res: dict[str, Any] = {}
    for kind in ("kimi", "deepseek"):
        for shape, names in (MESHES[dims],):
            mesh = unflatten(world, "world", shape, names)
            model = parallelize_model(tiny_model(kind), mesh, grad_reduction="allreduce")
            dp = shape[0] if len(shape) == 3 else 1
            local = shard_batch(_batch(dp), mesh)
            tag = f"{kind}{len(shape)}"
            if len(shape) == 2:
                plain = shard_batch(_batch(dp, packed=False), mesh)
                res[f"{tag}_launches"] = (_launches(model, local), _launches(model, plain))
                reads = _TableReads(local["cu_seqlens"])
                with reads:
                    model(**local)
                res[f"{tag}_table_reads"] = reads.n
            # rank 0 (2-D) / rank 2 (replica 1 of the 3-D mesh) is given another table
            odd = rank == (0 if len(shape) == 2 else 2)
            bad = {**local, "cu_seqlens": torch.tensor([0, 5, SEQ])} if odd else dict(local)
            res[f"{tag}_labels"] = _caught(lambda m=model, b=bad: m(**b))
            nolabels = {k: v for k, v in bad.items() if k not in ("labels", "shift_labels")}
            res[f"{tag}_nolabels"] = _caught(lambda m=model, b=nolabels: m(**b))
            res[f"{tag}_after"] = _caught(lambda m=model, b=local: m(**b).loss.backward())
    return res


@pytest.mark.timeout(600)
@pytest.mark.parametrize("dims", [2, 3])
def test_one_sequence_context_per_forward_and_mismatched_tables_raise_everywhere(
    dims: int,
) -> None:
    results = run_distributed(_run, 4, dims, timeout=540)
    for kind in ("kimi", "deepseek"):
        for r in results:
            if dims == 2:
                packed, plain = r[f"{kind}2_launches"]
                assert packed == plain, (kind, packed, plain)  # no collective for documents
                assert r[f"{kind}2_table_reads"] == 1  # read once per forward, by the context
            assert r[f"{kind}{dims}_after"] == "no error"
        for case in ("labels", "nolabels"):
            # without labels the layers compare within each sequence group: with dp, the
            # ranks of the replica that disagrees (2, 3); with labels every rank of the batch
            ranks = [2, 3] if (dims, case) == (3, "nolabels") else [0, 1, 2, 3]
            if ranks != [0, 1, 2, 3]:
                assert {results[r][f"{kind}{dims}_{case}"] for r in (0, 1)} == {"no error"}
            messages = {results[r][f"{kind}{dims}_{case}"] for r in ranks}
            assert len(messages) == 1, (kind, dims, case, messages)  # the same everywhere
            (message,) = messages
            assert message.startswith("SequenceMismatchError: "), message
            assert "different packed-document tables" in message
