"""``parallelize_model(..., local_kernel="stock")``: every delta-rule layer (Kimi-Linear's KDA,
Qwen3-Next's Gated DeltaNet) runs, on each rank, the chunk function the stock layer itself
calls (here transformers' PyTorch reference, where fla would be on a device), and the model's
loss and every gradient equal the serial model's (float64 weights; the kernel computes in
float32), over cp = 2, and each rank's kernel calls see only its own block of the sequence.
An unknown ``local_kernel`` is refused on every rank before any communication."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from _models_testutil import grads

from hyper_parallel.dtensor import init_device_mesh, unflatten
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.models import parallelize_model, shard_batch, sync_gradients
from hyper_parallel.models.testing import random_batch, tiny_model

# (kind, the modeling module's chunk function the delta-rule layers call)
KINDS = [
    ("kimi", "transformers.models.kimi_linear.modeling_kimi_linear", "chunk_kimi_delta_attention"),
    ("qwen3-next", "transformers.models.qwen3_next.modeling_qwen3_next",
     "torch_chunk_gated_delta_rule"),
]  # fmt: skip


def _run() -> dict[str, Any]:
    world = init_device_mesh("cpu", (2,), mesh_dim_names=("world",))
    mesh = unflatten(world, "world", (2, 1), ("cp", "tp"))
    batch = random_batch(seq=16)
    res: dict[str, Any] = {}
    for kind, module_name, name in KINDS:
        model = tiny_model(kind)  # imports the modeling module on its PyTorch path
        home = sys.modules[module_name]
        original = getattr(home, name)
        calls: list[int] = []

        def counted(*args: Any, _fn: Any = original, _calls: Any = calls, **kwargs: Any) -> Any:
            # (tokens, value width: V, or V + K for a summary)
            _calls.append((args[2].shape[1], args[2].shape[-1]))
            return _fn(*args, **kwargs)

        setattr(home, name, counted)
        try:
            parallelize_model(model, mesh, grad_reduction="allreduce", local_kernel="stock")
        finally:
            setattr(home, name, original)
        out = model(**shard_batch(batch, mesh))
        out.loss.backward()
        sync_gradients(model)
        res[kind] = {"loss": out.loss.item(), "grads": grads(model), "calls": calls}
    try:
        parallelize_model(tiny_model("kimi"), mesh, local_kernel="fla")
        res["error"] = "accepted"
    except ValueError as exc:
        res["error"] = str(exc)
    return res


def _serial(kind: str) -> tuple[float, dict[str, torch.Tensor]]:
    model = tiny_model(kind)
    loss = model(**random_batch(seq=16)).loss
    loss.backward()
    return loss.item(), grads(model)


@pytest.mark.timeout(240)
def test_stock_local_kernel_model_equals_serial_loss_and_every_gradient() -> None:
    results = run_distributed(_run, 2, timeout=200)
    for kind, _, _ in KINDS:
        ref_loss, ref_grads = _serial(kind)
        for r in results:
            got = r[kind]
            widths = {w for _, w in got["calls"]}
            # two calls a layer a rank: the widened summary (V + K) and the outputs (V), each
            # over this rank's 8 of the 16 tokens, not the whole sequence
            assert len(widths) == 2 and len(got["calls"]) % 2 == 0, (kind, got["calls"])
            assert {t for t, _ in got["calls"]} == {8}, (kind, got["calls"])
            assert got["loss"] == pytest.approx(ref_loss, rel=2e-6), kind
            assert set(got["grads"]) == set(ref_grads), kind
            for name, g in ref_grads.items():
                torch.testing.assert_close(
                    got["grads"][name], g, rtol=2e-5, atol=2e-6, msg=f"{kind} {name}"
                )
    for r in results:
        assert "local_kernel must be one of ('auto', 'stock', 'torch')" in r["error"]
