"""``torch.compile`` composes with a parallelised model: a stock Kimi-Linear (a KDA and an MLA
layer, dense MLPs) parallelised at (cp, tp) = (2, 2) on 4 ranks, with each decoder layer
compiled as a user would (``layer.compile(backend="aot_eager")``: dynamo and AOT autograd, no
C++ compiler), gives the loss and every gradient of the uncompiled parallel model and of the
serial model (float64; the default gradient reduction: FSDP2 wherever it can be made to
sum, every torch from 2.7.1, else the all-reduce), and later steps reuse the graphs. Dynamo's
tracing of the stock layers is what costs (about two minutes on a loaded 2-core host; the
serial model alone takes ~30 s), so one spawn checks both and the model is as small as the
layers allow.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _models_testutil import grads

from hyper_parallel.dtensor import init_device_mesh, unflatten
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.models import parallelize_model, shard_batch, sync_gradients
from hyper_parallel.models.testing import random_batch, tiny_model

TOL = {"rtol": 2e-5, "atol": 2e-6}  # Kimi-Linear's KDA computes in float32
LAYERS = {
    "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"],
    "mlp_layer_types": ["dense", "dense"],
}


def _run() -> dict[str, Any]:
    import torch._dynamo

    world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    mesh = unflatten(world, "world", (2, 2), ("cp", "tp"))
    local = shard_batch(random_batch(seq=16), mesh)
    res: dict[str, Any] = {}
    for compiled in (False, True):
        # the default gradient reduction, as a user gets it: FSDP2 where this torch has it
        model = parallelize_model(tiny_model("kimi", **LAYERS), mesh)
        if compiled:
            torch._dynamo.reset()
            for layer in model.model.layers:
                layer.compile(backend="aot_eager")
        loss = model(**local).loss
        loss.backward()
        sync_gradients(model)
        res[f"compiled={compiled}"] = {"loss": loss.item(), "grads": grads(model)}
    # later steps reuse the graphs: after a second step no new batch recompiles (a guard
    # failing on every step would recompile, at the first step's cost, each time)
    graphs = []
    for seed in (2, 3, 4):
        model(**shard_batch(random_batch(seq=16, seed=seed), mesh)).loss.backward()
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    res["graphs"] = graphs
    return res


@pytest.mark.timeout(400)
def test_compiled_layers_give_the_uncompiled_and_serial_loss_and_gradients():
    results = run_distributed(_run, 4, timeout=380)
    serial = tiny_model("kimi", **LAYERS)
    ref_loss = serial(**random_batch(seq=16)).loss
    ref_loss.backward()
    ref_loss, ref_grads = ref_loss.item(), grads(serial)
    assert len(ref_grads) > 15
    for rank, res in enumerate(results):
        graphs = res["graphs"]
        assert graphs[0] >= 2, (rank, graphs)  # dynamo really compiled the layers
        assert graphs[1] == graphs[2], (rank, graphs)  # no recompilation per step
        eager, compiled = res["compiled=False"], res["compiled=True"]
        for r in (eager, compiled):
            assert r["loss"] == pytest.approx(ref_loss, rel=2e-6), rank
            assert set(r["grads"]) == set(ref_grads), rank
            for name, g in ref_grads.items():
                torch.testing.assert_close(r["grads"][name], g, **TOL, msg=f"{rank} {name}")
        # the compiled graphs run the same ops as the eager layers
        assert compiled["loss"] == pytest.approx(eager["loss"], rel=1e-12, abs=1e-12), rank
