"""Expert parallelism in hp-models (``parallelize_model(..., ep=...)``): stock DeepSeek-V3 and
Kimi-Linear with MoE layers train like the serial model (float64): the loss, every gradient
after ``sync_gradients``, ``clip_grad_norm_`` equal to the serial norm, two optimizer steps;
at (cp, tp) = (2, 2) with ep 2 and 4 and at (dp, cp, tp) = (2, 2, 1), with FSDP2 and with the
all-reduce; each rank holds E/ep experts; ``balance_experts`` moves every router's bias as the
serial model's routing of the whole batch says; bad ``ep`` values raise on every rank."""

from __future__ import annotations

import pytest
import torch
from _models_testutil import (
    assert_grads_like_serial,
    assert_params_like_serial,
    cp_tp_mesh,
    full64,
    routers,
    serial_loads,
    step_all,
)

from hyper_parallel.dtensor import init_device_mesh, unflatten
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.models import (
    balance_experts,
    clip_grad_norm_,
    parallelize_model,
    shard_batch,
    sync_gradients,
)
from hyper_parallel.models.fsdp import fsdp_available
from hyper_parallel.models.testing import random_batch, tiny_model
from hyper_parallel.moe import experts_info, is_experts_parallel

TOL = {"rtol": 2e-5, "atol": 2e-6}  # Kimi-Linear's KDA and both routers compute in float32
BSZ, SEQ, E = 2, 16, 8
TIMEOUT = 300.0
# every MoE layer with 8 routed experts (2 per token); Kimi-Linear: two MoE layers
OVERRIDES = {
    "deepseek": {"n_routed_experts": E},
    "kimi": {"num_experts": E, "mlp_layer_types": ["dense", "sparse", "dense", "sparse"]},
}
RATE = 1e-3


def _model(kind):
    return tiny_model(kind, seed=0, **OVERRIDES[kind])


def _train(shape, cases):
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    names = ("cp", "tp") if len(shape) == 2 else ("dp", "cp", "tp")
    mesh = unflatten(world, "world", shape, names)
    report = []
    for kind, ep, reduction in cases:
        serial = _model(kind)
        model = parallelize_model(_model(kind), mesh, grad_reduction=reduction, ep=ep)
        experts = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
        held = {len(experts_info(m)["local_experts"]) if ep > 1 else E for m in experts}
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        ref_opt = torch.optim.SGD(serial.parameters(), lr=0.5, momentum=0.9)
        for step in range(2):
            batch = random_batch(bsz=BSZ, seq=SEQ, seed=step + 1)
            ref = serial(**batch)
            ref.loss.backward()
            out = model(**shard_batch(batch, mesh))
            out.loss.backward()
            sync_gradients(model)
            torch.testing.assert_close(out.loss.detach(), ref.loss.detach(), **TOL)
            if step == 0:
                assert_grads_like_serial(model, serial, label=f"{kind} ", **TOL)
                ref_norm = torch.nn.utils.clip_grad_norm_(serial.parameters(), 1e9)
                torch.testing.assert_close(clip_grad_norm_(model, 1e9), ref_norm, rtol=2e-6, atol=0)
                # the routers' bias moves by the serial routing of the whole batch
                before = {n: r.e_score_correction_bias.clone() for n, r in routers(model).items()}
                balance_experts(model, RATE)
                for n, load in serial_loads(serial, batch).items():
                    want = before[n] + RATE * torch.sign(load.mean() - load).float()
                    got = routers(model)[n].e_score_correction_bias
                    torch.testing.assert_close(got, want, rtol=0, atol=1e-9)
                    routers(serial)[n].e_score_correction_bias.copy_(got)
            step_all(opt, ref_opt)
        assert_params_like_serial(model, serial)
        report.append({
            "case": (kind, ep, reduction),
            "held": held,
            "split": all(is_experts_parallel(m) for m in experts) == (ep > 1),
        })  # fmt: skip
    return report


REDUCTIONS = ["allreduce", "fsdp"] if fsdp_available() else ["allreduce"]


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_moe_models_with_split_experts_train_like_serial_at_cp2_tp2(reduction):
    cases = [("deepseek", 2, reduction), ("kimi", 4, reduction)]
    for rank_report in run_distributed(_train, 4, (2, 2), cases, timeout=TIMEOUT):
        for entry in rank_report:
            _, ep, _ = entry["case"]
            assert entry["split"] and entry["held"] == {E // ep}


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_moe_models_with_split_experts_train_like_serial_at_dp2_cp2(reduction):
    cases = [("kimi", 2, reduction), ("deepseek", 4, reduction)]
    for rank_report in run_distributed(_train, 4, (2, 2, 1), cases, timeout=TIMEOUT):
        for entry in rank_report:
            assert entry["split"] and entry["held"] == {E // entry["case"][1]}


def _bad_ep():
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    mesh = unflatten(world, "world", (2, 2), ("cp", "tp"))
    out = {}
    for ep in (3, 0, "2", 16):
        try:
            parallelize_model(_model("deepseek"), mesh, ep=ep)
            out[repr(ep)] = "ok"
        except (TypeError, ValueError) as exc:
            out[repr(ep)] = f"{type(exc).__name__}: {exc}"
    return out


def test_bad_ep_raises_on_every_rank():
    results = run_distributed(_bad_ep, 4, timeout=TIMEOUT)
    assert all(r == results[0] for r in results)
    r = results[0]
    assert r["3"].startswith("ValueError") and "divisor" in r["3"]
    assert r["0"].startswith("ValueError")
    assert r["'2'"].startswith("TypeError")
    assert r["16"].startswith("ValueError")


def _policy_and_user_loss():
    """FSDP2's MixedPrecisionPolicy (float32 master weights, bf16 compute; against the float32
    serial model to bf16 precision) and a user loss through ``global_mean_loss`` (float64,
    every gradient), with the experts split over every rank."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from hyper_parallel.models import global_mean_loss

    mesh = cp_tp_mesh(2, 2)
    batch = random_batch(bsz=BSZ, seq=SEQ, seed=3)
    out = {}
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = parallelize_model(
        tiny_model("deepseek", dtype=torch.float32, **OVERRIDES["deepseek"]), mesh,
        grad_reduction="fsdp", mp_policy=policy, ep=4,
    )  # fmt: skip
    loss = model(**shard_batch(batch, mesh)).loss
    loss.backward()
    out["bf16_loss"] = loss.detach().float()
    out["bf16_grads_finite"] = all(
        torch.isfinite(full64(p.grad)).all().item()
        for p in model.parameters()
        if p.grad is not None
    )
    # a user's own loss from the logits, its mean over the whole batch
    serial = _model("deepseek")
    model = parallelize_model(_model("deepseek"), mesh, grad_reduction="allreduce", ep=4)
    local = shard_batch(batch, mesh)
    logits = model(**local).logits
    targets = local["shift_labels"]
    ce_sum = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).double(), targets.flatten(), ignore_index=-100, reduction="sum"
    )
    mean = global_mean_loss(ce_sum, (targets != -100).sum(), mesh)
    mean.backward()
    sync_gradients(model)
    ref = serial(**batch)
    ref.loss.backward()
    out["mean"], out["ref"] = mean.detach(), ref.loss.detach()
    out["grads"] = all(
        torch.allclose(full64(model.get_parameter(n).grad), q.grad, **TOL)
        for n, q in serial.named_parameters()
        if q.grad is not None
    )
    with torch.no_grad():
        out["bf16_ref"] = _model("deepseek").float()(**batch).loss.float()
    return out


def test_mixed_precision_policy_and_global_mean_loss_with_split_experts():
    for res in run_distributed(_policy_and_user_loss, 4, timeout=TIMEOUT):
        torch.testing.assert_close(res["bf16_loss"], res["bf16_ref"], rtol=3e-2, atol=3e-2)
        assert res["bf16_grads_finite"]
        torch.testing.assert_close(res["mean"].double(), res["ref"].double(), **TOL)
        assert res["grads"]
