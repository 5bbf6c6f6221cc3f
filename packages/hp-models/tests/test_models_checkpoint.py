"""Checkpoints of a parallelised model, against the same training run uninterrupted:

- ``model.save_pretrained(folder)`` on every rank writes, every rank its share, one folder that
  ``from_pretrained`` loads into the plain model with equal weights (both families, FSDP2 and
  all-reduce);
- the README recipe: ``torch.distributed.checkpoint`` with ``get_state_dict``/``set_state_dict``
  saved at (cp, tp) = (2, 2) under FSDP2 and resumed at (1, 2) under the all-reduce gives the
  next steps' losses of the uninterrupted run (model and AdamW state); the same checkpoint
  converted offline (``dcp_to_torch_save``) to a plain Hugging Face folder; ``from_pretrained``
  then ``parallelize_model``;
- gradient accumulation over two micro-batches equals the serial gradient of their sum.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _models_testutil import assert_grads_like_serial, cp_tp_mesh, full, train_step
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.models import parallelize_model, shard_batch, sync_gradients
from hyper_parallel.models.testing import import_transformers, random_batch, tiny_model

TOL = {"rtol": 2e-5, "atol": 2e-6}  # Kimi-Linear's KDA computes in float32
LOAD = {"dtype": torch.float64, "experts_implementation": "eager"}  # grouped_mm: no float64


def _plain_loss(folder, seed):
    tf = import_transformers()
    plain = tf.AutoModelForCausalLM.from_pretrained(folder, **LOAD)
    return plain, plain(**random_batch(seq=16, seed=seed)).loss.item()


def _save_side(tmp):
    """(cp, tp) = (2, 2): accumulation, save_pretrained, DCP save, the uninterrupted steps."""
    mesh = cp_tp_mesh(2, 2)
    rank = dist.get_rank()
    report = {}
    for kind, reduction in (("kimi", "auto"), ("deepseek", "allreduce")):
        serial = tiny_model(kind, seed=0)
        model = parallelize_model(tiny_model(kind, seed=0), mesh, grad_reduction=reduction)
        # gradient accumulation: two half-weighted micro-batches, one sync
        a, b = random_batch(seq=16, seed=1), random_batch(seq=16, seed=2)
        (0.5 * serial(**a).loss + 0.5 * serial(**b).loss).backward()
        for micro in (a, b):
            (0.5 * model(**shard_batch(micro, mesh)).loss).backward()
        sync_gradients(model)
        assert_grads_like_serial(model, serial, full, **TOL)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        opt.step()
        opt.zero_grad()
        train_step(model, opt, mesh, seed=3)
        weights = {n: full(p) for n, p in model.named_parameters()}
        folder = os.path.join(tmp, f"{kind}-hf")  # one folder, on storage every rank sees
        model.save_pretrained(folder, max_shard_size="40KB")
        report[f"{kind}_written"] = sorted(os.listdir(folder))
        if kind == "kimi":
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(tmp, "dcp"))
            report["losses"] = [train_step(model, opt, mesh, seed=s) for s in (4, 5)]
        if rank == 0:
            plain, loss = _plain_loss(folder, seed=4)
            for n, p in plain.named_parameters():
                assert torch.equal(p.detach(), weights[n]), n
            assert len(dict(plain.named_parameters())) == len(weights)
            report[f"{kind}_plain_loss"] = loss
        dist.barrier()
    return report


def _load_side(tmp, saved):
    """(cp, tp) = (1, 2), all-reduce: resume from the DCP checkpoint; from_pretrained."""
    mesh = cp_tp_mesh(1, 2)
    model = parallelize_model(tiny_model("kimi", seed=7), mesh, grad_reduction="allreduce")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=os.path.join(tmp, "dcp"))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    losses = [train_step(model, opt, mesh, seed=s) for s in (4, 5)]
    # a plain folder from save_pretrained, loaded then parallelised
    tf = import_transformers()
    plain = tf.AutoModelForCausalLM.from_pretrained(os.path.join(tmp, "kimi-hf"), **LOAD)
    again = parallelize_model(plain, mesh)
    loss = again(**shard_batch(random_batch(seq=16, seed=4), mesh)).loss.item()
    return {"losses": losses, "from_pretrained_loss": loss, "saved": saved}


@pytest.mark.timeout(500)
def test_save_pretrained_dcp_resume_on_another_mesh_and_accumulation(tmp_path):
    tmp = str(tmp_path)
    saved = run_distributed(_save_side, 4, tmp, timeout=400)
    ref = saved[0]["losses"]
    for rep in saved:
        assert rep["losses"] == ref
        for kind in ("kimi", "deepseek"):  # every rank wrote its own files into one folder
            written = rep[f"{kind}_written"]
            assert {"config.json", "model.safetensors.index.json"} <= set(written), rep
            assert sum(f.endswith(".safetensors") for f in written) >= 4, rep
    # the plain model from the folder computes the next step's loss of the parallel run
    torch.testing.assert_close(saved[0]["kimi_plain_loss"], ref[0], **TOL)
    loaded = run_distributed(_load_side, 2, tmp, None, timeout=300)
    for rep in loaded:
        torch.testing.assert_close(rep["losses"], ref, **TOL)
        torch.testing.assert_close(rep["from_pretrained_loss"], ref[0], **TOL)
    # offline: the DCP checkpoint converted to a plain Hugging Face folder (one process)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(os.path.join(tmp, "dcp"), os.path.join(tmp, "full.pt"))
    full = torch.load(os.path.join(tmp, "full.pt"), weights_only=False)
    plain = tiny_model("kimi", seed=11)
    plain.load_state_dict(full["model"])
    plain.save_pretrained(os.path.join(tmp, "converted"))
    _, loss = _plain_loss(os.path.join(tmp, "converted"), seed=4)
    torch.testing.assert_close(loss, ref[0], **TOL)
