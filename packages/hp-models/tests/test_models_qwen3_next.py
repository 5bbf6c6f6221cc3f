"""The third family, Qwen3-Next, through ``parallelize_model`` (float64, against the stock serial
``Qwen3NextForCausalLM``): Gated DeltaNet layers (hp-kda-kernels) and gated GQA attention with 2
key/value heads over 4 ranks (hp-context-parallel), the dense MLP (hp-mc2) and the MoE blocks
with their gated shared expert (hp-moe's experts split over ep). At (cp, tp) = (2, 2) with ep 4
and at (dp, cp, tp) = (2, 2, 1) with ep 2, with FSDP2 and with the all-reduce: the loss, every
gradient, the clipped norm and two optimizer steps equal the serial model's; every mixer sees
only this rank's tokens. Packed documents give the serial model run on each document alone."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _models_testutil import (
    assert_grads_like_serial,
    assert_params_like_serial,
    grads,
    shifted_loss,
    step_all,
)

from hyper_parallel.dtensor import init_device_mesh, unflatten
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.models import (
    IGNORE_INDEX,
    clip_grad_norm_,
    parallelize_model,
    shard_batch,
    sync_gradients,
)
from hyper_parallel.models.fsdp import fsdp_available
from hyper_parallel.models.testing import random_batch, tiny_model
from hyper_parallel.moe import experts_info, is_experts_parallel

KIND = "qwen3-next"
TOL = {"rtol": 2e-5, "atol": 2e-6}  # the stock GDN path and the router compute in float32
BSZ, SEQ, E = 2, 16, 8
TIMEOUT = 300.0
REDUCTIONS = ["allreduce", "fsdp"] if fsdp_available() else ["allreduce"]
MIXERS = ("linear_attn.in_proj_qkvz", "self_attn.q_proj")


def _model() -> Any:
    return tiny_model(KIND, seed=0, num_experts=E)


def _record(seen: dict[str, tuple[int, ...]], name: str) -> Any:
    def hook(module: Any, args: Any, output: Any) -> None:
        seen.setdefault(name, tuple(args[0].shape))

    return hook


def _watch(model: Any) -> tuple[dict[str, tuple[int, ...]], list[Any]]:
    seen: dict[str, tuple[int, ...]] = {}
    hooks = [
        mod.register_forward_hook(_record(seen, name))
        for name, mod in model.named_modules()
        if name.endswith(MIXERS)
    ]
    return seen, hooks


def _train(shape: tuple[int, ...], ep: int) -> list[dict[str, Any]]:
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    names = ("cp", "tp") if len(shape) == 2 else ("dp", "cp", "tp")
    mesh = unflatten(world, "world", shape, names)
    report = []
    for reduction in REDUCTIONS:
        serial = _model()
        model = parallelize_model(_model(), mesh, grad_reduction=reduction, ep=ep)
        experts = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
        seen, hooks = _watch(model)
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
                assert_grads_like_serial(model, serial, label=f"{reduction} ", **TOL)
                ref_norm = torch.nn.utils.clip_grad_norm_(serial.parameters(), 1e9)
                torch.testing.assert_close(clip_grad_norm_(model, 1e9), ref_norm, rtol=2e-6, atol=0)
            step_all(opt, ref_opt)
        assert_params_like_serial(model, serial)
        for h in hooks:
            h.remove()
        report.append({
            "reduction": reduction,
            "held": {len(experts_info(m)["local_experts"]) for m in experts},
            "split": bool(experts) and all(is_experts_parallel(m) for m in experts),
            "seen": seen,
        })  # fmt: skip
    return report


def _check(results: list[list[dict[str, Any]]], ep: int, block: tuple[int, int, int]) -> None:
    for rank_report in results:
        assert [e["reduction"] for e in rank_report] == REDUCTIONS
        for entry in rank_report:
            assert entry["split"] and entry["held"] == {E // ep}
            # each Gated DeltaNet and attention layer projects only this rank's rows and tokens
            assert len(entry["seen"]) == 4
            assert set(entry["seen"].values()) == {block}, entry["seen"]


@pytest.mark.timeout(TIMEOUT + 30)
def test_qwen3_next_trains_like_serial_at_cp2_tp2_ep4() -> None:
    results = run_distributed(_train, 4, (2, 2), 4, timeout=TIMEOUT)
    _check(results, 4, (BSZ, SEQ // 4, 32))


@pytest.mark.timeout(TIMEOUT + 30)
def test_qwen3_next_trains_like_serial_at_dp2_cp2_tp1_ep2() -> None:
    results = run_distributed(_train, 4, (2, 2, 1), 2, timeout=TIMEOUT)
    _check(results, 2, (BSZ // 2, SEQ // 2, 32))


# --- packed documents -------------------------------------------------------------------------

OFFSETS = [0, 3, 4, 8, 9, 16]  # length 1, shorter than the conv window, at a boundary, spanning


def _packed(with_table: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 48, (1, SEQ), generator=g)
    labels = ids.clone()
    pos = torch.cat([torch.arange(b - a) for a, b in zip(OFFSETS, OFFSETS[1:])])[None]
    labels[0, OFFSETS[:-1]] = IGNORE_INDEX
    batch = {"input_ids": ids, "labels": labels, "position_ids": pos}
    if with_table:
        batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = torch.tensor(OFFSETS, dtype=torch.int32)
    return batch


def _documents() -> dict[str, Any]:
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    mesh = unflatten(world, "world", (2, 2), ("cp", "tp"))
    res = {}
    for with_table in (False, True):
        model = parallelize_model(_model(), mesh, grad_reduction="allreduce", ep=4)
        out = model(**shard_batch(_packed(with_table), mesh))
        out.loss.backward()
        sync_gradients(model)
        res[with_table] = {
            "loss": out.loss.item(),
            "logits": out.logits.detach(),
            "grads": grads(model),
        }
    return res


@pytest.mark.timeout(TIMEOUT + 30)
def test_qwen3_next_packed_documents_equal_each_document_alone() -> None:
    results = run_distributed(_documents, 4, timeout=TIMEOUT)
    serial = _model()
    batch = _packed(False)
    ids, labels = batch["input_ids"], batch["labels"]
    logits = torch.cat(
        [serial(input_ids=ids[:, a:b]).logits for a, b in zip(OFFSETS, OFFSETS[1:])], dim=1
    )
    loss = shifted_loss(logits, labels)
    loss.backward()
    ref_grads = grads(serial)
    whole = _model()(input_ids=ids, labels=labels).loss.item()
    assert abs(whole - loss.item()) > 1e-4  # the documents matter
    for rank, res in enumerate(results):
        for with_table, got in res.items():
            assert got["loss"] == pytest.approx(loss.item(), rel=2e-6), (rank, with_table)
            block = logits.detach()[:, rank * SEQ // 4 : (rank + 1) * SEQ // 4]
            torch.testing.assert_close(got["logits"], block, **TOL)
            assert set(got["grads"]) == set(ref_grads)
            for name, g in ref_grads.items():
                torch.testing.assert_close(got["grads"][name], g, **TOL, msg=name)
