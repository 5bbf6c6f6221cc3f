"""hp-models' own collectives (the loss's token count and sum, ``global_mean_loss``,
``sync_gradients``' flags and buckets, ``clip_grad_norm_``'s norms, ``gather_sequence``) start
through hp-dtensor's comm runtime: each is recorded by ``record_events`` (with its bytes), shows
in a ``torch.profiler`` trace as ``hp.comm.launch`` / ``hp.comm.wait`` ranges, and nothing is
left pending; the results stay the serial ones (the other tests check the numbers; here the
inf-norm, now a gather then max, against the 2-norm path and torch's own clip)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hyper_parallel.dtensor import comm, init_device_mesh, unflatten
from hyper_parallel.dtensor.recorder import record_events
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.models import (
    clip_grad_norm_,
    gather_sequence,
    global_mean_loss,
    parallelize_model,
    shard_batch,
    sync_gradients,
)
from hyper_parallel.models.testing import random_batch, tiny_model


def _run() -> dict[str, Any]:
    world = init_device_mesh("cpu", (2,), mesh_dim_names=("world",))
    mesh = unflatten(world, "world", (1, 2), ("cp", "tp"))  # tp = 2: clipping communicates
    batch = random_batch(seq=16)
    local = shard_batch(batch, mesh)
    serial = tiny_model("kimi")
    model = parallelize_model(tiny_model("kimi"), mesh, grad_reduction="allreduce")
    res: dict[str, Any] = {}
    with record_events() as rec:
        out = model(**local)
        out.loss.backward()
        sync_gradients(model)
        inf_norm = clip_grad_norm_(model, 1e9, norm_type=float("inf"))  # 1e9: nothing clipped
        gather_sequence(local["input_ids"], mesh)
        targets = local["shift_labels"]
        ce = torch.nn.functional.cross_entropy(
            out.logits.detach().flatten(0, 1), targets.flatten(), reduction="sum"
        )
        global_mean_loss(ce, (targets != -100).sum(), mesh)
    res["launched"] = sorted(set(rec.names("launch")))
    res["bytes"] = rec.bytes_received() > 0
    with torch.profiler.profile() as prof:
        model.zero_grad(set_to_none=True)
        model(**local).loss.backward()
        sync_gradients(model)
    res["profiled"] = sorted({e.name for e in prof.events() if e.name.startswith("hp.comm")})
    res["pending"] = comm.pending_collectives()
    # the serial inf-norm of the same gradients (torch's own)
    serial(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss.backward()
    res["inf_norm"] = (
        inf_norm.item(),
        max(p.grad.abs().max().item() for p in serial.parameters() if p.grad is not None),
    )
    return res


@pytest.mark.timeout(120)
def test_hp_models_collectives_are_recorded_and_profiled():
    for res in run_distributed(_run, 2, timeout=90):
        for name in (
            "all_reduce:loss_tokens",  # the forward's count of targets
            "all_reduce:loss",  # the loss's sum of shares
            "all_reduce:grad_flags",  # sync_gradients: which gradients exist
            "all_reduce:grads_world",  # sync_gradients: one bucket
            "all_gather:sequence",  # gather_sequence
            "all_gather:grad_norm_max",  # clip_grad_norm_(norm_type=inf) over tp
        ):
            assert name in res["launched"], (name, res["launched"])
        assert res["bytes"]
        for name in ("all_reduce:loss", "all_reduce:grads_world", "all_reduce:grad_flags"):
            assert f"hp.comm.launch {name}" in res["profiled"], res["profiled"]
            assert f"hp.comm.wait {name}" in res["profiled"], res["profiled"]
        assert res["pending"] == []
        mine, ref = res["inf_norm"]
        assert mine == pytest.approx(ref, rel=1e-5)
