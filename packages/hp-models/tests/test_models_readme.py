"""The README example runs as written: on every rank the loss equals the serial loss."""

from pathlib import Path

import pytest

from hyper_parallel.dtensor.testing import run_markdown_example

README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.mark.timeout(300)
def test_readme_example_runs():
    out = run_markdown_example(README, timeout=280).splitlines()
    assert out == [f"{r} (2, 4, 48) (2, 16, 48) True" for r in range(4)]
