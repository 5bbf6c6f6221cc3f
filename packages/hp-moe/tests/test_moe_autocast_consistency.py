"""Autocast and consistency mode.

- Under ``torch.autocast("cpu", bfloat16)`` the experts compute in the dtype autocast gives the
  stock module (bf16 GEMMs, the weighted sum in the hidden dtype): outputs and gradients match
  the stock module run serially under the same autocast, and the rows travel in bf16.
- With consistency mode on, ranks that disagree on an option, the ep mesh or the hidden size
  raise :class:`InconsistentRanksError` on every rank before the first collective; ranks that
  agree run as without it (one comparison per call)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from _moe_testutil import TIMEOUT, H, ep_mesh, local_grad, routing, serial_reference, stock_experts

from hyper_parallel.dtensor import InconsistentRanksError, consistency_checks
from hyper_parallel.dtensor.recorder import record_events
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.moe import parallelize_experts


def rank_autocast() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = [7, 5]
    inputs = [tuple(t.float() if t.is_floating_point() else t for t in routing(s, n))
              for s, n in enumerate(sizes)]  # fmt: skip
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(n, H, generator=g) for n in sizes]
    mod = stock_experts(dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = serial_reference(mod, inputs, grads)
    m = parallelize_experts(stock_experts(dtype=torch.float32), ep_mesh())
    h, i, w = inputs[rank]
    h, w = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    with record_events() as rec, torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(h, i, w)
    out.backward(grads[rank])
    e_l = 8 // world
    own = slice(rank * e_l, (rank + 1) * e_l)
    return {
        "dtype": out.dtype,
        "pairs": [
            (out, ref["out"][rank]),
            (h.grad, ref["dh"][rank]),
            (w.grad, ref["dw"][rank]),
            (local_grad(m.gate_up_proj), ref["gate_up_proj"][own]),
            (local_grad(m.down_proj), ref["down_proj"][own]),
        ],
        "grad_dtypes": (h.grad.dtype, local_grad(m.gate_up_proj).dtype),
        "bytes": sum(e.nbytes for e in rec.events if e.kind == "launch" and "dispatch" in e.name),
        "rows_out": int(((i < rank * e_l) | (i >= (rank + 1) * e_l)).sum()),
    }


def test_autocast_computes_like_the_stock_module_under_the_same_autocast():
    for res in run_distributed(rank_autocast, 2, timeout=TIMEOUT):
        assert res["dtype"] == torch.float32  # the stock module's output is in the hidden dtype
        assert res["grad_dtypes"] == (torch.float32, torch.float32)
        for got, want in res["pairs"]:
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
        assert res["bytes"] == res["rows_out"] * H * 2  # the rows travel in bf16


def _raised(fn) -> str:
    try:
        fn()
    except InconsistentRanksError as exc:
        return f"{exc.field}"
    return "ran"


def rank_consistency() -> dict:
    rank = dist.get_rank()
    mesh = ep_mesh()
    h, i, w = routing(rank, 4 + rank)
    out: dict = {}
    with consistency_checks():
        out["impl"] = _raised(
            lambda: parallelize_experts(
                stock_experts(), mesh, impl="grouped_mm" if rank else "torch"
            )
        )
        out["chunks"] = _raised(
            lambda: parallelize_experts(stock_experts(), mesh, chunks=2 if rank else "auto")
        )
        m = parallelize_experts(stock_experts(), mesh)
        out["hidden"] = _raised(lambda: m(h[:, :8] if rank else h, i, w))
        with record_events() as rec:
            out["agree"] = _raised(lambda: m(h, i, w))  # different N per rank is fine
        out["collectives"] = sorted({e.name for e in rec.events if e.kind == "launch"})
    return out


def test_consistency_mode_names_the_field_the_ranks_disagree_on():
    for res in run_distributed(rank_consistency, 2, timeout=TIMEOUT):
        assert res["impl"] == "impl" and res["chunks"] == "chunks"
        assert res["hidden"] == "hidden"
        assert res["agree"] == "ran"
        assert "moe:counts" in res["collectives"]
