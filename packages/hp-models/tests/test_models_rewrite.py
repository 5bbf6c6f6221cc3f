"""The model-level forward is installed with hp-dtensor's rewrite, like every layer's: the model
keeps its class name (Hugging Face writes it as the saved ``architectures``, FSDP2's prefix
aside) and its ``state_dict`` keys, gets no instance ``forward``, and carries one
``ParallelPlan`` (``parallel_state(model, "hp-models")``). A deep copy is parallelised too and
computes with its own parameters; two models of one class share the rewritten class but not
their plans; a stock model is not parallelised and ``sync_gradients`` refuses it."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from hyper_parallel.dtensor import init_device_mesh, unflatten
from hyper_parallel.dtensor.rewrite import parallel_state
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.models import (
    ParallelPlan,
    is_model_parallelized,
    parallelize_model,
    shard_batch,
    sync_gradients,
)
from hyper_parallel.models.fsdp import fsdp_available
from hyper_parallel.models.testing import random_batch, tiny_model


def _error(fn: Any) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as exc:  # the test compares type and message
        return type(exc).__name__, str(exc)
    return None


def _run(tmp: str) -> dict[str, Any]:
    world = init_device_mesh("cpu", (2,), mesh_dim_names=("world",))
    mesh = unflatten(world, "world", (1, 2), ("cp", "tp"))
    local = shard_batch(random_batch(seq=16), mesh)
    res: dict[str, Any] = {}
    stock = tiny_model("kimi")
    res["stock"] = (is_model_parallelized(stock), _error(lambda: sync_gradients(stock)))
    stock_class, stock_keys = type(stock), list(stock.state_dict())
    model = parallelize_model(stock, mesh, grad_reduction="allreduce")
    plan = parallel_state(model, "hp-models")
    res["model"] = {
        "parallelized": is_model_parallelized(model),
        "plan": isinstance(plan, ParallelPlan) and plan.grad_reduction == "allreduce",
        "name": type(model).__name__,
        "subclass": type(model) is not stock_class and type(model).__mro__[1] is stock_class,
        "instance_forward": "forward" in model.__dict__,
        # generate and save_pretrained are methods of the rewritten class, not instance
        # attributes closing over this model (a copy's would act on the original)
        "instance_methods": sorted({"generate", "save_pretrained"} & set(model.__dict__)),
        "keys": list(model.state_dict()) == stock_keys,
        "twice": _error(lambda: parallelize_model(model, mesh)),
    }
    other = parallelize_model(tiny_model("kimi"), mesh, grad_reduction="allreduce")
    res["shared_class"] = type(other) is type(model)
    res["own_plan"] = parallel_state(other, "hp-models") is not plan
    with torch.no_grad():
        before = model(**local).loss.item()
        twin = copy.deepcopy(model)
        res["copy"] = {
            "parallelized": is_model_parallelized(twin),
            "shares_plan": parallel_state(twin, "hp-models") is plan,
            "same_loss": twin(**local).loss.item() == before,
        }
        twin.lm_head.weight.mul_(0.5)  # the copy's own weights, not the original's
        res["copy"]["own_weights"] = twin(**local).loss.item() != before
        res["copy"]["original_unchanged"] = model(**local).loss.item() == before
    res["copy_generate"] = _error(lambda: twin.generate(local["input_ids"]))
    import os

    import torch.distributed as dist

    folder = os.path.join(tmp, "twin")  # the same path on every rank; every rank writes
    twin.save_pretrained(folder)
    dist.barrier()
    import json

    from safetensors.torch import load_file

    with open(os.path.join(folder, "model.safetensors.index.json")) as fh:
        where = json.load(fh)["weight_map"]["lm_head.weight"]
    saved = load_file(os.path.join(folder, where))
    res["copy_saved_own_weights"] = torch.equal(saved["lm_head.weight"], twin.lm_head.weight)
    if fsdp_available():
        sharded = parallelize_model(tiny_model("kimi"), mesh, grad_reduction="fsdp")
        # FSDP2 subclasses the rewritten class again; HF strips its "FSDP" prefix on save
        res["fsdp"] = (
            is_model_parallelized(sharded),
            type(sharded).__name__.removeprefix("FSDP"),
            parallel_state(sharded, "hp-models").grad_reduction,
        )
    return res


@pytest.mark.timeout(120)
def test_the_model_forward_is_installed_by_the_rewrite(tmp_path):
    for res in run_distributed(_run, 2, str(tmp_path), timeout=90):
        assert res["stock"] == (
            False,
            ("RuntimeError", "sync_gradients needs a model parallelised by parallelize_model"),
        )
        assert res["model"] == {
            "parallelized": True,
            "plan": True,
            "name": "KimiLinearForCausalLM",
            "subclass": True,
            "instance_forward": False,
            "instance_methods": [],
            "keys": True,
            "twice": ("RuntimeError", "parallelize_model was already applied to this model"),
        }
        assert res["shared_class"] and res["own_plan"]
        assert res["copy"] == dict.fromkeys(
            ("parallelized", "shares_plan", "same_loss", "own_weights", "original_unchanged"),
            True,
        )
        assert res["copy_generate"][0] == "NotImplementedError", res["copy_generate"]
        assert res["copy_saved_own_weights"]  # the copy wrote its own (halved) lm_head
        if fsdp_available():
            assert res["fsdp"] == (True, "KimiLinearForCausalLM", "fsdp")
