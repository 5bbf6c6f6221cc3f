"""The overlap schedule, proven from the recorded order of events on every rank."""

from __future__ import annotations

import json

import pytest
import torch
from _cp_testutil import TIMEOUT, build, inputs, rank_record_schedule

from hyper_parallel.context_parallel import (
    EventRecorder,
    MultiHeadLatentAttention,
    current_recorder,
    record_events,
)
from hyper_parallel.dtensor.testing import run_distributed

_CACHE: dict[tuple, list] = {}


def _runs(strategy: str, overlap: bool, world: int = 2) -> list[dict]:
    key = (strategy, overlap, world)
    if key not in _CACHE:
        _CACHE[key] = run_distributed(
            rank_record_schedule, world, strategy, overlap, timeout=TIMEOUT
        )
    return _CACHE[key]


def _schedules(strategy: str, overlap: bool, world: int = 2) -> list[list[tuple]]:
    return [r["events"] for r in _runs(strategy, overlap, world)]


class _Order:
    def __init__(self, events: list[tuple]) -> None:
        self.events = events

    def at(self, kind: str, name: str, phase: str) -> int:
        hits = [i for i, e in enumerate(self.events) if e[:3] == (kind, name, phase)]
        assert len(hits) == 1, f"expected one {kind} {name} {phase}, got {len(hits)}"
        return hits[0]

    def in_flight_during(self, coll: str, span: str, phase: str) -> None:
        """``coll`` launched before ``span`` begins and waited after it ends."""
        launch = self.at("launch", coll, phase)
        wait = self.at("wait_begin", coll, phase)
        begin, end = self.at("begin", span, phase), self.at("end", span, phase)
        assert launch < begin < end < wait, (coll, span, phase, launch, begin, end, wait)


@pytest.mark.parametrize("world", [2, 4])
def test_expanded_forward_overlaps_kv_all_to_alls_with_q_projection(world):
    for events in _schedules("expanded", True, world):
        o = _Order(events)
        o.in_flight_during("a2a:k", "q_proj", "forward")
        o.in_flight_during("a2a:v", "q_proj", "forward")
        assert o.at("end", "kv_proj", "forward") < o.at("launch", "a2a:k", "forward")
        assert o.at("wait", "a2a:q", "forward") < o.at("begin", "attention", "forward")


def test_latent_forward_overlaps_gather_with_q_projection_and_q_with_expansion():
    for events in _schedules("latent", True):
        o = _Order(events)
        o.in_flight_during("all_gather:latent", "q_proj", "forward")
        o.in_flight_during("a2a:q", "kv_b_proj", "forward")


@pytest.mark.parametrize("strategy", ["expanded", "latent"])
def test_output_all_to_all_is_waited_when_o_proj_needs_it(strategy):
    for events in _schedules(strategy, True):
        o = _Order(events)
        assert o.at("end", "attention", "forward") < o.at("launch", "a2a:o", "forward")
        assert o.at("wait", "a2a:o", "forward") < o.at("begin", "o_proj", "forward")


@pytest.mark.parametrize("strategy", ["expanded", "latent"])
def test_do_all_to_all_is_in_flight_during_o_proj_weight_grad(strategy):
    for events in _schedules(strategy, True):
        o = _Order(events)
        assert o.at("end", "o_proj.input_grad", "backward") < o.at("launch", "a2a:do", "backward")
        o.in_flight_during("a2a:do", "o_proj.weight_grad", "backward")
        assert o.at("wait", "a2a:do", "backward") < o.at("begin", "attention", "backward")


def test_expanded_backward_keeps_dk_dv_in_flight_during_q_projection_backward():
    for events in _schedules("expanded", True):
        o = _Order(events)
        for coll in ("a2a:dq", "a2a:dk", "a2a:dv"):
            # launched as soon as attention's backward produces the gradient
            assert o.at("end", "attention", "backward") < o.at("launch", coll, "backward")
            assert o.at("launch", coll, "backward") < o.at("begin", "q_proj", "backward")
        o.in_flight_during("a2a:dk", "q_proj", "backward")
        o.in_flight_during("a2a:dv", "q_proj", "backward")
        assert o.at("wait", "a2a:dk", "backward") < o.at("begin", "kv_proj", "backward")


def test_latent_backward_keeps_dq_in_flight_during_kv_b_proj_backward_matmuls():
    for events in _schedules("latent", True):
        o = _Order(events)
        assert o.at("end", "attention", "backward") < o.at("launch", "a2a:dq", "backward")
        o.in_flight_during("a2a:dq", "kv_b_proj.input_grad", "backward")
        o.in_flight_during("a2a:dq", "kv_b_proj.weight_grad", "backward")
        assert o.at("wait", "a2a:dq", "backward") < o.at("begin", "q_proj", "backward")


def test_latent_backward_reduce_scatters_under_kv_b_weight_grad_and_q_backward():
    for events in _schedules("latent", True):
        o = _Order(events)
        assert o.at("end", "kv_b_proj.input_grad", "backward") < o.at(
            "launch", "reduce_scatter:dlatent", "backward"
        )
        o.in_flight_during("reduce_scatter:dlatent", "kv_b_proj.weight_grad", "backward")
        o.in_flight_during("reduce_scatter:dlatent", "q_proj", "backward")
        assert o.at("wait", "reduce_scatter:dlatent", "backward") < o.at(
            "begin", "kv_a_proj", "backward"
        )


@pytest.mark.parametrize("strategy", ["expanded", "latent"])
def test_blocking_schedule_waits_every_collective_before_the_next_event(strategy):
    for events in _schedules(strategy, False):
        for i, e in enumerate(events):
            if e[0] == "launch":
                assert events[i + 1][:2] == ("wait_begin", e[1]), events[i : i + 3]
                assert events[i + 2][:2] == ("wait", e[1])


@pytest.mark.parametrize("strategy", ["expanded", "latent"])
def test_overlap_and_blocking_move_the_same_bytes(strategy):
    def total(evs):
        return sum(e[3] for e in evs if e[0] == "launch")

    on, off = _schedules(strategy, True), _schedules(strategy, False)
    assert [total(e) for e in on] == [total(e) for e in off]
    assert all(total(e) > 0 for e in on)


def test_latent_moves_fewer_bytes_by_the_shape_ratio():
    from _cp_testutil import BATCH, SEQ, config

    c = config(True)
    p, s = 2, SEQ // 2  # tokens per rank
    item = 8  # float64
    # bytes received per rank per step (forward + backward), from the shapes
    q = s * c.num_heads * c.qk_head_dim * (p - 1) // p
    k, v = q, s * c.num_heads * c.v_head_dim * (p - 1) // p
    o = s * c.num_heads * c.v_head_dim * (p - 1) // p
    gather = s * (c.kv_lora_rank + c.qk_rope_head_dim) * (p - 1)
    expanded = 2 * (q + k + v + o) * BATCH * item
    latent = 2 * (q + gather + o) * BATCH * item
    for strategy, expect in (("expanded", expanded), ("latent", latent)):
        for evs in _schedules(strategy, True):
            assert sum(e[3] for e in evs if e[0] == "launch") == expect


def test_recorder_is_off_by_default_and_adds_no_graph_nodes_when_off():
    assert current_recorder() is None
    m = build(True)
    x, _ = inputs()

    def node_names(t: torch.Tensor) -> set[str]:
        seen, stack, names = set(), [t.grad_fn], set()
        while stack:
            fn = stack.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            names.add(type(fn).__name__)
            stack.extend(f for f, _ in fn.next_functions)
        return names

    assert isinstance(m, MultiHeadLatentAttention)
    assert not any("Mark" in n for n in node_names(m(x.requires_grad_())))


def test_chrome_trace_has_compute_and_comm_tracks(tmp_path):
    for rank, run in enumerate(_runs("latent", True)):
        trace = run["trace"]
        spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        comm = {e["name"] for e in spans if e["tid"] == 1}
        compute = {e["name"] for e in spans if e["tid"] == 0}
        assert {"all_gather:latent", "a2a:q", "a2a:dq", "reduce_scatter:dlatent"} <= comm
        assert {"q_proj (forward)", "kv_b_proj.weight_grad (backward)"} <= compute
        assert all(e["dur"] >= 0 and e["pid"] == rank for e in spans)
        gather = next(e for e in spans if e["name"] == "all_gather:latent")
        assert gather["args"]["bytes_received"] > 0


def test_chrome_trace_is_written_as_json(tmp_path):
    rec = EventRecorder()
    rec.add("begin", "q_proj", "forward")
    op = rec.new_op_id()
    rec.add("launch", "a2a:q", "forward", op, 64)
    rec.add("end", "q_proj", "forward")
    rec.add("wait_begin", "a2a:q", "forward", op)
    rec.add("wait", "a2a:q", "forward", op)
    path = tmp_path / "trace.json"
    trace = rec.to_chrome_trace(path)
    assert json.loads(path.read_text()) == trace
    names = [e["name"] for e in trace["traceEvents"] if e["ph"] == "X"]
    assert sorted(names) == ["a2a:q", "q_proj (forward)", "wait a2a:q"]
    assert rec.bytes_received() == 64


def test_record_events_restores_the_previous_recorder():
    with record_events() as outer:
        with record_events() as inner:
            assert current_recorder() is inner
        assert current_recorder() is outer
    assert current_recorder() is None
