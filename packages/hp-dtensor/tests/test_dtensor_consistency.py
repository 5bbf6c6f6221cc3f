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


def _entry_cases() -> dict[str, object]:
    from hyper_parallel.dtensor import checked_entry

    rank = dist.get_rank()
    built: list[str] = []

    def inner_fields(x: torch.Tensor) -> tuple[object, dict[str, object]]:
        built.append("inner")
        return None, {"x": x}

    @checked_entry("inner", inner_fields)
    def inner(x: torch.Tensor) -> int:
        check_consistent(None, "helper", rows=x.shape[0])  # nested: never communicates
        return int(x.shape[0])

    def outer_fields(x: torch.Tensor, n: int) -> tuple[object, dict[str, object]]:
        built.append("outer")
        return None, {"n": n}

    @checked_entry("outer", outer_fields)
    def outer(x: torch.Tensor, n: int) -> int:
        return inner(x) + n

    res: dict[str, object] = {"name": outer.__name__}
    # off: the fields are never built, nothing is compared
    res["off"] = (outer(torch.zeros(rank + 1), 1), list(built))
    with consistency_checks():
        built.clear()
        # the outer entry compares only its own fields; the nested entry and helper do not
        # check (x differs across ranks, which the inner entry alone would have caught)
        res["nested"] = (outer(torch.zeros(rank + 1), 1), list(built))
        built.clear()
        try:
            inner(torch.zeros(rank + 1))  # called directly: it is the outermost, it checks
            res["direct"] = None
        except InconsistentRanksError as exc:
            res["direct"] = (exc.field, str(exc), list(built))
        try:
            outer(torch.zeros(2), rank % 2)
            res["outer"] = None
        except InconsistentRanksError as exc:
            res["outer"] = (exc.field, str(exc))
        res["after"] = outer(torch.zeros(2), 1)  # the nesting flag is reset after an error
    return res


@pytest.mark.timeout(90)
def test_checked_entry_checks_once_at_the_outermost_entry_point():
    os.environ.pop("HP_CHECK_CONSISTENCY", None)
    results = run_distributed(_entry_cases, 2, timeout=60)
    for rank, r in enumerate(results):
        assert r["name"] == "outer"  # functools.wraps
        assert r["off"] == (rank + 2, [])
        assert r["nested"] == (rank + 2, ["outer"])
        field, msg, built = r["direct"]
        assert field == "x" and "inner: ranks disagree" in msg and built == ["inner"]
        field, msg = r["outer"]
        assert field == "n" and "ranks [0]: 0" in msg and "ranks [1]: 1" in msg
        assert r["after"] == 3
