"""Checkpoints of a model with split experts (``ep > 1``):

- ``save_pretrained`` gathers every expert into a plain Hugging Face folder that
  ``from_pretrained`` loads with the weights of the parallel model (and its next loss);
- a DCP checkpoint (``get_state_dict``) saved at ep = 4 under FSDP2 resumes at ep = 2 under the
  all-reduce with the next steps' losses of the uninterrupted run (model and AdamW state), and
  loads into the serial model (one process, no mesh) with the same weights;
- activation checkpointing (Hugging Face's ``gradient_checkpointing_enable``) and
  ``torch.autocast`` work with split experts: the same loss and gradients as without / as the
  serial model under the same autocast."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _models_testutil import cp_tp_mesh, full, train_step
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.models import parallelize_model, shard_batch, sync_gradients
from hyper_parallel.models.fsdp import fsdp_available
from hyper_parallel.models.testing import import_transformers, random_batch, tiny_model

TOL = {"rtol": 2e-5, "atol": 2e-6}
LOAD = {"dtype": torch.float64, "experts_implementation": "eager"}
MOE = {"n_routed_experts": 8}
FIRST = "fsdp" if fsdp_available() else "allreduce"


def _save_side(tmp):
    mesh = cp_tp_mesh(2, 2)
    model = parallelize_model(
        tiny_model("deepseek", seed=0, **MOE), mesh, grad_reduction=FIRST, ep=4
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, opt, mesh, seed=1)
    weights = {n: full(p) for n, p in model.named_parameters()}
    folder = os.path.join(tmp, "hf")
    model.save_pretrained(folder)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(tmp, "dcp"))
    losses = [train_step(model, opt, mesh, seed=s) for s in (2, 3)]
    report = {"losses": losses}
    if dist.get_rank() == 0:
        plain = import_transformers().AutoModelForCausalLM.from_pretrained(folder, **LOAD)
        report["same_weights"] = all(
            torch.equal(p.detach(), weights[n]) for n, p in plain.named_parameters()
        ) and len(dict(plain.named_parameters())) == len(weights)
        report["experts"] = plain.model.layers[2].mlp.experts.gate_up_proj.shape[0]
        report["plain_loss"] = plain(**random_batch(seq=16, seed=2)).loss.item()
        report["weights"] = weights
    dist.barrier()
    return report


def _load_side(tmp):
    mesh = cp_tp_mesh(2, 2)
    model = parallelize_model(
        tiny_model("deepseek", seed=7, **MOE), mesh, grad_reduction="allreduce", ep=2
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=os.path.join(tmp, "dcp"))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return [train_step(model, opt, mesh, seed=s) for s in (2, 3)]


@pytest.mark.timeout(500)
def test_split_experts_save_pretrained_and_dcp_reshard_between_ep_sizes(tmp_path):
    tmp = str(tmp_path)
    saved = run_distributed(_save_side, 4, tmp, timeout=400)
    ref = saved[0]["losses"]
    assert all(rep["losses"] == ref for rep in saved)
    assert saved[0]["same_weights"] and saved[0]["experts"] == 8
    torch.testing.assert_close(saved[0]["plain_loss"], ref[0], **TOL)
    for losses in run_distributed(_load_side, 4, tmp, timeout=400):
        torch.testing.assert_close(losses, ref, **TOL)
    # into the serial model: one process, no mesh
    serial = tiny_model("deepseek", seed=5, **MOE)
    sd = {k: v for k, v in serial.state_dict().items()}
    dcp.load({"model": sd}, checkpoint_id=os.path.join(tmp, "dcp"), no_dist=True)
    serial.load_state_dict(sd)
    for n, p in serial.named_parameters():
        torch.testing.assert_close(p.detach(), saved[0]["weights"][n], rtol=0, atol=0)


def _checkpointing_and_autocast():
    mesh = cp_tp_mesh(2, 2)
    batch = random_batch(seq=16, seed=1)
    out = {}
    for ckpt in (False, True):
        model = tiny_model("deepseek", seed=0, dtype=torch.float32, **MOE)
        if ckpt:
            model.gradient_checkpointing_enable()
            model.train()
        parallelize_model(model, mesh, grad_reduction="allreduce", ep=4)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**shard_batch(batch, mesh)).loss
        loss.backward()
        sync_gradients(model)
        out[ckpt] = (loss.detach(), {n: full(p.grad) for n, p in model.named_parameters()
                                     if p.grad is not None})  # fmt: skip
    serial = tiny_model("deepseek", seed=0, dtype=torch.float32, **MOE)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = serial(**batch).loss
    return out, ref.detach()


def test_activation_checkpointing_and_autocast_with_split_experts():
    for out, ref in run_distributed(_checkpointing_and_autocast, 4, timeout=400):
        (l0, g0), (l1, g1) = out[False], out[True]
        torch.testing.assert_close(l0, l1, rtol=1e-6, atol=1e-6)  # recomputation changes nothing
        assert g0.keys() == g1.keys()
        for n in g0:
            torch.testing.assert_close(g0[n], g1[n], rtol=1e-5, atol=1e-6, msg=lambda m, n=n: n)
        torch.testing.assert_close(l0, ref, rtol=2e-2, atol=2e-2)  # bf16 vs the serial bf16
