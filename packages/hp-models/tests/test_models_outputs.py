"""The output forms a user meets besides ``out.loss`` give the serial answer: the tuple form
(``return_dict=False``) carries the global loss first, and a
loss computed by the user from ``out.logits`` through ``global_mean_loss`` gives the serial
loss and, after ``sync_gradients``, the serial gradients (float64, both model families, cp=2
and tp=2 on 2 ranks). A plain local mean is shown to be wrong, so the helper is needed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _models_testutil import grads

from hyper_parallel.dtensor import init_device_mesh, unflatten
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.models import (
    IGNORE_INDEX,
    global_mean_loss,
    parallelize_model,
    shard_batch,
    sync_gradients,
)
from hyper_parallel.models.testing import random_batch, tiny_model

SHAPES = [(2, 1), (1, 2)]
KINDS = ["kimi", "deepseek"]


def _local_ce_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(
        logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
        reduction="sum",
    )  # fmt: skip


def _bad_calls(mesh: Any) -> list[tuple[str, str]]:
    """Rejected on every rank alike: the first two before any collective, an empty batch
    once the token count is summed (every rank sees the same total)."""
    errors = []
    for args in [(torch.ones(3), 3), (torch.ones(()), torch.ones(2)), (torch.ones(()), 0)]:
        try:
            global_mean_loss(*args, mesh)  # type: ignore[arg-type]
        except ValueError as exc:
            errors.append(("ValueError", str(exc)))
        else:
            errors.append(("accepted", ""))
    return errors


BAD_CALLS = [
    "local_sum must be a 0-d tensor",
    "local_count must be a number or a 0-d tensor",
    "no token in the whole batch",
]


def _run() -> dict[str, Any]:
    world = init_device_mesh("cpu", (2,), mesh_dim_names=("world",))
    batch = random_batch(seq=16)
    res: dict[str, Any] = {}
    for kind in KINDS:
        for cp, tp in SHAPES:
            mesh = unflatten(world, "world", (cp, tp), ("cp", "tp"))
            model = parallelize_model(tiny_model(kind), mesh, grad_reduction="allreduce")
            local = shard_batch(batch, mesh)
            out = model(**local)
            tup = model(**local, return_dict=False)
            targets = local["shift_labels"]
            count = int((targets != IGNORE_INDEX).sum())
            ce_sum = _local_ce_sum(out.logits, targets)
            mean = global_mean_loss(ce_sum, count, mesh)
            naive = (ce_sum / count).item()  # the local mean: a different number per rank
            mean.backward()
            sync_gradients(model)
            res[("errors", kind, cp, tp)] = _bad_calls(mesh)
            res[(kind, cp, tp)] = {
                "loss": out.loss.item(),
                "tuple_type": type(tup).__name__,
                "tuple_loss": tup[0].item(),
                "tuple_logits": torch.equal(tup[1], out.logits),
                "mean": mean.item(),
                "naive": naive,
                "grads": grads(model),
            }
    return res


def _serial(kind: str) -> tuple[float, dict[str, torch.Tensor]]:
    model = tiny_model(kind)
    batch = random_batch(seq=16)
    loss = model(**batch).loss
    loss.backward()
    return loss.item(), grads(model)


@pytest.mark.timeout(240)
def test_tuple_outputs_and_user_losses_give_the_serial_answer():
    results = run_distributed(_run, 2, timeout=200)
    for kind in KINDS:
        ref_loss, ref_grads = _serial(kind)
        for cp, tp in SHAPES:
            key = (kind, cp, tp)
            a, b = (r[key] for r in results)
            for r in (a, b):
                assert r["tuple_type"] == "tuple", key
                assert r["tuple_logits"], key
                for field in ("loss", "tuple_loss", "mean"):
                    assert r[field] == pytest.approx(ref_loss, rel=2e-6), (key, field)
            for r in results:
                for (kind_, words), (got, msg) in zip(
                    [("ValueError", w) for w in BAD_CALLS], r[("errors", kind, cp, tp)]
                ):
                    assert got == kind_ and words in msg, (key, words, got, msg)
            # the local mean differs across ranks and from the loss: why the helper exists
            assert abs(a["naive"] - b["naive"]) > 1e-6, key
            assert set(a["grads"]) == set(ref_grads), key
            for name, g in ref_grads.items():
                for r in (a, b):
                    torch.testing.assert_close(
                        r["grads"][name], g, rtol=2e-5, atol=2e-6, msg=f"{key} {name}"
                    )
