"""The renamed-keyword shim every layer uses: the old name warns at the caller's line and runs
as the new one; both names (the new one by keyword or by position) is a TypeError naming both."""

from __future__ import annotations

import warnings

import pytest

from hyper_parallel.dtensor.renamed import renamed_keyword


@renamed_keyword("pick", "backend", "kernel", "the fold kernel")
def pick(x: int, kernel: str = "auto", *, scale: int = 1) -> tuple[int, str, int]:
    return x, kernel, scale


class Holder:
    @renamed_keyword("Holder", "backend", "impl", "the implementation")
    def __init__(self, impl: str = "auto") -> None:
        self.impl = impl


def test_old_keyword_warns_at_the_caller_and_runs_as_the_new_one():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert pick(1, backend="torch", scale=2) == (1, "torch", 2)
        assert Holder(backend="npu").impl == "npu"
    assert [w.category for w in caught] == [DeprecationWarning, DeprecationWarning]
    assert str(caught[0].message) == ("pick: backend= is deprecated, use kernel= (the fold kernel)")
    assert "Holder: backend= is deprecated, use impl=" in str(caught[1].message)
    assert {w.filename for w in caught} == {__file__}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new name, or neither: no warning
        assert pick(1, kernel="triton") == (1, "triton", 1)
        assert pick(1) == (1, "auto", 1)
    assert pick.__name__ == "pick"


def test_both_names_is_a_type_error_naming_both():
    for call in (lambda: pick(1, kernel="torch", backend="torch"),
                 lambda: pick(1, "torch", backend="torch"),  # the new one by position
                 lambda: Holder("torch", backend="npu")):  # fmt: skip
        with pytest.raises(TypeError, match=r"got both (kernel|impl)= and backend="):
            call()


def test_a_function_without_the_new_parameter_is_refused_at_decoration():
    with pytest.raises(TypeError, match="has no parameter 'kernel'"):
        renamed_keyword("f", "backend", "kernel", "x")(lambda impl="auto": impl)
