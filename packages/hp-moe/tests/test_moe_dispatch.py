"""The dispatcher interface (``hyper_parallel.moe.dispatch``) on 2 gloo ranks: every backend's
forward and every gradient equal the serial stock module (``alltoall`` in float64; the NPU
backends in float32 through a double of their torch_npu ops that runs real gloo
communication); start/finish halves with computation between them give the blocking numbers;
a user's own dispatcher runs as an object and by a registered name; the in-flight points come
right after each exchange's start, in the same order on every rank; every capability refusal
and an unknown name raise the same error on every rank."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _moe_dispatch_double import NpuDispatchOpsDouble
from _moe_testutil import (
    TIMEOUT,
    E,
    H,
    close,
    ep_mesh,
    local_grad,
    routing,
    serial_reference,
    stock_experts,
)

from hyper_parallel.dtensor import comm, overlap
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.moe import (
    DISPATCHERS,
    AllToAllDispatcher,
    NpuDistributeDispatcher,
    NpuFusedGmmDispatcher,
    experts_info,
    experts_parallel_blocking,
    parallelize_experts,
    register_dispatcher,
)
from hyper_parallel.moe.dispatch import RowExchange

F32, HALF = torch.float32, (torch.float16, torch.bfloat16)


def _double() -> NpuDispatchOpsDouble:
    """The double with the documented ranges widened to 2 CPU ranks in float32."""
    return NpuDispatchOpsDouble(
        fused_ep_sizes=frozenset({2}), fused_dtypes=(F32, *HALF), dist_hidden_range=(1, 8192),
        dist_dtypes=(F32, *HALF),
    )  # fmt: skip


def _fused_on_two() -> NpuFusedGmmDispatcher:
    caps = replace(
        NpuFusedGmmDispatcher().capabilities, ep_sizes=(2,), dtypes=(F32, *HALF),
        device_types=("cpu",),
    )  # fmt: skip
    return NpuFusedGmmDispatcher(caps, name="npu_fused_gmm@2")


def _distribute_on_two(**more: Any) -> NpuDistributeDispatcher:
    caps = replace(
        NpuDistributeDispatcher().capabilities, ep_sizes=(2,), max_local_experts=None,
        max_hidden=None, dtypes=(F32, *HALF), device_types=("cpu",), **more,
    )  # fmt: skip
    return NpuDistributeDispatcher(caps, name="npu_distribute@2")


class Recording(AllToAllDispatcher):
    """A user's own dispatcher: the all-to-all one, logging each exchange's start (forward
    and gradient) and its expert step."""

    name = "recording"

    def __init__(self) -> None:
        super().__init__()
        self.log: list[Any] = []

    def _exchange(self, handle: Any, q: int, combine: bool) -> RowExchange:
        log, ex = self.log, super()._exchange(handle, q, combine)

        class Logged(RowExchange):
            __slots__ = ()

            def start(self, x: torch.Tensor) -> None:
                super().start(x)
                log.append(self.name)

            def start_grad(self, grad: torch.Tensor) -> None:
                super().start_grad(grad)
                log.append(f"{self.name}:grad")

        return Logged(ex.group, ex.send, ex.recv, ex.name)

    def experts(self, handle: Any, q: int, x: Any, counts: list[int], act: Any) -> Any:
        self.log.append(f"experts{q}")
        return super().experts(handle, q, x, counts, act)


def _inputs(sizes: list[int], dtype: torch.dtype, seed: int) -> tuple[list, list]:
    world = len(sizes)
    inputs = [
        tuple(t.to(dtype) if t.is_floating_point() else t for t in routing(s, sizes[s], seed=seed))
        for s in range(world)
    ]
    g = torch.Generator().manual_seed(seed + 77)
    grads = [torch.randn(n, H, generator=g, dtype=torch.float64).to(dtype) for n in sizes]
    return inputs, grads


def _run_case(dispatcher: Any, dtype: torch.dtype, grad: bool, chunks: Any, sizes: list[int],
              seed: int, double: NpuDispatchOpsDouble) -> dict:  # fmt: skip
    rank = dist.get_rank()
    inputs, grads = _inputs(sizes, dtype, seed)
    ref = serial_reference(
        stock_experts(),
        [tuple(t.double() if t.is_floating_point() else t for t in x) for x in inputs],
        [g.double() for g in grads],
    )
    with overlap_hook() as flights, npu(double):
        m = parallelize_experts(
            stock_experts(dtype=dtype), ep_mesh(), chunks=chunks, dispatcher=dispatcher
        )
        h, i, w = inputs[rank]
        h, w = h.clone().requires_grad_(grad), w.clone().requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            out = m(h, i, w)
        if grad:
            out.backward(grads[rank])
    e_l = E // dist.get_world_size()
    own = slice(rank * e_l, (rank + 1) * e_l)
    got = {"out": out.detach()}
    want = {"out": ref["out"][rank]}
    if grad:
        got.update(dh=h.grad, dw=w.grad, gate_up_proj=local_grad(m.gate_up_proj),
                   down_proj=local_grad(m.down_proj))  # fmt: skip
        want.update(dh=ref["dh"][rank], dw=ref["dw"][rank], gate_up_proj=ref["gate_up_proj"][own],
                    down_proj=ref["down_proj"][own])  # fmt: skip
    return {"got": got, "want": want, "info": experts_info(m), "ops": double.ops(),
            "flights": len(flights), "calls": double.calls}  # fmt: skip


class overlap_hook:
    def __enter__(self) -> list[int]:
        self.points: list[int] = []
        self.cm = overlap.in_flight_hook(lambda: self.points.append(1))  # hp-dtensor >= 0.3.10
        self.cm.__enter__()
        return self.points

    def __exit__(self, *exc: Any) -> None:
        self.cm.__exit__(*exc)


def npu(double: NpuDispatchOpsDouble) -> Any:
    from hyper_parallel.moe import use_npu_ops

    return use_npu_ops(double)


BACKENDS = {  # name -> (dispatcher, dtype, gradients, chunks, tokens per rank, tolerance)
    "alltoall": ("alltoall", torch.float64, True, 2, [7, 5], 1e-10),
    "npu_permute": ("npu_permute", F32, True, 2, [6, 9], 1e-4),
    "npu_fused_gmm": (_fused_on_two, F32, True, 2, [8, 5], 1e-4),
    "npu_fused_gmm-whole": (_fused_on_two, F32, True, 1, [4, 0], 1e-4),
    "npu_distribute": (_distribute_on_two, F32, False, 1, [6, 3], 1e-4),
}


def _backends() -> dict:
    out = {}
    for n, (key, (d, dtype, grad, chunks, sizes, _)) in enumerate(BACKENDS.items()):
        out[key] = _run_case(d() if callable(d) else d, dtype, grad, chunks, sizes, n, _double())
    return out


def _halves_and_users() -> dict:
    """Start/finish with computation between them vs blocking; a user's own dispatcher as an
    object and by name; the in-flight points against the exchanges' starts."""
    rank, group = dist.get_rank(), comm.resolve_group(ep_mesh(), "test")
    inputs, grads = _inputs([6, 8], torch.float64, 9)
    mod = stock_experts()
    e_l = E // group.size
    gu0 = mod.gate_up_proj.detach()[rank * e_l : (rank + 1) * e_l]
    dn0 = mod.down_proj.detach()[rank * e_l : (rank + 1) * e_l]

    def leaves() -> list[torch.Tensor]:
        h, _, w = inputs[rank]
        return [t.clone().requires_grad_(True) for t in (h, w, gu0, dn0)]

    # blocking reference
    h, w, gu, dn = leaves()
    ref, _ = experts_parallel_blocking(h, inputs[rank][1], w, gu, dn, F.silu, group, chunks=1)
    ref.backward(grads[rank])
    want = [ref.detach(), h.grad, w.grad, gu.grad, dn.grad]
    # the steps by hand, unrelated work between every start and its finish
    d = DISPATCHERS["alltoall"]
    h, w, gu, dn = leaves()
    side = torch.randn(32, 32, dtype=torch.float64, requires_grad=True)
    handle = d.exchange_plan(h, inputs[rank][1], w, gu, dn, group, compute_dtype=h.dtype,
                             impl="torch", chunks=1, what="halves")  # fmt: skip
    rows = d.dispatch_preprocess(handle, h, gu, dn)
    token = d.dispatch_start(handle, 0, rows)
    busy = (side @ side).tanh().sum()  # computation while the dispatch is in flight
    x, counts = d.dispatch_postprocess(handle, 0, d.dispatch_finish(handle, 0, token))
    y = d.combine_preprocess(handle, 0, d.experts(handle, 0, x, counts, F.silu))
    token = d.combine_start(handle, 0, y)
    busy = busy + (side @ side.t()).sigmoid().sum()
    back = {0: d.combine_finish(handle, 0, token)}
    out = d.combine_postprocess(handle, back, w, h.dtype)
    (out * grads[rank]).sum().add(0 * busy).backward()
    halves = [out.detach(), h.grad, w.grad, gu.grad, dn.grad]

    # a user's dispatcher: as an object, and registered by name; the in-flight points logged
    # among its exchanges' starts
    mine = Recording()
    user: dict[str, Any] = {}
    for how in ("object", "name"):
        mine.log.clear()
        spec: Any = mine if how == "object" else "mine"
        if how == "name":
            register_dispatcher(mine, "mine")
        m = parallelize_experts(stock_experts(), ep_mesh(), chunks=2, dispatcher=spec)
        hh, ii, ww = (t.clone() for t in inputs[rank])
        hh.requires_grad_(True)
        with overlap.in_flight_hook(lambda: mine.log.append("in_flight")):
            o = m(hh, ii, ww)
            o.backward(grads[rank])
        user[how] = {"out": o.detach(), "dh": hh.grad, "log": list(mine.log),
                     "info": experts_info(m)}  # fmt: skip
    DISPATCHERS.pop("mine", None)
    return {"want": want, "halves": halves, "user": user}


def _refusals() -> dict:
    """Each refusal, caught on this rank: (exception type, message)."""
    rank = dist.get_rank()
    out: dict[str, Any] = {}

    def attempt(key: str, fn: Any) -> None:
        try:
            fn()
            out[key] = None
        except Exception as exc:
            out[key] = (type(exc).__name__, str(exc))

    def build(dispatcher: Any, dtype: torch.dtype = F32) -> Any:
        return parallelize_experts(stock_experts(dtype=dtype), ep_mesh(), dispatcher=dispatcher)

    def forward(dispatcher: Any, sizes: list[int], grad: bool, dtype: torch.dtype = F32) -> None:
        m = build(dispatcher, dtype)
        h, i, w = (t.to(dtype) if t.is_floating_point() else t
                   for t in routing(rank, sizes[rank], seed=5))  # fmt: skip
        with torch.set_grad_enabled(grad):
            m(h.requires_grad_(grad), i, w)

    with npu(_double()):
        attempt("ep size", lambda: build("npu_fused_gmm"))
        small = replace(_fused_on_two().capabilities, max_local_experts=2)
        attempt("local experts", lambda: build(NpuFusedGmmDispatcher(small)))
        narrow = replace(_fused_on_two().capabilities, max_hidden=8)
        attempt("hidden", lambda: build(NpuFusedGmmDispatcher(narrow)))
        half = replace(_fused_on_two().capabilities, dtypes=HALF)
        attempt("dtype", lambda: forward(NpuFusedGmmDispatcher(half), [5, 5], True))
        attempt("tokens", lambda: forward(_distribute_on_two(max_tokens_per_rank=6), [4, 9],
                                          False))  # fmt: skip
        attempt("inference only", lambda: forward(_distribute_on_two(), [4, 4], True))
        attempt("unknown name", lambda: build("no_such_dispatcher"))
        attempt("device", lambda: build(NpuFusedGmmDispatcher(
            replace(_fused_on_two().capabilities, device_types=("npu",)))))  # fmt: skip
    return out


_CACHE: dict[str, Any] = {}


def _all() -> dict:
    return {"backends": _backends(), "halves": _halves_and_users(), "refusals": _refusals()}


def _ranks() -> list[dict]:
    if "ranks" not in _CACHE:
        try:
            _CACHE["ranks"] = run_distributed(_all, 2, timeout=TIMEOUT)
        except Exception as exc:  # one failed run fails every test, without running again
            _CACHE["ranks"] = exc
    if isinstance(_CACHE["ranks"], Exception):
        raise _CACHE["ranks"]
    return _CACHE["ranks"]


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_each_backend_equals_the_stock_module_forward_and_every_gradient(backend):
    tol = BACKENDS[backend][-1]
    for rank, res in enumerate(_ranks()):
        case = res["backends"][backend]
        assert case["got"].keys() == case["want"].keys()
        for key, want in case["want"].items():
            got = case["got"][key]
            assert got.shape == want.shape, (rank, key)
            close(got.double(), want.double(), tol)
        d = BACKENDS[backend][0]
        name = d if isinstance(d, str) else d().name
        assert case["info"]["dispatcher"] == name


def test_each_npu_backend_calls_its_ops_through_the_double():
    for res in _ranks():
        b = res["backends"]
        assert b["alltoall"]["ops"] == []
        assert {"npu_moe_token_permute", "npu_moe_token_unpermute"} <= set(b["npu_permute"]["ops"])
        fused = b["npu_fused_gmm"]["ops"]
        # forward: 2 chunks x (alltoallv_gmm, gmm_alltoallv); backward the same pair per chunk
        assert fused.count("npu_alltoallv_gmm") == 4 and fused.count("npu_gmm_alltoallv") == 4
        calls = [c for c in b["npu_fused_gmm"]["calls"] if c.op == "npu_alltoallv_gmm"]
        assert calls[0].kwargs["trans_gmm_weight"] and calls[0].kwargs["permute_out_flag"]
        assert len(calls[0].kwargs["send_counts"]) == E  # e * ep counts, per (rank, expert)
        assert b["npu_distribute"]["ops"] == [
            "npu_moe_distribute_dispatch_v2", "npu_moe_distribute_combine_v2",
        ]  # fmt: skip
        assert b["npu_distribute"]["info"]["dispatcher"] == "npu_distribute@2"
        assert b["npu_distribute"]["info"]["chunks"] == 1  # it takes no chunks
        assert b["npu_fused_gmm"]["info"]["capabilities"].fuses_expert_gemms


def test_start_and_finish_with_work_between_give_the_blocking_numbers():
    for res in _ranks():
        for a, b in zip(res["halves"]["halves"], res["halves"]["want"]):
            close(a, b, 1e-12)


def test_a_users_dispatcher_runs_as_an_object_and_by_name():
    for res in _ranks():
        user = res["halves"]["user"]
        close(user["object"]["out"], user["name"]["out"], 0)
        close(user["object"]["dh"], user["name"]["dh"], 0)
        assert user["name"]["info"]["dispatcher"] == "recording"
        assert "experts0" in user["object"]["log"] and "experts1" in user["object"]["log"]


def test_in_flight_points_follow_each_exchange_start_in_the_same_order_on_every_rank():
    logs = []
    for res in _ranks():
        log = res["halves"]["user"]["object"]["log"]
        starts = [i for i, e in enumerate(log) if e.startswith("moe:")]
        assert len(starts) == 8  # 2 chunks x (dispatch, combine) x (forward, gradient)
        for i in starts:  # each start is followed by its in-flight point
            assert log[i + 1] == "in_flight", log
        assert log.count("in_flight") == len(starts)
        logs.append([e for e in log if e.startswith("moe:")])
        # the forward schedule: dispatch 0, dispatch 1, combine 0, combine 1
        assert logs[-1][:4] == ["moe:dispatch0", "moe:dispatch1", "moe:combine0", "moe:combine1"]
    assert logs[0] == logs[1]
    for res in _ranks():
        b = res["backends"]
        assert b["npu_fused_gmm"]["flights"] == 8 and b["npu_distribute"]["flights"] == 2


REFUSED = {
    "ep size": ("ValueError", "ep size 2 is not one it takes (8, 16, 32, 64, 128"),
    "local experts": ("ValueError", "4 local experts a rank exceed its limit of 2"),
    "hidden": ("ValueError", f"hidden size {H} exceeds its limit of 8"),
    "dtype": ("ValueError", "rows in a dtype dispatcher 'npu_fused_gmm' does not take"),
    "tokens": (
        "ValueError",
        "ranks [1]: more tokens than dispatcher 'npu_distribute@2' takes (at most 6 a rank",
    ),
    "inference only": ("ValueError", "dispatcher 'npu_distribute@2' is inference-only"),
    "unknown name": ("ValueError", "dispatcher must be one of"),
    "device": ("ValueError", "it runs on npu tensors, not cpu"),
}


@pytest.mark.parametrize("what", list(REFUSED))
def test_every_refusal_raises_the_same_error_on_every_rank(what):
    kind, phrase = REFUSED[what]
    errors = [res["refusals"][what] for res in _ranks()]
    assert all(e is not None for e in errors), errors
    assert errors[0] == errors[1]  # the same error on both ranks (one rank's tokens only)
    assert errors[0][0] == kind and phrase in errors[0][1], errors[0]
