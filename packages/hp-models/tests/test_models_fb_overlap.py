"""Forward/backward overlap across micro-batches (``pipeline_model(...,
overlap="forward_backward")``) on 4 gloo ranks, float64, against the serial stock model on the
global batch: the loss on every rank and every gradient (``_case`` of the pipeline tests: two
steps, ``clip_grad_norm_``, ``balance_experts``), for the three families with experts split
(ep 2 and 4), FSDP2 and all-reduce gradients, Hugging Face's activation checkpointing, packed
documents over cp·tp; every pair of micro-batches really interleaved (the two sides handed over
at their exchanges). The trace (2 ranks): each micro-batch's running stretches recorded as
segments, one micro-batch's forward starting while the other's combine is in flight. The runner
itself without processes: the order of the two sides, the caller's autocast and context, an
error of one side. Bad options raise before any communication."""

from __future__ import annotations

import contextvars
from typing import Any

import pytest
import torch
from test_models_pipeline import _case, _mesh
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from hyper_parallel.dtensor import comm, init_device_mesh, overlap, unflatten
from hyper_parallel.dtensor.recorder import record_events
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.models import pipeline_model
from hyper_parallel.models.pipeline.interleave import (
    hold_backward_end,
    run_interleaved,
    segment_spans,
)
from hyper_parallel.models.pipeline.model import fb_overlap_schedules
from hyper_parallel.models.pipeline.schedules import same_rank_hand_off
from hyper_parallel.models.testing import random_batch, tiny_model
from hyper_parallel.moe import AllToAllDispatcher, experts_info


class Counting(AllToAllDispatcher):
    """A user's own dispatcher: today's all-to-all, counting the dispatches it starts."""

    name = "counting"
    started = 0

    def dispatch_start(self, handle: Any, q: int, rows: torch.Tensor) -> torch.Tensor:
        Counting.started += 1
        return super().dispatch_start(handle, q, rows)


FB = "forward_backward"
DP_CASES = [
    ("deepseek", {"microbatches": 2, "ep": 2, "overlap": FB, "dispatcher": Counting()}, 4, False),
    (
        "qwen3-next",
        {"microbatches": 3, "ep": 4, "overlap": FB, "grad_reduction": "allreduce", "moe_chunks": 2},
        6,
        False,
    ),
    ("kimi", {"microbatches": 2, "ep": 2, "overlap": FB, "checkpointing": True}, 4, False),
]
CP_TP_CASES = [("kimi", {"microbatches": 2, "ep": 2, "overlap": FB}, 2, True)]
# pp > 1: inside DualPipeV's overlapped forward-backward actions, where this torch has them
DUALPIPE = {"microbatches": 4, "schedule": "DualPipeV", "stages_per_rank": 2, "ep": 2}
PP_CASES = [("kimi", {**DUALPIPE, "overlap": FB}, 8, False)]


def _errors(mesh: Any) -> dict[str, str]:
    out = {}
    for name, kw in {
        "one_microbatch": {"microbatches": 1, "overlap": FB, "schedule": "GPipe"},
        "bad_value": {"microbatches": 2, "overlap": "both"},
        "unknown_dispatcher": {"microbatches": 2, "ep": 2, "dispatcher": "nope"},
        "dispatcher_at_ep1": {"microbatches": 2, "dispatcher": Counting()},
        "bad_moe_chunks": {"microbatches": 2, "ep": 2, "overlap": FB, "moe_chunks": 0},
    }.items():
        try:
            pipeline_model(tiny_model("kimi"), mesh, **kw)
            out[name] = "NO ERROR"
        except Exception as exc:  # the test compares type and message
            out[name] = f"{type(exc).__name__}: {exc}"
    try:
        pipeline_model(
            tiny_model("kimi"), _mesh((2, 2, 1), ("pp", "cp", "tp")), microbatches=2, overlap=FB
        )
        out["pp"] = "NO ERROR"
    except Exception as exc:
        out["pp"] = f"{type(exc).__name__}: {exc}"
    return out


def _moe_options(pm: Any) -> list[tuple[Any, bool]]:
    """(chunks, overlap) of every split experts module of ``pm`` (chunks: the last forward's)."""
    return [
        (info["chunks"], info["overlap"])
        for part in pm.parts
        for name, mod in part.named_modules()
        if name.endswith("mlp.experts") and (info := experts_info(mod))
    ]


def _run(dims: tuple[int, ...], names: tuple[str, ...], cases: list) -> dict:
    mesh = _mesh(dims, names)
    res: dict[str, Any] = {}
    if names == ("cp", "tp"):
        res["errors"] = _errors(mesh)
        # overlap=False reaches the MoE blocks: each exchange waited at once, in one chunk
        blocking = pipeline_model(tiny_model("deepseek"), mesh, microbatches=2, ep=2, overlap=False)
        res["blocking_moe"] = _moe_options(blocking)
    for i, (kind, options, bsz, packed) in enumerate(cases):
        out = _case(mesh, kind, options, bsz, packed)  # asserts loss and every gradient
        res[f"{kind}-{i}"] = {
            "losses": out["losses"],
            "switches": out["pm"].switches,
            "moe": _moe_options(out["pm"]),
        }
    res["user_dispatches"] = Counting.started
    return res


def _check(results: list[dict], cases: list) -> None:
    for i, (kind, options, _, _) in enumerate(cases):
        key = f"{kind}-{i}"
        for rep in results:
            assert rep[key]["losses"] == results[0][key]["losses"], key
            # one pair a micro-batch after the first, each handing over at its exchanges,
            # the same number of times on every rank
            sw = rep[key]["switches"]
            assert len(sw) == options["microbatches"] - 1 and min(sw) >= 4, (key, sw)
            assert sw == results[0][key]["switches"], key
            # the MoE blocks keep their in-layer overlap, in the chunks asked for
            chunks = options.get("moe_chunks")
            moe = rep[key]["moe"]
            assert moe and all(o and (chunks is None or c == chunks) for c, o in moe), (key, moe)


@pytest.mark.timeout(600)
def test_forward_backward_overlap_trains_like_the_serial_model() -> None:
    results = run_distributed(_run, 4, (2, 2, 1), ("dp", "cp", "tp"), DP_CASES, timeout=420)
    _check(results, DP_CASES)
    # the user's dispatcher ran the MoE layer of the tiny DeepSeek-V3: 2 micro-batches x 2 steps
    assert all(r["user_dispatches"] >= 4 for r in results), results
    if fb_overlap_schedules() is None and same_rank_hand_off():
        results = run_distributed(_run, 4, (2, 2, 1), ("pp", "cp", "tp"), PP_CASES, timeout=300)
        for rep in results:  # DualPipeV pairs 3 forward/backward actions a rank at m = 4
            assert rep["kimi-0"]["losses"] == results[0]["kimi-0"]["losses"]
            sw = rep["kimi-0"]["switches"]
            assert len(sw) == 3 and min(sw) >= 1, sw
    results = run_distributed(_run, 4, (2, 2), ("cp", "tp"), CP_TP_CASES, timeout=240)
    _check(results, CP_TP_CASES)
    for rep in results:
        err = rep["errors"]
        assert err["one_microbatch"].startswith(
            "ValueError: overlap='forward_backward' pairs one micro-batch's forward"
        ), err
        assert err["bad_value"].startswith(
            "ValueError: overlap must be True, False or 'forward_backward', got 'both'"
        ), err
        assert err["unknown_dispatcher"].startswith("ValueError: "), err
        assert "nope" in err["unknown_dispatcher"], err
        assert err["bad_moe_chunks"].startswith(
            "ValueError: moe_chunks must be 'auto' or an int >= 1, got 0"
        ), err
        assert rep["blocking_moe"] and all(c == 1 and not o for c, o in rep["blocking_moe"]), rep[
            "blocking_moe"
        ]
        assert err["dispatcher_at_ep1"].startswith(
            "ValueError: dispatcher='Counting:counting' moves rows between the ranks"
        ), err
        assert (
            err["pp"].startswith(
                "ValueError: overlap='forward_backward' interleaves a forward with a backward that "
                "does not wait for it"
            )
            and "schedule '1F1B'" in err["pp"]
        ), err


def _traced_step() -> dict[str, Any]:
    world = init_device_mesh("cpu", (2,), mesh_dim_names=("world",))
    mesh = unflatten(world, "world", (2, 1), ("cp", "tp"))
    pm = pipeline_model(tiny_model("deepseek", seed=0), mesh, microbatches=2, ep=2, overlap=FB)
    with record_events() as rec:
        pm.step(**random_batch(bsz=2, seq=16))
    segments = segment_spans(rec.events)
    # every combine (forward, or its gradient in backward): the segment it was launched in,
    # and the other side's segments that began between its launch and its wait
    launched = {e.op_id: e for e in rec.events if e.kind == "launch"}
    under = []
    for e in rec.events:
        if e.kind != "wait" or not e.name.startswith("moe:combine"):
            continue
        t0, t1 = launched[e.op_id].t_ns, e.t_ns
        own = [n for n, _, b, end in segments if b <= t0 <= end]
        began = sorted({n for n, _, b, _ in segments if t0 < b < t1 and n not in own})
        under.append((e.name, e.phase, own, began))
    return {"names": [n for n, *_ in segments], "under": under, "switches": pm.switches}


@pytest.mark.timeout(300)
def test_the_trace_shows_one_micro_batch_forward_under_the_other_combine() -> None:
    for rep in run_distributed(_traced_step, 2, timeout=240):
        names = rep["names"]
        assert names[0] == "forward mb0" and names[-1] == "backward mb1", names
        assert {"forward mb1", "backward mb0"} <= set(names), names
        assert names.count("forward mb1") >= 3, names  # a side's stretches, hand-over to hand-over
        # micro-batch 0's combine gradient in flight while micro-batch 1's forward runs
        assert (
            "moe:combine0:grad", "backward", ["backward mb0"], ["forward mb1"]
        ) in [(n, p, o, b) for n, p, o, b in rep["under"]], rep["under"]  # fmt: skip


class _Note:
    """An exchange without communication that logs its steps (the order needs no group)."""

    def __init__(self, log: list[str], tag: str) -> None:
        self.log, self.tag = log, tag

    def start(self, x: torch.Tensor) -> None:
        self.log.append(f"{self.tag} start")
        self.x = x

    def finish(self) -> torch.Tensor:
        self.log.append(f"{self.tag} finish")
        return self.x * 1

    def start_grad(self, grad: torch.Tensor) -> None:
        self.log.append(f"{self.tag} start_grad")
        self.g = grad

    def finish_grad(self) -> torch.Tensor:
        self.log.append(f"{self.tag} finish_grad")
        return self.g * 1


VAR: contextvars.ContextVar[str] = contextvars.ContextVar("VAR", default="unset")


class _Ops(TorchDispatchMode):
    """The names of the ops dispatched under it, on whatever thread."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.add(str(func))
        return func(*args, **(kwargs or {}))


def test_the_two_sides_hand_over_at_their_in_flight_points() -> None:
    log: list[str] = []
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    b_ex = _Note(log, "B")
    loss = (overlap.wait(b_ex, overlap.launch(b_ex, x)) ** 2).sum()
    log.clear()
    VAR.set("caller")
    seen: dict[str, Any] = {}

    def forward() -> torch.Tensor:
        seen["var"], seen["cast"] = VAR.get(), torch.get_autocast_dtype("cpu")
        seen["enabled"] = torch.is_autocast_enabled("cpu")
        f_ex = _Note(log, "F")
        token = overlap.launch(f_ex, x.detach() + 1)
        log.append("F compute")
        return overlap.wait(f_ex, token)

    def backward() -> None:
        torch.autograd.backward(hold_backward_end(loss))
        log.append("B done")

    with torch.autocast("cpu", dtype=torch.bfloat16), _Ops() as ops:
        out, switches = run_interleaved(forward, backward)
        caller_modes = _get_current_dispatch_mode_stack()
    assert seen == {"var": "caller", "cast": torch.bfloat16, "enabled": True}
    # the caller's dispatch mode saw both sides' ops (the forward's add, the backward's
    # gradient of the square: a mul), and the caller's own mode stack is as it was
    assert {"aten.add.Tensor", "aten.mul.Tensor"} <= ops.names, ops.names
    assert caller_modes == [ops] and _get_current_dispatch_mode_stack() == []
    # F starts its exchange and hands over; B's gradient exchange starts and hands back; F
    # computes and waits; B finishes (its end waits for F's end)
    assert log == [
        "F start", "B start_grad", "F compute", "F finish", "B finish_grad", "B done",
    ], log  # fmt: skip
    assert switches == 2
    torch.testing.assert_close(out, x.detach() + 1)
    torch.testing.assert_close(x.grad, 2 * x.detach())
    assert comm.set_lane(0) == 0  # the caller's lane is back


def test_an_error_of_one_side_is_raised_after_the_other_ends() -> None:
    log: list[str] = []

    def bad() -> None:
        overlap.in_flight()
        raise ValueError("the forward side failed")

    def other() -> None:
        log.append("other ran")
        overlap.in_flight()
        log.append("other ended")

    with pytest.raises(ValueError, match="the forward side failed"):
        run_interleaved(bad, other)
    assert log == ["other ran", "other ended"]
    with pytest.raises(RuntimeError, match="does not nest"):
        run_interleaved(lambda: run_interleaved(lambda: None, lambda: None), lambda: None)
