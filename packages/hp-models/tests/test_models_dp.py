"""Data parallelism: a (dp, cp, tp) mesh over 4 ranks trains like the serial model on the
GLOBAL batch (float64): the loss on every rank, every gradient after ``sync_gradients``,
``clip_grad_norm_``, two optimizer steps; with FSDP2 and with the all-reduce; each dp rank gets
only its rows and computes only its share. Under FSDP2 every dense MLP weight (a tp shard) is
sharded over the dp·cp ranks holding it: each element on exactly one rank, the mesh
``(dp_cp, tp)``; that placement is saved by ``save_pretrained`` (and read back by stock
``from_pretrained`` and by hp-models' at the same mesh) and by DCP (resumed into the
all-reduce's placement)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _models_testutil import (
    assert_grads_like_serial,
    assert_params_like_serial,
    full64,
    step_all,
)
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.utils.flop_counter import FlopCounterMode

from hyper_parallel.dtensor import init_device_mesh, unflatten
from hyper_parallel.dtensor.rewrite import parallel_state
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.models import (
    clip_grad_norm_,
    from_pretrained,
    parallelize_model,
    shard_batch,
    sync_gradients,
)
from hyper_parallel.models.testing import import_transformers, random_batch, tiny_model

TOL = {"rtol": 2e-5, "atol": 2e-6}  # Kimi-Linear's KDA computes in float32
BSZ, SEQ = 4, 16
LOAD = {"dtype": torch.float64, "experts_implementation": "eager"}  # grouped_mm: no float64


def _raised(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # the test compares the type
        return exc
    return None


def _flops(module, inputs):
    with FlopCounterMode(display=False) as counter:
        module(**inputs)
    return counter.get_total_flops()


def _mlp_shards(model):
    """Each dense MLP parameter's ``(local numel, whole shape, mesh dim names)`` on this
    rank."""
    plan = parallel_state(model, "hp-models")
    out = {}
    for path, role in plan.roles.items():
        if role.name == "dense_mlp":
            for name, p in model.model.get_submodule(path).named_parameters():
                names = tuple(p.device_mesh.mesh_dim_names)
                out[f"{path}.{name}"] = (p.to_local().numel(), tuple(p.shape), names)
    return out


def _weights_equal(model, weights):
    """The names of ``model``'s parameters whose whole tensor differs from ``weights``."""
    return [n for n, p in model.named_parameters() if not torch.equal(full64(p), weights[n])]


def _reload(kind, mesh, folder, tmp, model, opt, weights):
    """``from_pretrained`` of ``folder`` at ``mesh`` under FSDP2, and the DCP checkpoint of
    ``model``/``opt`` resumed into the all-reduce's placement: the parameters that differ from
    ``weights`` (none expected)."""
    again = from_pretrained(folder, mesh, grad_reduction="fsdp", **LOAD)
    loaded = _weights_equal(again, weights)
    checkpoint = os.path.join(tmp, f"dcp-{kind}")
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=checkpoint)
    other = parallelize_model(tiny_model(kind, seed=7), mesh, grad_reduction="allreduce")
    other_opt = torch.optim.SGD(other.parameters(), lr=0.5, momentum=0.9)
    msd, osd = get_state_dict(other, other_opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=checkpoint)
    set_state_dict(
        other, other_opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    return {"from_pretrained": loaded, "dcp": _weights_equal(other, weights)}


def _train(dp, cp, tp, cases, tmp):
    world = init_device_mesh("cpu", (dp * cp * tp,), mesh_dim_names=("world",))
    mesh = unflatten(world, "world", (dp, cp, tp), ("dp", "cp", "tp"))
    d, c, t = mesh.get_coordinate()
    report = {}
    for kind, reduction in cases:
        serial = tiny_model(kind, seed=0)
        model = parallelize_model(tiny_model(kind, seed=0), mesh, grad_reduction=reduction)
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        ref_opt = torch.optim.SGD(serial.parameters(), lr=0.5, momentum=0.9)
        losses = []
        for step in range(2):
            batch = random_batch(bsz=BSZ, seq=SEQ, seed=step + 1)
            local = shard_batch(batch, mesh)
            # this rank's rows and sequence block only
            s, rows = SEQ // (cp * tp), BSZ // dp
            block = c * tp + t
            want = batch["input_ids"][d * rows : (d + 1) * rows, block * s : (block + 1) * s]
            assert torch.equal(local["input_ids"], want)
            ref = serial(**batch)
            ref.loss.backward()
            out = model(**local)
            out.loss.backward()
            sync_gradients(model)
            torch.testing.assert_close(out.loss.detach(), ref.loss.detach(), **TOL)
            losses.append(out.loss.item())
            if step == 0:
                n_grads = assert_grads_like_serial(model, serial, label=f"{kind} ", **TOL)
                assert n_grads > 20
                # HSDP / dp-replicated gradients are counted once; no clipping (coef 1)
                ref_norm = torch.nn.utils.clip_grad_norm_(serial.parameters(), 1e9)
                norm = clip_grad_norm_(model, 1e9)
                torch.testing.assert_close(norm, ref_norm, rtol=2e-6, atol=0)
            step_all(opt, ref_opt)
        assert_params_like_serial(model, serial)
        probe = random_batch(bsz=BSZ, seq=SEQ, seed=9)
        local = shard_batch(probe, mesh)
        with torch.no_grad():
            flops = _flops(model, local)
            serial_flops = _flops(serial, probe)
        if reduction == "auto":  # FSDP2: save_pretrained under dp, every rank writes its share
            report["mlp_shards"] = _mlp_shards(model)
            rank = dist.get_rank()
            folder = os.path.join(tmp, "hf")
            weights = {n: full64(p) for n, p in model.named_parameters()}
            model.save_pretrained(folder)
            report["reloaded"] = _reload(kind, mesh, folder, tmp, model, opt, weights)
            report["written"] = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
            if rank == 0:
                plain = import_transformers().AutoModelForCausalLM.from_pretrained(
                    folder, dtype=torch.float64, experts_implementation="eager"
                )
                for n, p in plain.named_parameters():
                    assert torch.equal(p.detach(), weights[n]), n
            # one rank's write fails (its file's path is taken by a folder): every rank raises,
            # no rank waits forever; a bad option raises before any communication
            bad = os.path.join(tmp, "hf-bad")
            if rank == 1:
                os.makedirs(os.path.join(bad, "model-00002-of-00004.safetensors"))
            dist.barrier()
            exc = _raised(model.save_pretrained, bad)
            report["failed_save"] = None if exc is None else f"{type(exc).__name__}: {exc}"
            exc = _raised(model.save_pretrained, folder, max_shard_size="x")
            report["bad_size"] = None if exc is None else type(exc).__name__
        report[kind] = {
            "losses": losses,
            "reduction": parallel_state(model, "hp-models").grad_reduction,
            "flops_share": flops * dp * cp * tp / serial_flops,
        }
    return report


@pytest.mark.timeout(500)
@pytest.mark.parametrize(
    "dp, cp, tp, cases",
    [
        (2, 2, 1, [("kimi", "auto"), ("deepseek", "allreduce")]),
        (2, 1, 2, [("kimi", "allreduce"), ("deepseek", "auto")]),
    ],
    ids=["dp2-cp2-tp1", "dp2-cp1-tp2"],
)
def test_data_parallel_trains_like_serial_on_the_global_batch(dp, cp, tp, cases, tmp_path):
    results = run_distributed(_train, dp * cp * tp, dp, cp, tp, cases, str(tmp_path), timeout=450)
    for rep in results:  # every rank writes its share; when one fails, every rank raises
        assert {"config.json", "model.safetensors.index.json"} <= set(rep["written"]), rep
        assert sum(f.endswith(".safetensors") for f in rep["written"]) == 4, rep["written"]
        assert rep["failed_save"].startswith("RuntimeError"), rep["failed_save"]
        assert "Is a directory" in rep["failed_save"], rep["failed_save"]
        assert rep["bad_size"] == "ValueError", rep["bad_size"]
        for kind, _ in cases:
            assert rep[kind]["losses"] == results[0][kind]["losses"]
            # each rank runs at most 1/(dp·cp·tp) of the serial forward (Kimi's serial torch KDA
            # works on 64-token chunks, so its share is smaller still)
            assert rep[kind]["flops_share"] <= 1.02, rep[kind]
        # the FSDP2 model saved by save_pretrained and DCP reads back equal, at this mesh
        assert rep["reloaded"] == {"from_pretrained": [], "dcp": []}, rep["reloaded"]
    # FSDP2 holds each dense MLP weight (a tp shard) once over all dp·cp·tp ranks: the ranks'
    # local tensors add up to the whole, each within one row of the even share
    ranks = dp * cp * tp
    shards = [rep["mlp_shards"] for rep in results]
    assert shards[0], "no dense MLP parameter"
    for name, (_, shape, names) in shards[0].items():
        assert names == ("dp_cp", "tp"), (name, names)
        held = [s[name][0] for s in shards]
        numel = torch.Size(shape).numel()
        assert sum(held) == numel, (name, held, shape)
        assert max(held) - numel / ranks <= numel / shape[0], (name, held, shape)
