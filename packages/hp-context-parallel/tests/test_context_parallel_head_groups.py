"""The head-group pipeline (``head_groups=G``): the same outputs and gradients as G = 1 and as
the serial block, in both strategies; the recorded order shows each group's exchanges in
flight under another group's attention, forward and backward; the collectives one forward
issues; the ``"auto"`` rule; the inputs it rejects."""

from __future__ import annotations

import pytest
import torch
from _cp_testutil import TIMEOUT, build, cp_mesh, inputs, serial_reference

from hyper_parallel.context_parallel import parallelize_mla, record_events, shard_sequence
from hyper_parallel.context_parallel.head_groups import (
    AUTO_MIN_GROUP_BYTES,
    AUTO_MIN_GROUP_BYTES_ACCELERATOR,
    choose_head_groups,
    merge_heads,
    split_heads,
)
from hyper_parallel.context_parallel.parallel_mla import mla_head_groups
from hyper_parallel.dtensor.simlink import simulated_link
from hyper_parallel.dtensor.testing import run_distributed

GROUPS = (1, 2, 4)  # 8 heads over 2 ranks: 4 heads per rank


def _step(strategy: str, groups: int, q_lora: bool = True, link: bool = False) -> dict:
    mesh = cp_mesh()
    m = build(q_lora)
    parallelize_mla(m, mesh, strategy=strategy, head_groups=groups)
    x, dy = inputs()
    x_local = shard_sequence(x, mesh).clone().requires_grad_(True)
    ctx = simulated_link(latency_s=1e-4, bytes_per_s=5e7) if link else None
    with record_events() as rec:
        if ctx is None:
            out = m(x_local)
            out.backward(shard_sequence(dy, mesh))
        else:
            with ctx:
                out = m(x_local)
                out.backward(shard_sequence(dy, mesh))
    return {
        "out": out.detach(),
        "dx": x_local.grad,
        "grads": {n: p.grad.clone() for n, p in m.named_parameters()},
        "events": [(e.kind, e.name, e.phase) for e in rec.events],
    }


def rank_head_groups() -> dict:
    runs = {(s, g): _step(s, g) for s in ("expanded", "latent") for g in GROUPS}
    runs[("no_q_lora", 2)] = _step("latent", 2, q_lora=False)
    runs[("no_q_lora", 1)] = _step("latent", 1, q_lora=False)
    for s in ("expanded", "latent"):
        runs[(s, "link")] = _step(s, 2, link=True)
    return runs


def rank_rejected() -> dict:
    mesh = cp_mesh()
    errors = {}
    for bad, overlap in (
        (3, True),
        (0, True),
        (True, True),
        ("two", True),
        (2.0, True),
        (2, False),
        (8, True),
    ):
        m = build(True)
        try:
            parallelize_mla(m, mesh, head_groups=bad, overlap=overlap)
            errors[repr((bad, overlap))] = None
        except ValueError as e:
            errors[repr((bad, overlap))] = str(e)
        errors[repr((bad, overlap)) + ":untouched"] = type(m).__name__
    m = parallelize_mla(build(True), mesh, head_groups="auto")
    x, _ = inputs()
    errors["auto"] = mla_head_groups(m, shard_sequence(x, mesh))
    return errors


_CACHE: dict[str, list] = {}


def _runs() -> list[dict]:
    if "runs" not in _CACHE:
        _CACHE["runs"] = run_distributed(rank_head_groups, 2, timeout=TIMEOUT)
    return _CACHE["runs"]


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("strategy", ["expanded", "latent"])
def test_every_group_count_equals_one_group_and_the_serial_block(strategy):
    ref = serial_reference(True)
    for rank, runs in enumerate(_runs()):
        base = runs[(strategy, 1)]
        for g in GROUPS:
            r = runs[(strategy, g)]
            _close(r["out"], base["out"])
            _close(r["dx"], base["dx"])
            assert r["grads"].keys() == base["grads"].keys()
            for n in base["grads"]:
                _close(r["grads"][n], base["grads"][n])
            _close(r["out"], ref["out"].chunk(2, dim=1)[rank])
            _close(r["dx"], ref["dx"].chunk(2, dim=1)[rank])
    summed = {n: sum(r[(strategy, 4)]["grads"][n] for r in _runs()) for n in ref["grads"]}
    for n, gref in ref["grads"].items():
        torch.testing.assert_close(summed[n], gref, rtol=1e-10, atol=1e-12)


def test_latent_groups_without_q_lora_equal_one_group():
    for runs in _runs():
        a, b = runs[("no_q_lora", 2)], runs[("no_q_lora", 1)]
        _close(a["out"], b["out"])
        for n in b["grads"]:
            _close(a["grads"][n], b["grads"][n])


@pytest.mark.parametrize("strategy", ["expanded", "latent"])
def test_the_modeled_link_changes_no_bit(strategy):
    for runs in _runs():
        a, b = runs[(strategy, "link")], runs[(strategy, 2)]
        assert torch.equal(a["out"], b["out"]) and torch.equal(a["dx"], b["dx"])
        assert all(torch.equal(a["grads"][n], b["grads"][n]) for n in b["grads"])


class _Order:
    def __init__(self, events: list[tuple]) -> None:
        self.events = events

    def at(self, kind: str, name: str, phase: str) -> int:
        hits = [i for i, e in enumerate(self.events) if e == (kind, name, phase)]
        assert len(hits) == 1, f"expected one {kind} {name} {phase}, got {len(hits)}"
        return hits[0]

    def in_flight_during(self, coll: str, span: str, phase: str) -> None:
        launch, wait = self.at("launch", coll, phase), self.at("wait_begin", coll, phase)
        begin, end = self.at("begin", span, phase), self.at("end", span, phase)
        assert launch < begin < end < wait, (coll, span, phase, launch, begin, end, wait)


@pytest.mark.parametrize("strategy", ["expanded", "latent"])
def test_each_groups_exchanges_are_in_flight_under_another_groups_attention(strategy):
    for runs in _runs():
        o = _Order(runs[(strategy, 4)]["events"])
        for g in range(1, 4):  # forward: group g's Q (and K, V) arrive while g-1 attends
            o.in_flight_during(f"a2a:q{g}", f"attention.g{g - 1}", "forward")
            if strategy == "expanded":
                o.in_flight_during(f"a2a:k{g}", f"attention.g{g - 1}", "forward")
                o.in_flight_during(f"a2a:v{g}", f"attention.g{g - 1}", "forward")
            o.in_flight_during(f"a2a:o{g - 1}", f"attention.g{g}", "forward")
        for g in range(3):  # backward runs the groups last to first
            o.in_flight_during(f"a2a:do{g}", f"attention.g{g + 1}", "backward")
            o.in_flight_during(f"a2a:dq{g + 1}", f"attention.g{g}", "backward")
            if strategy == "expanded":
                o.in_flight_during(f"a2a:dk{g + 1}", f"attention.g{g}", "backward")
        o.in_flight_during("a2a:do0", "o_proj.weight_grad", "backward")
        if strategy == "latent":
            o.in_flight_during("all_gather:latent", "q_proj", "forward")
            # every group's heads expanded at once, fused with the gather's wait, as with G = 1:
            # every Q in flight under it; in backward the last group's dQ under its two
            # matmuls and the reduce-scatter under the weight-gradient one
            for g in range(4):
                o.in_flight_during(f"a2a:q{g}", "kv_b_proj", "forward")
            o.in_flight_during("a2a:dq0", "kv_b_proj.input_grad", "backward")
            o.in_flight_during("a2a:dq0", "kv_b_proj.weight_grad", "backward")
            o.in_flight_during("reduce_scatter:dlatent", "kv_b_proj.weight_grad", "backward")
            o.in_flight_during("reduce_scatter:dlatent", "q_proj", "backward")


@pytest.mark.parametrize("strategy", ["expanded", "latent"])
def test_one_forward_issues_the_schedules_collectives_only(strategy):
    for runs in _runs():
        for g in GROUPS:
            launches = [e for e in runs[(strategy, g)]["events"] if e[0] == "launch"]
            fwd = sorted(n for k, n, p in launches if p == "forward")
            bwd = sorted(n for k, n, p in launches if p == "backward")
            if g == 1:
                continue  # the single-group schedule is counted by its own test file
            per = (
                ["a2a:k", "a2a:o", "a2a:q", "a2a:v"]
                if strategy == "expanded"
                else ["a2a:o", "a2a:q"]
            )
            want = sorted(f"{n}{i}" for n in per for i in range(g))
            if strategy == "latent":
                want = sorted([*want, "all_gather:latent"])
            assert fwd == want
            assert len(bwd) == len(fwd)


def test_bad_head_groups_are_rejected_on_every_rank_leaving_the_module_untouched():
    for errors in run_distributed(rank_rejected, 2, timeout=TIMEOUT):
        for key in ("(3, True)", "(8, True)"):
            assert "does not divide the 4 heads per rank" in errors[key]
        for key in ("(0, True)", "(True, True)", "('two', True)", "(2.0, True)"):
            assert "must be 'auto' or a positive int" in errors[key]
        assert "needs overlap=True" in errors["(2, False)"]
        assert all(v == "MultiHeadLatentAttention" for k, v in errors.items() if "untouched" in k)
        auto = errors["auto"]
        assert auto.count == 1 and "bytes per group" in auto.reason  # tiny test shapes


def test_auto_rule_is_a_function_of_shapes_only():
    big = dict(tokens_per_rank=4096, batch=1, q_head_dim=192, element_size=4, cp_size=2)
    assert choose_head_groups(8, device_type="cpu", overlap=True, **big).count == 8
    assert choose_head_groups(16, device_type="cpu", overlap=True, **big).count == 8
    assert choose_head_groups(12, device_type="cpu", overlap=True, **big).count == 6
    assert choose_head_groups(5, device_type="cpu", overlap=True, **big).count == 5
    assert choose_head_groups(11, device_type="cpu", overlap=True, **big).count == 1
    assert choose_head_groups(8, device_type="cpu", overlap=False, **big).count == 1
    one = dict(big, cp_size=1)
    assert choose_head_groups(8, device_type="cpu", overlap=True, **one).count == 1
    # the smallest per-group query exchange stays above the floor
    small = dict(big, tokens_per_rank=AUTO_MIN_GROUP_BYTES["cpu"] // (2 * 2 * 192 * 4))
    assert choose_head_groups(8, device_type="cpu", overlap=True, **small).count == 2
    # an accelerator's floor is its own: the same shapes pipeline less there
    mid = dict(big, tokens_per_rank=1024)
    assert choose_head_groups(8, device_type="cpu", overlap=True, **mid).count == 8
    assert choose_head_groups(8, device_type="npu", overlap=True, **mid).count == 1
    npu = dict(big, tokens_per_rank=AUTO_MIN_GROUP_BYTES_ACCELERATOR // (2 * 2 * 192 * 4))
    assert choose_head_groups(8, device_type="npu", overlap=True, **npu).count == 2


def test_split_and_merge_are_inverse_and_group_g_holds_rank_js_heads():
    p, groups, hg = 2, 2, 3
    x = torch.arange(1 * 5 * p * groups * hg * 2, dtype=torch.float64).view(1, 5, 12, 2)
    parts = split_heads(x, p, groups)
    assert len(parts) == groups and parts[0].shape == (1, 5, p * hg, 2)
    h = groups * hg
    for g in range(groups):
        for j in range(p):
            want = x[:, :, j * h + g * hg : j * h + (g + 1) * hg]
            assert torch.equal(parts[g][:, :, j * hg : (j + 1) * hg], want)
    assert torch.equal(merge_heads(parts, p), x)


# ---- the stock Hugging Face modules (DeepseekV3Attention, KimiLinearAttention) ----------------
_HF_CASES = [
    (v, s) for v in ("deepseek_interleave_yarn_qlora", "kimi") for s in ("expanded", "latent")
]


def rank_stock_head_groups() -> dict:
    import _cp_hf as H

    mesh = H.cp_mesh()
    p, r = mesh.size(), mesh.get_local_rank()
    block = torch.arange(r * H.SEQ // p, (r + 1) * H.SEQ // p)
    out = {}
    for variant, strategy in _HF_CASES:
        m = H.build(variant)  # 4 heads: 2 per rank, so 2 groups of one head each
        parallelize_mla(m, mesh, strategy=strategy, head_groups=2)
        x, dy = H.inputs()
        with record_events() as rec:
            res = H._run(m, variant, shard_sequence(x, mesh), shard_sequence(dy, mesh), block)
        res["forward_a2a"] = sorted(
            e.name for e in rec.events if e.kind == "launch" and e.phase == "forward"
        )
        out[(variant, strategy)] = res
    return out


def test_stock_modules_with_head_groups_equal_the_serial_module():
    import _cp_hf as H

    runs = run_distributed(rank_stock_head_groups, 2, timeout=TIMEOUT)
    for variant, strategy in _HF_CASES:
        ref = H.serial_reference(variant)
        per_rank = [r[(variant, strategy)] for r in runs]
        tol = dict(rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(torch.cat([r["out"] for r in per_rank], 1), ref["out"], **tol)
        torch.testing.assert_close(torch.cat([r["dx"] for r in per_rank], 1), ref["dx"], **tol)
        for name, g in ref["grads"].items():
            torch.testing.assert_close(sum(r["grads"][name] for r in per_rank), g, **tol)
        for r in per_rank:  # each rank exchanges its two groups, not the whole
            assert r["weights"] is None
            names = r["forward_a2a"]
            assert "a2a:q0" in names and "a2a:q1" in names and "a2a:q" not in names, names
