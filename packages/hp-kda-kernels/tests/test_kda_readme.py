"""The README example runs as written."""

import re
from pathlib import Path

from hyper_parallel.dtensor.testing import run_markdown_example

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_runs():
    out = run_markdown_example(README)
    errors = [float(x) for x in re.findall(r"max \|\w+ - reference\|: (\S+)", out)]
    assert len(errors) == 2 and max(errors) < 1e-4, out
