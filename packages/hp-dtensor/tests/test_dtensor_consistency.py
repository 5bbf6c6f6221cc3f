"""Consistency mode: ranks that pass different shapes, dtypes or options raise the same
error on every rank, naming the field and the ranks; off by default (no communication)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from hyper_parallel.dtensor import InconsistentRanksError, check_consistent, consistency_checks
from hyper_parallel.dtensor.consistency import consistency_enabled
from hyper_parallel.dtensor.testing import run_distributed


def _cases() -> dict[str, object]:
    rank = dist.get_rank()
    res: dict[str, object] = {"default_off": consistency_enabled()}
    # off: different shapes pass without any collective
    check_consistent(None, "op", x=torch.zeros(rank + 1))
    with consistency_checks():
        check_consistent(None, "op", x=torch.zeros(3), chunks=2)  # agree
        for field, kwargs in {
            "x": {"x": torch.zeros(4 + (rank == 2)), "chunks": 2},
            "dtype": {"x": torch.zeros(4, dtype=torch.float64 if rank else torch.float32)},
            "chunks": {"x": torch.zeros(4), "chunks": 2 if rank != 1 else 4},
        }.items():
            try:
                check_consistent(None, f"case {field}", **kwargs)
                res[field] = None
            except InconsistentRanksError as exc:
                res[field] = (exc.field, str(exc))
    return res


@pytest.mark.timeout(90)
def test_disagreeing_ranks_raise_the_same_error_naming_field_and_ranks():
    os.environ.pop("HP_CHECK_CONSISTENCY", None)
    results = run_distributed(_cases, 3, timeout=60)
    for r in results:
        assert r["default_off"] is False
        assert r["x"] == results[0]["x"]  # the same error on every rank
        field, msg = r["x"]
        assert field == "x"
        assert "ranks [0, 1]: Tensor[4]:float32:cpu" in msg and "ranks [2]: Tensor[5]" in msg
        field, msg = r["dtype"]
        assert field == "x" and "float64" in msg and "ranks [1, 2]" in msg
        field, msg = r["chunks"]
        assert field == "chunks" and "ranks [0, 2]: 2" in msg and "ranks [1]: 4" in msg


def test_environment_variable_turns_the_checks_on(monkeypatch):
    monkeypatch.setenv("HP_CHECK_CONSISTENCY", "1")
    assert consistency_enabled()
    with consistency_checks(False):
        assert not consistency_enabled()
    monkeypatch.setenv("HP_CHECK_CONSISTENCY", "0")
    assert not consistency_enabled()
