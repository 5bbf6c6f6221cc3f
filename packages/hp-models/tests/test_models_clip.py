"""``clip_grad_norm_`` on a parallelised model equals ``torch.nn.utils.clip_grad_norm_`` on the
serial model (float64): the total norm before clipping (2-norm and inf-norm) and every gradient
after clipping, with gradients reduced by FSDP2 and by the all-reduce, on two mesh shapes."""

from __future__ import annotations

import pytest
import torch
from _models_testutil import full
from torch.distributed.tensor import DTensor

from hyper_parallel.dtensor import init_device_mesh, unflatten
from hyper_parallel.dtensor.rewrite import parallel_state
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.models import clip_grad_norm_, parallelize_model, shard_batch, sync_gradients
from hyper_parallel.models.testing import random_batch, tiny_model


def _clip_cases(cp, tp, cases):
    world = init_device_mesh("cpu", (cp * tp,), mesh_dim_names=("world",))
    mesh = unflatten(world, "world", (cp, tp), ("cp", "tp"))
    batch = random_batch(seq=16)
    report = []
    for kind, reduction in cases:
        serial = tiny_model(kind, seed=0)
        model = parallelize_model(tiny_model(kind, seed=0), mesh, grad_reduction=reduction)
        serial(**batch).loss.backward()
        model(**shard_batch(batch, mesh)).loss.backward()
        sync_gradients(model)
        named = [(n, q) for n, q in model.named_parameters() if q.grad is not None]
        saved = [
            (q.grad.to_local() if isinstance(q.grad, DTensor) else q.grad).clone() for _, q in named
        ]
        ref_saved = {n: q.grad.clone() for n, q in serial.named_parameters() if q.grad is not None}
        ref_params = dict(serial.named_parameters())
        for norm_type in (2.0, float("inf"), 1.0):
            for (_, q), s in zip(named, saved):
                (q.grad.to_local() if isinstance(q.grad, DTensor) else q.grad).copy_(s)
            for n, g in ref_saved.items():
                ref_params[n].grad.copy_(g)
            ref_norm = torch.nn.utils.clip_grad_norm_(serial.parameters(), 1.0, norm_type)
            max_norm = 0.5 * ref_norm.item()  # clipping is active
            for n, g in ref_saved.items():
                ref_params[n].grad.copy_(g)
            ref_norm = torch.nn.utils.clip_grad_norm_(serial.parameters(), max_norm, norm_type)
            # the same norm of this model's own gradients, gathered whole: each counted once
            own = [torch.linalg.vector_norm(full(q.grad), norm_type) for _, q in named]
            own_norm = torch.linalg.vector_norm(torch.stack(own), norm_type)
            norm = clip_grad_norm_(model, max_norm, norm_type)
            assert type(norm) is torch.Tensor and norm.dim() == 0, type(norm)
            torch.testing.assert_close(norm, own_norm, rtol=1e-12, atol=0)
            torch.testing.assert_close(norm, ref_norm, rtol=2e-6, atol=0)  # float32 KDA
            for n, q in named:
                torch.testing.assert_close(
                    full(q.grad),
                    ref_params[n].grad,
                    rtol=2e-5,
                    atol=2e-7,
                    msg=lambda m, n=n, c=(kind, reduction, norm_type): f"{c} grad of {n}: {m}",
                )
            reduced = parallel_state(model, "hp-models").grad_reduction
            report.append((kind, reduced, norm_type, norm.item()))
    return report


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "cp, tp, cases",
    [
        (2, 2, [("kimi", "auto"), ("deepseek", "allreduce")]),
        (1, 2, [("kimi", "allreduce"), ("deepseek", "auto")]),
    ],
    ids=["cp2-tp2", "cp1-tp2"],
)
def test_clip_grad_norm_matches_serial_torch_clip(cp, tp, cases):
    results = run_distributed(_clip_cases, cp * tp, cp, tp, cases, timeout=360)
    assert len(results[0]) == 3 * len(cases)
    for r in results:  # the same total on every rank
        assert r == results[0]
