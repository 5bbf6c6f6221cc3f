"""Packed documents with data parallelism: on a ("dp", "cp", "tp") = (2, 2, 1) mesh (4 gloo
ranks) a batch of B = dp = 2 packed rows, each row its own documents (from its own
``position_ids``), gives every dp replica its row's ``cu_seqlens`` (the same on its cp ranks,
different between replicas) and a loss and gradients (after ``sync_gradients``) equal to the
stock serial model run on each document of each row alone, float64, Kimi-Linear (KDA + MLA)
and DeepSeek-V3. Rejected with ``ValueError`` on every rank, before any communication: a
``cu_seq_lens_q`` table with dp > 1, and several documents in a replica of B/dp > 1 rows."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _models_testutil import grads, shard_errors, shifted_loss

from hyper_parallel.dtensor import init_device_mesh, unflatten
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.models import IGNORE_INDEX, parallelize_model, shard_batch, sync_gradients
from hyper_parallel.models.testing import tiny_model

SEQ = 16
ROWS = ([0, 3, 4, 8, 9, 16], [0, 8, 13, 14, 16])  # each dp replica's documents
KINDS = ("kimi", "deepseek")


def _batch(rows: tuple[list[int], ...] = ROWS) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, 48, (len(rows), SEQ), generator=g)
    labels = ids.clone()
    pos = torch.stack([torch.cat([torch.arange(b - a) for a, b in zip(o, o[1:])]) for o in rows])
    for r, o in enumerate(rows):
        labels[r, o[:-1]] = IGNORE_INDEX  # the flattening collator's labels
    return {"input_ids": ids, "labels": labels, "position_ids": pos}


def _serial(kind: str) -> dict[str, Any]:
    """The stock model on each document of each row alone; the loss over the whole batch."""
    model = tiny_model(kind)
    batch = _batch()
    ids, labels = batch["input_ids"], batch["labels"]
    logits = torch.cat(
        [
            torch.cat([model(input_ids=ids[r : r + 1, a:b]).logits for a, b in zip(o, o[1:])], 1)
            for r, o in enumerate(ROWS)
        ]
    )
    loss = shifted_loss(logits, labels)
    loss.backward()
    return {"loss": loss.item(), "logits": logits.detach(), "grads": grads(model)}


def _bad(mesh: Any) -> dict[str, str]:
    good = _batch()
    four = _batch((ROWS[0], ROWS[0], ROWS[1], ROWS[1]))
    cases = {
        "table_with_dp": {**good, "cu_seq_lens_q": torch.tensor(ROWS[0])},
        "two_rows_per_replica": four,
    }
    return shard_errors(cases, mesh)


def _run() -> dict[str, Any]:
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    mesh = unflatten(world, "world", (2, 2, 1), ("dp", "cp", "tp"))
    res: dict[str, Any] = {"coord": tuple(mesh.get_coordinate())}
    res["bad"] = _bad(mesh)  # before any model collective
    for kind in KINDS:
        model = parallelize_model(tiny_model(kind), mesh, grad_reduction="allreduce")
        local = shard_batch(_batch(), mesh)
        out = model(**local)
        out.loss.backward()
        sync_gradients(model)
        res[kind] = {
            "loss": out.loss.item(),
            "logits": out.logits.detach(),
            "grads": grads(model),
            "table": local["cu_seqlens"].tolist(),
            "ids": local["input_ids"],
        }
    return res


BAD = {
    "table_with_dp": "packed documents come from position_ids",
    "two_rows_per_replica": "dp replica 0: rows [0, 2) of B=4",
}


@pytest.mark.timeout(420)
def test_packed_rows_per_dp_replica_give_each_document_alone() -> None:
    results = run_distributed(_run, 4, timeout=400)
    full = _batch()["input_ids"]
    for r in results:
        for name, fragment in BAD.items():
            assert fragment in r["bad"][name], (name, r["bad"][name])
    for kind in KINDS:
        ref = _serial(kind)
        for r in results:
            d, c, _ = r["coord"]
            got = r[kind]
            assert got["table"] == ROWS[d], (kind, r["coord"], got["table"])
            assert torch.equal(got["ids"], full[d : d + 1, c * 8 : (c + 1) * 8])
            assert got["loss"] == pytest.approx(ref["loss"], rel=2e-6), kind
            torch.testing.assert_close(
                got["logits"], ref["logits"][d : d + 1, c * 8 : (c + 1) * 8], rtol=1e-5, atol=1e-6
            )
            for name, want in ref["grads"].items():
                assert want.abs().max() > 0, (kind, name)
                torch.testing.assert_close(
                    got["grads"][name], want, rtol=1e-5, atol=1e-6, msg=f"{kind} {name}"
                )
