"""Rejected inputs raise the same clear error on every rank before any communication; the
module is left exactly as it was; the group keeps working."""

from __future__ import annotations

import pytest
from _cp_testutil import TIMEOUT, rank_errors

from hyper_parallel.dtensor.testing import run_distributed

EXPECTED = {
    "not_mla": ("TypeError", "MultiHeadLatentAttention"),
    "heads_not_divisible": ("ValueError", "num_heads"),
    "bad_strategy": ("ValueError", "strategy"),
    "overlap_not_bool": ("TypeError", "overlap"),
    "mesh_not_a_mesh": ("TypeError", "DeviceMesh"),
    "seq_not_divisible": ("ValueError", "not divisible by the CP size"),
    "a2a_heads_not_divisible": ("ValueError", "heads"),
    "a2a_seq_not_divisible": ("ValueError", "sequence length"),
    "a2a_same_dims": ("ValueError", "must differ"),
    "a2a_dim_out_of_range": ("ValueError", "out of range"),
    "degree_float": ("TypeError", "ulysses_degree"),
    "degree_bool": ("TypeError", "ulysses_degree"),
    "degree_one": ("ValueError", "1 < degree"),
    "degree_equals_p": ("ValueError", "1 < degree"),
    "degree_not_dividing": ("ValueError", "divide"),
    "rollback": ("RuntimeError", "injected failure"),
    "double": ("RuntimeError", "already applied"),
    "bad_hidden": ("ValueError", "hidden_states"),
}


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_rejects_bad_input_before_communicating_and_keeps_working(world):
    reports = run_distributed(rank_errors, world, timeout=TIMEOUT)
    expected = dict(EXPECTED)
    if world == 4:
        expected["mesh_2d"] = ("ValueError", "1-D")
    for rank, rep in enumerate(reports):
        for case, (exc, fragment) in expected.items():
            got_exc, msg = rep[case]
            assert got_exc == exc, f"rank {rank} {case}: {got_exc} {msg}"
            assert fragment in msg, f"rank {rank} {case}: {msg!r}"
        assert rep["module_untouched"], f"rank {rank}: a rejected call changed the module"
        assert rep["rolled_back"], f"rank {rank}: a failed rewrite was not rolled back"
        assert rep["launches_during_errors"] == []
        assert rep["all_reduce_after"] == world
        assert rep["block_works_after"] == (2, 16 // world, 24)
    # the same error text on every rank
    for case in expected:
        assert len({rep[case] for rep in reports}) == 1, case
