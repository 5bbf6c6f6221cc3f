"""parallelize_mla on the stock Hugging Face DeepSeek-V3 and Kimi-Linear attention modules:
the context-parallel module equals the serial module on the full sequence (output, input
gradient, every parameter gradient), for both strategies, overlapped and blocking, at 2 ranks
and at 4 ranks on a mesh flattened from (cp, tp)."""

from __future__ import annotations

import pytest
import torch
from _cp_hf import COMBOS, RECORDED, VARIANTS, rank_parallel, serial_reference
from test_context_parallel_schedule import _Order

from hyper_parallel.dtensor.testing import run_distributed

TIMEOUT = 240.0
_CACHE: dict[int, list] = {}
_REFS: dict[str, dict] = {}


def _parallel(world: int) -> list:
    if world not in _CACHE:
        _CACHE[world] = run_distributed(rank_parallel, world, COMBOS, timeout=TIMEOUT)
    return _CACHE[world]


def _reference(variant: str) -> dict:
    if variant not in _REFS:
        _REFS[variant] = serial_reference(variant)
    return _REFS[variant]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("variant,strategy,overlap", COMBOS)
def test_stock_hf_mla_context_parallel_equals_serial_with_every_gradient(
    world, variant, strategy, overlap
):
    ref = _reference(variant)
    per_rank = [r[(variant, strategy, overlap)] for r in _parallel(world)]
    tol = dict(rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(torch.cat([r["out"] for r in per_rank], 1), ref["out"], **tol)
    torch.testing.assert_close(torch.cat([r["dx"] for r in per_rank], 1), ref["dx"], **tol)
    assert set(per_rank[0]["grads"]) == set(ref["grads"])
    for name, g in ref["grads"].items():
        summed = sum(r["grads"][name] for r in per_rank)
        torch.testing.assert_close(summed, g, **tol, msg=lambda m, n=name: f"{n}: {m}")
    for r in per_rank:
        assert r["weights"] is None  # the forward returns (output, None)
        assert r["same_parameters"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_stock_module_runs_the_overlapped_schedule(world):
    """The same schedule as ours: collectives in flight under independent projections."""
    for rank_results in _parallel(world):
        o = _Order(rank_results[(RECORDED, "expanded", True)]["events"])
        o.in_flight_during("a2a:k", "q_proj", "forward")
        o.in_flight_during("a2a:dk", "q_proj", "backward")
        o = _Order(rank_results[(RECORDED, "latent", True)]["events"])
        o.in_flight_during("all_gather:latent", "q_proj", "forward")
        o.in_flight_during("reduce_scatter:dlatent", "kv_b_proj.weight_grad", "backward")
        o.in_flight_during("a2a:do", "o_proj.weight_grad", "backward")


def test_the_variants_cover_both_rope_layouts_yarn_q_lora_and_nope():
    fams = {(v[0], v[1] is None, v[2], v[3]) for v in VARIANTS.values()}
    assert ("deepseek", True, True, False) in fams  # interleaved, no q LoRA
    assert any(f[0] == "deepseek" and not f[2] and f[3] for f in fams)  # rotate-half + yarn
    assert {f[1] for f in fams if f[0] == "kimi"} == {True, False}


MODEL_CASES = [
    (v, attn, s)
    for v in ("deepseek_interleave", "kimi_qlora")
    for attn in ("sdpa", "eager")
    for s in ("expanded", "latent")
]


@pytest.mark.timeout(300)
def test_whole_stock_models_with_parallel_mla_layers_equal_the_serial_model():
    """What a model-level package does: every MLA layer parallelized, the model called on the
    rank's block with global position_ids (use_cache=False); the model builds the RoPE tables
    and the causal mask itself (sdpa: None; eager: the block's 4-D causal mask)."""
    from _cp_hf import rank_models, serial_model_reference

    world = 2
    results = run_distributed(rank_models, world, MODEL_CASES, timeout=TIMEOUT)
    refs = {v: serial_model_reference(v) for v in {c[0] for c in MODEL_CASES}}
    tol = dict(rtol=1e-9, atol=1e-10)
    for case in MODEL_CASES:
        variant, attn, _ = case
        ref, per_rank = refs[variant], [r[case] for r in results]
        torch.testing.assert_close(torch.cat([r["out"] for r in per_rank], 1), ref["out"], **tol)
        assert set(per_rank[0]["grads"]) == set(ref["grads"])
        for name, g in ref["grads"].items():
            summed = sum(r["grads"][name] for r in per_rank)
            where = f"{case} {name}"
            torch.testing.assert_close(summed, g, **tol, msg=lambda m, w=where: f"{w}: {m}")
        expected_mask = None if attn == "sdpa" else ((2, 1, 8, 8), "torch.float64")
        assert all(r["mask"] == expected_mask for r in per_rank), [r["mask"] for r in per_rank]


HF_ERRORS = {
    "unknown_family": (
        "TypeError",
        "supports MultiHeadLatentAttention, DeepseekV3Attention, KimiLinearAttention",
    ),
    "heads_not_divisible": ("ValueError", "num_heads (3) is not divisible by the CP size 2"),
    "past_key_values": ("ValueError", "past_key_values must be None"),
    "model_default_use_cache": ("ValueError", "use_cache=False"),
    "padding_mask": ("ValueError", "not the causal pattern"),
    "bool_mask_not_causal": ("ValueError", "not the causal pattern"),
    "mask_2d": ("ValueError", "expected a 4-D tensor"),
    "hidden_width": ("ValueError", "hidden_states must be this rank's sequence block"),
    "rope_of_full_sequence": ("ValueError", "position_embeddings must be (cos, sin)"),
    "packed": ("ValueError", "cu_seq_lens_q must end at the sequence length S=16, got 8"),
    "packed_batch": ("ValueError", "need batch size 1"),
    "packed_order": ("ValueError", "must be strictly increasing"),
    "packed_start": ("ValueError", "must start at 0"),
    "dropout_in_training": ("ValueError", "attention dropout 0.1 is not supported"),
}
# rejected only in consistency mode (asymmetric inputs: no rank can tell alone): the same
# InconsistentRanksError on every rank -> (field it names, fragments of its message)
_WHAT = "context-parallel DeepseekV3Attention forward: ranks disagree on"
HF_ASYMMETRIC = {
    "mask_on_one_rank": (
        "verdict",
        [
            "ranks [0]: 'ok'; ranks [1]: 'ValueError: attention_mask must be None or plain causal",
            "its entries are not the causal pattern",
        ],
    ),
    "packed_tables_differ": ("cu_seqlens", ["ranks [0]: ((0, 5, 16)); ranks [1]: ((0, 6, 16))"]),
    "blocks_differ": ("hidden_states", ["Tensor[2, 8, 24]", "Tensor[2, 7, 24]"]),
    "leak_on_one_rank": (
        "verdict",
        [
            "ranks [0]: 'ok'; ranks [1]: \"RuntimeError: context-parallel MLA forward: 1 "
            "collective(s) were launched and never waited: ['a2a:stale (forward)']"
        ],
    ),
}


@pytest.mark.timeout(300)
def test_stock_module_rejects_bad_calls_on_every_rank_before_communicating():
    """HF_ERRORS: each rank rejects its own call, consistency mode off, no communication.
    HF_ASYMMETRIC: inputs that differ across ranks, rejected in consistency mode only."""
    from _cp_hf import rank_hf_errors, serial_reference

    reports = run_distributed(rank_hf_errors, 2, timeout=TIMEOUT)
    for rank, rep in enumerate(reports):
        for case, (exc, fragment) in HF_ERRORS.items():
            assert rep[case][0] == exc, f"rank {rank} {case}: {rep[case]}"
            assert fragment in rep[case][1], f"rank {rank} {case}: {rep[case][1]!r}"
        assert rep["launches_during_errors"] == []
        assert rep["accepted_masks_agree"]
        assert rep["undone"]
        assert rep["pending_after"] == []  # the leak was reported (and forgotten)
    for case in HF_ERRORS:  # the same text on every rank when every rank got the bad input
        assert reports[0][case] == reports[1][case], case
    for case, (field, fragments) in HF_ASYMMETRIC.items():  # one rank differs: every rank
        assert reports[0][case] == reports[1][case], case  # raises the same error
        exc, msg = reports[0][case]
        assert exc == "InconsistentRanksError", (case, exc, msg)
        assert msg.startswith(f"{_WHAT} {field!r} ("), (case, msg)
        for fragment in fragments:
            assert fragment in msg, (case, fragment, msg)
    ref = serial_reference("deepseek_rotate_half_yarn_qlora")["out"]
    torch.testing.assert_close(torch.cat([r["output"] for r in reports], 1), ref)
    for rep in reports:
        torch.testing.assert_close(rep["serial_after_undo"], ref, rtol=0, atol=0)
