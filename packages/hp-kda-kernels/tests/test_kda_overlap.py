"""The state exchange overlaps the block's state-independent output terms: forward, the
exchange is launched before the chunks' own attention (``output_terms``) and waited after it;
backward, the gradient exchange is launched before that attention's backward and completed
after it. Outputs, final state and every gradient are bitwise those of the earlier schedule
(every local term before the exchange), on 4 gloo ranks, for every protocol, with packed
documents, wide gate ranges (sub-chunked factors) and an empty block."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _kda_testutil import kda_inputs

from hyper_parallel.dtensor import init_device_mesh
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.kda import exchange as exchange_mod
from hyper_parallel.kda import kda_context_parallel
from hyper_parallel.kda import layer as layer_mod

B, T, H, K, V = 1, 24, 2, 8, 8
PROTOCOLS = [("p2p", None), ("allgather", None), ("grouped", 2), ("auto", None)]
CUTS = {"even": [0, 6, 12, 18, 24], "empty middle": [0, 7, 7, 15, 24]}
OFFSETS = [0, 5, 6, 14, 24]


class _Mark(torch.autograd.Function):
    """Identity; logs when autograd runs its backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, log: list[str]) -> torch.Tensor:
        ctx.log = log
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        ctx.log.append("output terms bwd")
        return grad, None


def _run(mesh: Any, protocol: str, width: Any, cuts: list[int], wide: bool, docs: bool) -> Any:
    r = dist.get_rank()
    *qkvgb, h0 = kda_inputs(B, T, H, K, V, seed=11)
    if wide:  # in-chunk gate ranges above 60: the sub-chunked factors
        qkvgb[3] = qkvgb[3] * 100.0
    xs = [x[:, cuts[r] : cuts[r + 1]].float().requires_grad_() for x in qkvgb]
    h0 = h0.float().requires_grad_()
    o, hT = kda_context_parallel(
        *xs, mesh, protocol=protocol, group_size=width, initial_state=h0,
        output_final_state=True, chunk_size=4 if not wide else 32,
        cu_seqlens=torch.tensor(OFFSETS) if docs else None,
    )  # fmt: skip
    loss = (o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum()
    if hT is not None:
        loss = loss + hT.square().sum()
    loss.backward()
    none = torch.zeros(0)
    grads = [x.grad if x.grad is not None else none for x in [*xs, h0]]  # h0's: first rank
    return [o.detach(), none if hT is None else hT.detach(), *grads]


def _logged(log: list[str]) -> dict[tuple[Any, str], Any]:
    """Patch the schedule's landmarks to append to ``log``; returns what to restore."""
    saved = {
        (layer_mod, "output_terms"): layer_mod.output_terms,
        (exchange_mod.StateExchange, "start_forward"): exchange_mod.StateExchange.start_forward,
        (exchange_mod.StateExchange, "start_backward"): exchange_mod.StateExchange.start_backward,
        (exchange_mod.PendingExchange, "wait"): exchange_mod.PendingExchange.wait,
    }
    output_terms = saved[(layer_mod, "output_terms")]

    def logged_output_terms(terms: Any, q: torch.Tensor, scale: float) -> Any:
        log.append("output terms")
        return output_terms(terms, _Mark.apply(q, log), scale)

    def wrap(owner: Any, name: str) -> Any:
        original = saved[(owner, name)]

        def wrapped(*a: Any, **kw: Any) -> Any:
            log.append(name)
            return original(*a, **kw)

        return wrapped

    layer_mod.output_terms = logged_output_terms
    for owner, name in list(saved)[1:]:
        setattr(owner, name, wrap(owner, name))
    return saved


def _rank() -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    out: dict[str, Any] = {}
    cases = [(p, w, "even", False, False) for p, w in PROTOCOLS]
    cases += [(p, w, "empty middle", False, True) for p, w in PROTOCOLS[:3]]
    cases += [(p, w, "even", True, True) for p, w in PROTOCOLS[:3]]
    try:
        for protocol, width, cut, wide, docs in cases:
            key = f"{protocol}:{width} {cut} wide={wide} docs={docs}"
            for overlap in (False, True):
                layer_mod._OVERLAP = overlap
                log: list[str] = []
                saved = _logged(log)
                try:
                    res = _run(mesh, protocol, width, CUTS[cut], wide, docs)
                finally:
                    for (owner, name), original in saved.items():
                        setattr(owner, name, original)
                out[f"{key} overlap={overlap}"] = (res, log)
    finally:
        layer_mod._OVERLAP = True
    ex = exchange_mod.build_state_exchange(mesh, "p2p")
    pending = ex.start_forward(torch.zeros(1, 1, 2, 2), torch.eye(2).expand(1, 1, 2, 2))
    pending.wait()
    try:
        pending.wait()
        out["second wait"] = "no error"
    except RuntimeError as exc:
        out["second wait"] = str(exc)
    return out


OVERLAPPED = [
    "start_forward", "output terms", "wait", "start_backward", "output terms bwd", "wait"
]  # fmt: skip
SERIAL = ["output terms", "start_forward", "wait", "start_backward", "wait", "output terms bwd"]


@pytest.mark.timeout(180)
def test_exchange_overlaps_the_output_terms_and_results_are_bitwise_unchanged():
    results = run_distributed(_rank, 4, timeout=160)
    for r, res in enumerate(results):
        assert "already called" in res.pop("second wait"), r
        keys = sorted({k.rsplit(" overlap=", 1)[0] for k in res})
        assert len(keys) == 10
        for key in keys:
            (serial, log_s), (overlapped, log_o) = (
                res[f"{key} overlap=False"],
                res[f"{key} overlap=True"],
            )
            assert len(serial) == len(overlapped) == 8
            for i, (a, b) in enumerate(zip(serial, overlapped)):
                assert a.dtype == b.dtype and torch.equal(a, b), (r, key, i)
            if "empty middle" in key and r == 1:  # an empty block runs no output terms
                assert log_o == log_s == ["start_forward", "wait", "start_backward", "wait"]
            else:
                assert all(t.abs().max() > 0 for t in overlapped[2:7]), (r, key)
                assert log_o == OVERLAPPED, (r, key, log_o)
                assert log_s == SERIAL, (r, key, log_s)
