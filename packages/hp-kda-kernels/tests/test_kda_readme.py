"""The README examples run as written."""

import re
from pathlib import Path

import pytest

from hyper_parallel.dtensor.testing import run_markdown_example

README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.mark.parametrize(
    ("index", "lines", "tol"),
    [(0, 2, 1e-4), (1, 3, 1e-4), (2, 2, 1e-4), (3, 2, 1e-4), (4, 2, 1e-4)],
)
def test_readme_example_runs(index: int, lines: int, tol: float) -> None:
    out = run_markdown_example(README, index)
    errors = [float(x) for x in re.findall(r"max \|[\w.]+ - reference\|: (\S+)", out)]
    assert len(errors) == lines and max(errors) < tol, out
