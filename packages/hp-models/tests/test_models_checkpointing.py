"""Activation checkpointing composes with a parallelised model: Hugging Face's
``gradient_checkpointing_enable()`` and torch's ``checkpoint_wrapper`` (reentrant and
non-reentrant), applied before or after ``parallelize_model``, give the serial loss and every
serial gradient (float64, both families, cp=2 on 2 ranks, FSDP2 gradient reduction where this
torch has it). The recompute re-runs each layer's collectives in the same order on every rank.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
from _models_testutil import grads
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)

from hyper_parallel.dtensor import init_device_mesh, unflatten
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.models import parallelize_model, shard_batch, sync_gradients
from hyper_parallel.models.testing import random_batch, tiny_model

KINDS = ["kimi", "deepseek"]
# (how, when): HF's switch, or torch's wrapper around every decoder layer
VARIANTS = [
    ("hf", "before"),
    ("hf-nonreentrant", "after"),
    ("wrapper-reentrant", "before"),
    ("wrapper-nonreentrant", "after"),
]
WRAPPED = "._checkpoint_wrapped_module"


def _checkpoint(model: torch.nn.Module, how: str) -> None:
    if how == "hf":  # Hugging Face's defaults
        model.gradient_checkpointing_enable()
        return
    if how == "hf-nonreentrant":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return
    impl = CheckpointImpl.REENTRANT if how == "wrapper-reentrant" else CheckpointImpl.NO_REENTRANT
    layer_type = type(model.model.layers[0])
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=partial(checkpoint_wrapper, checkpoint_impl=impl),
        check_fn=lambda m: isinstance(m, layer_type),
    )


def _run() -> dict[Any, Any]:
    world = init_device_mesh("cpu", (2,), mesh_dim_names=("world",))
    mesh = unflatten(world, "world", (2, 1), ("cp", "tp"))
    batch = random_batch(seq=16)
    res: dict[Any, Any] = {}
    for kind in KINDS:
        for how, when in VARIANTS:
            model = tiny_model(kind)
            model.train()
            if when == "before":
                _checkpoint(model, how)
            parallelize_model(model, mesh)
            if when == "after":
                _checkpoint(model, how)
            calls = []  # forwards of the first mixer: 2 when its activations were recomputed
            mixer = model.model.layers[0].get_submodule("self_attn")
            hook = mixer.register_forward_hook(lambda *_, c=calls: c.append(1))
            out = model(**shard_batch(batch, mesh))
            out.loss.backward()
            hook.remove()
            sync_gradients(model)
            wrapped = any(WRAPPED in n for n, _ in model.named_parameters())
            res[(kind, how, when)] = {
                "loss": out.loss.item(),
                "grads": grads(model, WRAPPED),
                "wrapped": wrapped,
                "forwards": len(calls),
            }
    return res


def _serial(kind: str) -> tuple[float, dict[str, torch.Tensor]]:
    model = tiny_model(kind)
    model.train()
    loss = model(**random_batch(seq=16)).loss
    loss.backward()
    return loss.item(), grads(model, WRAPPED)


@pytest.mark.timeout(300)
def test_activation_checkpointing_before_or_after_parallelize_gives_serial_gradients():
    results = run_distributed(_run, 2, timeout=260)
    for kind in KINDS:
        ref_loss, ref_grads = _serial(kind)
        for how, when in VARIANTS:
            key = (kind, how, when)
            for rank, res in enumerate(results):
                r = res[key]
                # the checkpointing really is in place (torch's wrapper renames the layers)
                assert r["wrapped"] == how.startswith("wrapper"), (rank, key)
                assert r["forwards"] == 2, (rank, key, r["forwards"])  # forward + recompute
                assert r["loss"] == pytest.approx(ref_loss, rel=2e-6), (rank, key)
                assert set(r["grads"]) == set(ref_grads), (rank, key)
                for name, g in ref_grads.items():
                    torch.testing.assert_close(
                        r["grads"][name], g, rtol=2e-5, atol=2e-6, msg=f"{rank} {key} {name}"
                    )
