"""The README example runs as written and prints what it says."""

from pathlib import Path

from hyper_parallel.dtensor.testing import run_markdown_example

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_runs():
    out = run_markdown_example(README).splitlines()
    assert out[0] == "0 (0, 2, 4, 6) [0, 2]"
    assert out[5] == "5 (1, 3, 5, 7) [5, 7]"
    assert len(out) == 8
