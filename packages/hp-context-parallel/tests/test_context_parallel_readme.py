"""The README example runs as written."""

from pathlib import Path

from hyper_parallel.dtensor.testing import run_markdown_example

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_runs():
    out = run_markdown_example(README)
    assert "bytes received per rank:" in out
