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


# -- the declarative form: checked_entry(what, compare=..., group=..., extra=...) --------------


def test_declared_fields_bind_arguments_by_name():
    import inspect

    from hyper_parallel.dtensor.consistency import _declared_fields

    def scale(x, factor=2, *, mode="sum", **options):
        return x

    sig = inspect.signature(scale)
    x = torch.zeros(3, 4)

    def fields(*args, **kwargs):
        extra = {"rows": lambda a: a.x.shape[0], "opts": lambda a: sorted(a.options)}
        return _declared_fields(sig, ("x", "factor", "mode"), None, extra, args, kwargs)

    # positional, keyword, defaults left out or given: the same fields, by name
    expected = fields(x, 2, mode="sum")
    assert expected == (
        None,
        {"x": "Tensor[3, 4]:float32:cpu", "factor": "2", "mode": "'sum'", "rows": "3",
         "opts": "()"},
    )  # fmt: skip
    assert fields(x) == fields(x=x) == fields(x, factor=2) == fields(factor=2, x=x) == expected
    assert fields(x, 3)[1]["factor"] == "3"
    assert fields(x, tag=1)[1]["opts"] == "('tag')"  # **options under its own name
    assert fields() is None  # a call that cannot bind: nothing compared (the call raises)


def test_declared_fields_never_raise():
    import inspect

    from hyper_parallel.dtensor.consistency import _declared_fields

    class Unreadable:
        def __repr__(self) -> str:
            raise RuntimeError("no repr")

    def entry(x, mesh=None):
        return x

    sig = inspect.signature(entry)
    per_field = {"half": lambda a: a.x.shape[0] // 2, "dtype": lambda a: a.x.dtype}
    # a field that cannot be read is compared as its exception's name
    _, fields = _declared_fields(sig, ("x",), None, per_field, (None,), {})
    assert fields == {"x": "None", "half": "<AttributeError>", "dtype": "<AttributeError>"}
    _, fields = _declared_fields(sig, ("x",), None, None, (Unreadable(),), {})
    assert fields == {"x": "<RuntimeError>"}
    # one extra function: the whole of it, when it raises; None: nothing to compare
    _, fields = _declared_fields(sig, ("x",), None, lambda a: {"n": 1 / 0}, (1,), {})
    assert fields == {"x": "1", "<extra>": "<ZeroDivisionError>"}
    assert _declared_fields(sig, ("x",), None, lambda a: None, (1,), {}) is None
    # a group that cannot be resolved (another type, a function that raises): nothing compared
    assert _declared_fields(sig, ("x",), "mesh", None, (1, "mesh"), {}) is None
    assert _declared_fields(sig, ("x",), lambda a: a.nothing, None, (1,), {}) is None
    assert _declared_fields(sig, ("x",), "mesh", None, (1,), {}) == (None, {"x": "1"})


def test_checked_entry_declarations_are_checked_when_decorating():
    from hyper_parallel.dtensor import checked_entry

    def entry(x, mesh):
        return x

    with pytest.raises(TypeError, match="has no argument 'y', 'grp'"):
        checked_entry("e", compare=("x", "y"), group="grp")(entry)
    with pytest.raises(TypeError, match="not both"):
        checked_entry("e", lambda x, mesh: None, compare=("x",))
    with pytest.raises(TypeError, match="nothing to compare"):
        checked_entry("e", group="mesh")
    # without a process group (or with the checks off) the body just runs
    with consistency_checks():
        assert checked_entry("e", compare=("x",), group="mesh")(entry)(5, None) == 5


def _declarative_cases() -> dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh

    from hyper_parallel.dtensor import checked_entry

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (3,), mesh_dim_names=("cp",))
    mesh2d = init_device_mesh("cpu", (1, 3), mesh_dim_names=("dp", "cp"))
    ran: list[str] = []

    @checked_entry("inner", compare=("x",), group="mesh")
    def inner(x, mesh):
        ran.append("inner")
        return x

    @checked_entry(
        "scaled", compare=("x", "factor", "mode"), group="mesh",
        extra={"mesh_size": lambda a: a.mesh.size(), "half": lambda a: a.x.shape[0] // 2},
    )  # fmt: skip
    def scaled(x, mesh, factor=2, *, mode="sum"):
        ran.append("scaled")
        inner(torch.zeros(rank + 1), mesh)  # nested: never compares
        return x * factor

    def attempt(fn, *args, **kwargs):
        try:
            fn(*args, **kwargs)
            return None
        except InconsistentRanksError as exc:
            return (exc.field, str(exc))
        except Exception as exc:  # the body's own error, raised alike
            return type(exc).__name__

    x = torch.zeros(4)
    res: dict[str, object] = {}
    with consistency_checks():
        # each rank spells the same call differently: positional, keyword, defaults given
        calls = [lambda: scaled(x, mesh), lambda: scaled(mesh=mesh, x=x, mode="sum"),
                 lambda: scaled(x, mesh, 2, mode="sum")]  # fmt: skip
        res["spelled"] = attempt(calls[rank])
        res["factor"] = attempt(scaled, x, mesh, 2 if rank != 1 else 3)
        # a field that raises on one rank only: that rank differs, every rank raises
        res["broken"] = attempt(scaled, x if rank != 2 else None, mesh)
        # every rank broken alike: they agree, the body raises its own error on each
        res["all_broken"] = attempt(scaled, None, mesh)
        # an n-D mesh (the body rejects it): nothing compared, even where ranks differ
        res["nd_mesh"] = attempt(inner, torch.zeros(rank + 1), mesh2d)
        # a process group by name, and the default group
        on_group = checked_entry("on_group", compare=("x",), group="pg")(lambda x, pg: x)
        res["group"] = attempt(on_group, torch.zeros(rank + 1), mesh.get_group(0))
        on_world = checked_entry("on_world", compare=("x",))(lambda x: x)
        res["world"] = attempt(on_world, torch.zeros(1 + (rank == 0)))
        # one extra function returning None: this call compares nothing
        maybe = checked_entry("maybe", extra=lambda a: None if a.skip else {"x": 1 / a.d})(
            lambda d, skip: d
        )
        res["skipped"] = attempt(maybe, rank + 1, True)
        # the extra function raises on rank 0 only: every rank raises
        res["extra_raises"] = attempt(maybe, 0 if rank == 0 else 1, False)
    res["ran"] = ran
    return res


@pytest.mark.timeout(120)
def test_checked_entry_declarative_form_binds_by_name_and_never_raises_alone():
    os.environ.pop("HP_CHECK_CONSISTENCY", None)
    results = run_distributed(_declarative_cases, 3, timeout=90)
    for r in results:
        assert r["spelled"] is None
        field, msg = r["factor"]
        assert field == "factor" and "ranks [0, 2]: 2" in msg and "ranks [1]: 3" in msg
        field, msg = r["broken"]  # on every rank, naming the unreadable field
        assert field in ("x", "half") and "scaled: ranks disagree" in msg
        assert "ranks [2]: <AttributeError>" in msg or "ranks [2]: None" in msg
        assert r["all_broken"] == "TypeError"  # the body's error, on every rank
        assert r["nd_mesh"] is None
        field, msg = r["group"]
        assert field == "x" and "ranks [0]: Tensor[1]" in msg and "ranks [2]: Tensor[3]" in msg
        field, msg = r["world"]
        assert field == "x" and "ranks [0]: Tensor[2]" in msg
        assert r["skipped"] is None
        field, msg = r["extra_raises"]
        assert "ranks [0]: <ZeroDivisionError>" in msg or "ranks [0]: <missing>" in msg
        # the bodies ran where the comparison passed; nested entries never compared
        assert r["ran"] == ["scaled", "inner", "scaled", "inner", "inner"]
